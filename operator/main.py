"""``kvledger operator``: run the kopf operator (all namespaces unless --namespace)."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import shutil
import tempfile
from pathlib import Path

import kopf

from kvledger.engine.errors import BadInput
from kvledger.operator.cluster.kube import KubeApi, KubeError
from kvledger.operator.render import autoscaling, render
from kvledger.operator.render.policy import POLICY_ENV, Policy

HELP = "run the kopf operator"

LOG_FORMATS = {"text": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL,
               "json": kopf.LogFormat.JSON}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                        help="watch only this namespace (repeatable; default: all namespaces)")
    parser.add_argument("--log-format", choices=sorted(LOG_FORMATS), default="text")
    parser.add_argument("--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--liveness", default=None, metavar="URL",
                        help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--engine-image",
                        default=os.environ.get("KVLEDGER_ENGINE_IMAGE", render.DEFAULT_IMAGE),
                        help="image for pods whose spec sets none (env KVLEDGER_ENGINE_IMAGE)")
    parser.add_argument("--prometheus-url",
                        default=os.environ.get("KVLEDGER_PROMETHEUS_URL",
                                               autoscaling.DEFAULT_PROMETHEUS_URL),
                        metavar="URL",
                        help="the Prometheus KEDA queries for spec.autoscaling provider keda "
                             "when the spec names none (env KVLEDGER_PROMETHEUS_URL; default "
                             f"{autoscaling.DEFAULT_PROMETHEUS_URL})")
    parser.add_argument("--keda-http-scaler",
                        default=os.environ.get("KVLEDGER_KEDA_HTTP_SCALER",
                                               autoscaling.DEFAULT_HTTP_SCALER),
                        metavar="HOST:PORT",
                        help="KEDA's HTTP add-on's external scaler, for spec.autoscaling."
                             "httpAddOn (env KVLEDGER_KEDA_HTTP_SCALER; default "
                             f"{autoscaling.DEFAULT_HTTP_SCALER}, where its chart installs it)")
    hook = parser.add_argument_group(
        "admission webhook", "refuse at `kubectl apply` an InferenceService that fits no node "
        "it may run on (the chart's webhook: values pass these)")
    hook.add_argument("--webhook-port", type=int, default=None, metavar="PORT",
                      help="serve the validating webhook over HTTPS on this port, path "
                           "/validate (default: no webhook)")
    hook.add_argument("--webhook-tls", choices=("self-signed", "cert-manager"),
                      default="self-signed",
                      help="self-signed: make a CA and certificate, keep them in "
                           "--webhook-secret and write the CA into --webhook-configuration; "
                           "cert-manager: read tls.crt and tls.key from --webhook-cert-dir")
    hook.add_argument("--webhook-cert-dir", default=None, metavar="DIR",
                      help="the mounted certificate Secret (cert-manager)")
    hook.add_argument("--webhook-service", default=None, metavar="NAME",
                      help="the webhook's Service, which the certificate names (self-signed)")
    hook.add_argument("--webhook-secret", default=None, metavar="NAME",
                      help="the Secret of the operator's namespace that keeps the certificate "
                           "(self-signed)")
    hook.add_argument("--webhook-configuration", default=None, metavar="NAME",
                      help="the ValidatingWebhookConfiguration whose caBundle the operator "
                           "writes (self-signed)")
    hook.add_argument("--webhook-timeout", type=float, default=10.0, metavar="SECONDS",
                      help="the configuration's timeoutSeconds: the answer comes within it "
                           "(default 10)")
    hook.add_argument("--webhook-mode", choices=("deny", "warn"), default="deny",
                      help="deny: refuse a run that fits no node; warn: allow it with a "
                           "warning (default deny)")


def operator_memo(default_image: str, kube: KubeApi | None = None, *,
                  prometheus_url: str = autoscaling.DEFAULT_PROMETHEUS_URL,
                  http_scaler: str = autoscaling.DEFAULT_HTTP_SCALER,
                  policy: Policy | None = None) -> kopf.Memo:
    """The state the handlers share (see handlers.py)."""
    from kvledger.operator.cluster.hub_models import HubModels

    return kopf.Memo(default_image=default_image, prometheus_url=prometheus_url,
                     http_scaler=http_scaler, policy=policy or Policy(), status_locks={}, apply_locks={},
                     kube=kube or KubeApi(), hub_models=HubModels())


def main(args: argparse.Namespace) -> int:
    # log_prefix None: kopf's own choice, as `kopf run` makes it: a text line names its
    # resource ("[NS/NAME] ..."), a JSON one carries it as fields.
    kopf.configure(verbose=args.verbose, log_format=LOG_FORMATS[args.log_format],
                   log_prefix=None)
    # What only the cluster admin may allow (the chart writes its policy and hub values):
    # a bad one stops the operator here, with one line.
    policy = Policy.from_json(os.environ.get(POLICY_ENV))
    where = webhook_tls(args) if args.webhook_port is not None else None
    from kvledger.operator.controller import handlers  # registers the handlers

    # Fail fast with one line, not kopf's retry loop, when there is no cluster to talk to.
    handlers.find_credentials(kopf.OperatorSettings())

    memo = operator_memo(args.engine_image, prometheus_url=args.prometheus_url,
                         http_scaler=args.keda_http_scaler, policy=policy)
    asyncio.run(_run(args, memo, where))
    return 0


def webhook_tls(args: argparse.Namespace) -> dict[str, str]:
    """Where the webhook's certificate comes from (BadInput: a flag is missing)."""
    if not 0 < args.webhook_port < 65536:
        raise BadInput(f"--webhook-port {args.webhook_port}: a port is 1-65535")
    if not 1 <= args.webhook_timeout <= 30:
        raise BadInput("--webhook-timeout: the API server waits 1 to 30 seconds")
    if args.webhook_tls == "cert-manager":
        if not args.webhook_cert_dir:
            raise BadInput("--webhook-tls cert-manager needs --webhook-cert-dir")
        return {"cert_dir": args.webhook_cert_dir}
    missing = [flag for flag in ("service", "secret", "configuration")
               if not getattr(args, f"webhook_{flag}")]
    if missing:
        raise BadInput("--webhook-tls self-signed needs "
                       + ", ".join(f"--webhook-{flag}" for flag in missing))
    namespace = os.environ.get("POD_NAMESPACE")
    if not namespace:
        raise BadInput("--webhook-tls self-signed keeps its certificate in the operator's "
                       "namespace: set POD_NAMESPACE (the chart sets it)")
    return {"namespace": namespace, "service": args.webhook_service,
            "secret": args.webhook_secret, "configuration": args.webhook_configuration}


async def _run(args: argparse.Namespace, memo: kopf.Memo, tls: dict[str, str] | None) -> None:
    renewing = None
    if tls is not None:
        renewing = await start_webhook(args, memo, tls)
    try:
        # One replica, no peering: the chart runs exactly one operator pod.
        await kopf.operator(clusterwide=not args.namespace, namespaces=args.namespace,
                            standalone=True, liveness_endpoint=args.liveness, memo=memo)
    finally:
        if renewing is not None:
            renewing.cancel()
        # SIGTERM: what waits for a hub or planning thread is dropped, and the reads under
        # way are abandoned (daemon threads: the process exits without them).
        memo.hub_models.close()
        if memo.get("webhook") is not None:
            memo.webhook.close()


async def start_webhook(args: argparse.Namespace, memo: kopf.Memo,
                        tls: dict[str, str]) -> asyncio.Task | None:
    """The webhook's certificate (made or read), its server in ``memo.webhook_server`` and
    its handlers registered; the task that renews a self-signed certificate, if any."""
    from kvledger.operator.cluster import certs
    from kvledger.operator.webhook import webhook

    memo.webhook = webhook.Webhook(timeout_s=args.webhook_timeout,
                                   refuse=args.webhook_mode == "deny", models=memo.hub_models)
    webhook.register(kopf.get_default_registry())
    if "cert_dir" in tls:
        folder = Path(tls["cert_dir"])
        ca = folder / "ca.crt"
        memo.webhook_server = webhook.server(args.webhook_port, folder / "tls.crt",
                                             folder / "tls.key",
                                             ca.read_bytes() if ca.is_file() else None,
                                             args.webhook_timeout)
        return None
    from kvledger.operator.controller import handlers

    kube = KubeApi(handlers.find_credentials(kopf.OperatorSettings()))
    try:
        files = await certs.ensure(kube, **tls)
    except KubeError as exc:
        await kube.close()
        raise BadInput(f"cannot set up the webhook's certificate: {exc}") from None
    folder = Path(tempfile.mkdtemp(prefix="kvledger-webhook-"))
    # The key leaves with the process (it stayed in /tmp after each operator's run).
    atexit.register(shutil.rmtree, folder, True)
    cert, key = files.write(folder)
    memo.webhook_server = webhook.server(args.webhook_port, cert, key, files.ca,
                                         args.webhook_timeout)
    return asyncio.create_task(certs.renew_forever(kube, folder, **tls))
