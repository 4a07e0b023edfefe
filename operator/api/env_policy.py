"""Which environment variables an InferenceService may give its pods: an allow-list.

Every container of the pod (``preflight`` and ``fetch``, which hold the hub token, and the
engine, which holds the API keys and the tenants file) gets ``spec.env``. A variable can
change which code runs or where traffic and secrets go without touching the image the
admin allowed (``policy.images``), and the families that can are open-ended:

- the dynamic loader and libc: ``LD_PRELOAD``, ``LD_LIBRARY_PATH``, ``LD_AUDIT``,
  ``GCONV_PATH``, ``GLIBC_TUNABLES``, ``MALLOC_*``, ``LOCPATH``, ``HOSTALIASES``; ``PATH``
  (the runtime resolves the container's command through it); ``HOME`` (Python adds
  ``~/.local/lib/python3.X/site-packages`` to its path, and runs its ``.pth`` files);
- Python: ``PYTHONPATH``, ``PYTHONHOME``, ``PYTHONUSERBASE``, ``PYTHONSTARTUP``,
  ``PYTHONWARNINGS`` (imports a warning category's module), ``PYTHONBREAKPOINT``,
  ``PYTHONPYCACHEPREFIX`` (byte code from elsewhere);
- TLS and proxies, in any case: ``SSL_CERT_FILE``, ``SSL_CERT_DIR``,
  ``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE``, ``OPENSSL_CONF``, ``OPENSSL_MODULES``
  (loads providers), ``HTTPS_PROXY``, ``https_proxy``, ``ALL_PROXY``, ``NO_PROXY``: a CA
  and a proxy of the author's read the hub token in clear;
- the hub client (``HF_*``, ``HUGGINGFACE_*``: its cache, its token file, its endpoint);
- libraries that load shared objects or compiled code by name: ``NCCL_NET_PLUGIN``,
  ``NCCL_TUNER_PLUGIN``, ``NCCL_PROFILER_PLUGIN``, ``NCCL_CONF_FILE`` (which can name the
  others), ``CUDA_INJECTION64_PATH``, ``OMP_TOOL_LIBRARIES``, ``TORCHINDUCTOR_*`` and
  ``TRITON_*`` caches;
- what LeaderWorkerSet sets for a group (``LWS_*``: the leader's address the workers
  dial) and the operator's own (``VLLM_*``, ``KVLEDGER_*``).

No deny-list of those stays complete: every library in the image may read a new one in
its next release. So a resource may set only the names below, each a number, a level, a
switch or a network interface's name that tunes speed or logs; none names code to load, a
file to read, a host to reach or a secret. Anything else goes into an image the admin
allows (the image's own environment is the admin's choice): that is the escape hatch, so
no resource, and no Helm value that a CRD rule could not see, widens the list.

``envFrom`` imports every key of a ConfigMap or Secret, names the operator cannot check
before the pods start (and must not read: it reads no Secret), so it is refused whole:
``env`` with ``valueFrom.configMapKeyRef`` names each variable. ``valueFrom.secretKeyRef``
is refused (``ENV_SECRET_MESSAGE``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ALLOWED_ENV = (
    # torch and CUDA: the allocator's settings, cuBLAS's workspace (the planner counts it),
    # lazy module loading, the work queues, synchronous launches for debugging.
    "PYTORCH_CUDA_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG", "CUDA_MODULE_LOADING",
    "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_LAUNCH_BLOCKING",
    # CPU threads and Python's own output.
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "PYTHONUNBUFFERED",
    "PYTHONFAULTHANDLER",
    # NCCL's and gloo's choice of network and their logs (not their buffers: the planner
    # counts NCCL's at its defaults).
    "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_SOCKET_IFNAME", "NCCL_SOCKET_FAMILY",
    "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_IB_GID_INDEX", "NCCL_IB_TIMEOUT",
    "NCCL_IB_RETRY_CNT", "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE",
    "NCCL_NET_GDR_LEVEL", "NCCL_CROSS_NIC", "GLOO_SOCKET_IFNAME",
    # The hub client's timeouts and quiet switches (fetch).
    "HF_HUB_DOWNLOAD_TIMEOUT", "HF_HUB_ETAG_TIMEOUT", "HF_HUB_DISABLE_TELEMETRY",
    "HF_HUB_DISABLE_PROGRESS_BARS",
)

# No allowed variable holds a secret, and a Secret's value in a container's environment
# reaches the resource's status when the container fails on it: fetch's last log line (the
# kubelet's termination message, which the status quotes) was huggingface_hub's
# ``invalid literal for int() with base 10: '<the value>'`` for an HF_HUB_ETAG_TIMEOUT read
# from any Secret of the namespace. So valueFrom.secretKeyRef is refused: the Secrets a pod
# needs are named by the spec's own fields, whose values no error quotes.
ENV_SECRET_CEL = "!has(self.valueFrom) || !has(self.valueFrom.secretKeyRef)"
ENV_SECRET_MESSAGE = (
    "valueFrom.secretKeyRef is refused: none of the variables a resource may set holds a "
    "secret, and a container that fails on a Secret's value quotes it in the resource's "
    "status (its log's last line), handing the Secret to whoever may create an "
    "InferenceService; the Secrets a pod needs are the spec's own fields (apiKeySecretRef, "
    "tenantsSecretRef, model.tokenSecretRef)")


def env_secret_free(var: Mapping[str, Any]) -> bool:
    source = var.get("valueFrom")
    return not isinstance(source, Mapping) or "secretKeyRef" not in source


ENV_CEL = "self.name in [" + ", ".join(f"'{name}'" for name in ALLOWED_ENV) + "]"
# The source an envFrom entry names, in CEL and in Python (the refusal names it).
ENV_FROM_SOURCE_CEL = ("'envFrom ' + (has(self.configMapRef) ? 'configMapRef ' + "
                       "self.configMapRef.name : has(self.secretRef) ? 'secretRef ' + "
                       "self.secretRef.name : 'entry')")


def env_allowed(var: Mapping[str, Any]) -> bool:
    return var.get("name") in ALLOWED_ENV


def env_subject(var: Mapping[str, Any]) -> str:
    return f"env {var.get('name', '')}"


def env_from_source(source: Mapping[str, Any]) -> str:
    for kind in ("configMapRef", "secretRef"):
        if isinstance(source.get(kind), Mapping):
            return f"envFrom {kind} {source[kind].get('name', '')}"
    return "envFrom entry"


ENV_MESSAGE = (
    "not a variable a resource may set. The pods take only " + ", ".join(ALLOWED_ENV)
    + " (speed and log settings: none loads code, reads a file, reaches a host or holds a "
    "secret); the operator sets VLLM_*, KVLEDGER_*, HF_ENDPOINT and HF_TOKEN from the "
    "spec's fields (allowRuntimeLoraUpdating, apiKeySecretRef, model.endpoint, "
    "model.tokenSecretRef); any other belongs in an image the cluster admin allows (the "
    "operator's Helm value policy.images)")
ENV_FROM_MESSAGE = (
    "envFrom is refused: it imports every key of a ConfigMap or Secret, names kvledger "
    "cannot check before the pods start (a key LD_PRELOAD or HTTPS_PROXY would run code "
    "the cluster admin never approved or send the hub token elsewhere); name each variable "
    "in env instead, with valueFrom.configMapKeyRef")
