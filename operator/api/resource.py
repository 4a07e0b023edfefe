"""The InferenceService resource: its names, and its spec's defaults.

The CRD (``crd_schema.py``) declares these defaults and the parsed spec (``spec.py``) falls
back to them, so an API server that applied them and one that did not (or ``kvledger
run``, which has none) give the same spec. Serve's own fields (``port``,
``shutdownGraceSeconds``, the line's) take serve's defaults, declared with each option in
``kvledger.engine.settings.serve_config.ServeConfig``.
"""

from __future__ import annotations

GROUP = "kvledger.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
# KServe owns "isvc"; ours must not clash with it.
SHORT_NAMES = ["kvis"]
API_VERSION = f"{GROUP}/{VERSION}"

DEFAULT_GPUS = 1
# spec.nodes: the pods of one replica (a LeaderWorkerSet group when more than 1).
DEFAULT_NODES = 1
MAX_NODES = 64
DEFAULT_REPLICAS = 1
DEFAULT_MOUNT_PATH = "/models"
# Where the engine reads spec.tenantsSecretRef's file (a Secret volume, read-only).
TENANTS_DIR = "/etc/kvledger/tenants"
TENANTS_FILE = f"{TENANTS_DIR}/tenants.yaml"
# Where the engine reads spec.sleep (with engine.enableSleepMode): a ConfigMap the operator
# owns, NAME-sleep, its key "level" mounted read-only (serve --sleep-level-file).
SLEEP_DIR = "/etc/kvledger/sleep"
SLEEP_KEY = "level"
SLEEP_LEVEL_FILE = f"{SLEEP_DIR}/{SLEEP_KEY}"


# Where the engine reads the objectives of its InferencePool (spec.inferencePool, with the
# admin's gateway addresses): a ConfigMap the operator owns, NAME-objectives, mounted
# read-only (serve --objectives-file), rewritten as InferenceObjectives change.
OBJECTIVES_DIR = "/etc/kvledger/objectives"
OBJECTIVES_KEY = "objectives.yaml"
OBJECTIVES_FILE = f"{OBJECTIVES_DIR}/{OBJECTIVES_KEY}"


def objectives_config_map(name: str) -> str:
    """The ConfigMap holding the objectives of a resource's InferencePool."""
    return f"{name}-objectives"


def sleep_config_map(name: str) -> str:
    """The ConfigMap holding a resource's spec.sleep."""
    return f"{name}-sleep"
# Where the pods talk to the hub when neither the spec nor the admin (Helm hub.endpoints)
# names another.
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"

# spec.inferencePool: the Gateway API Inference Extension's pool (render/gateway.py).
PICKER_FAILURE_MODES = ("FailClose", "FailOpen")
DEFAULT_PICKER_FAILURE_MODE = "FailClose"
DEFAULT_PICKER_PORT = 9002  # the Endpoint Picker's ext-proc port in GAIE's own chart

# Autoscaling: what the HPA or KEDA scales the InferenceService on (autoscaling.py names
# the Prometheus series), and who does it; the first of each is the default.
AUTOSCALING_METRICS = ("kvReservedRatio", "requestsWaiting", "rejectionRate")
AUTOSCALING_PROVIDERS = ("hpa", "keda")
DEFAULT_MIN_REPLICAS = 1
# autoscaling.httpAddOn: in-flight requests a pod for the add-on's metric (its own default).
DEFAULT_HTTP_CONCURRENCY = 100
# autoscaling.httpAddOn.coldStart: what a request meets while no pod is ready. "hold": the
# interceptor holds it until one is (readinessTimeout); "retryAfter": the interceptor answers
# 503 at once with a Retry-After of the predicted time to ready, and the service wakes.
HTTP_COLD_STARTS = ("hold", "retryAfter")
# That Retry-After until one start is measured (status.startup.seconds.total).
DEFAULT_START_S = 60
# Its readiness timeout, a Go duration as the add-on reads one ("90s", "5m", "1h30m"), and
# the Host headers it routes (a leading "*." or "*" alone for any).
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
HOST_PATTERN = r"^(\*|(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)$"
MAX_HTTP_HOSTS = 16
# The per-pod target each metric holds when spec.autoscaling.target is not given.
DEFAULT_TARGETS = {"kvReservedRatio": "0.8", "requestsWaiting": "4", "rejectionRate": "1"}
