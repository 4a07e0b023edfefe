"""``kvledger operator``: run the kopf operator (all namespaces unless --namespace)."""

from __future__ import annotations

import argparse
import asyncio
import os

import kopf

from kvledger.operator import autoscaling, render
from kvledger.operator.kube import KubeApi
from kvledger.operator.policy import POLICY_ENV, Policy

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


def operator_memo(default_image: str, kube: KubeApi | None = None, *,
                  prometheus_url: str = autoscaling.DEFAULT_PROMETHEUS_URL,
                  policy: Policy | None = None) -> kopf.Memo:
    """The state the handlers share (see handlers.py)."""
    return kopf.Memo(default_image=default_image, prometheus_url=prometheus_url,
                     policy=policy or Policy(), status_locks={}, apply_locks={},
                     kube=kube or KubeApi())


def main(args: argparse.Namespace) -> int:
    kopf.configure(verbose=args.verbose, log_format=LOG_FORMATS[args.log_format])
    # What only the cluster admin may allow (the chart writes its policy and hub values):
    # a bad one stops the operator here, with one line.
    policy = Policy.from_json(os.environ.get(POLICY_ENV))
    from kvledger.operator import handlers  # registers the handlers

    # Fail fast with one line, not kopf's retry loop, when there is no cluster to talk to.
    handlers.find_credentials(kopf.OperatorSettings())

    # One replica, no peering: the chart runs exactly one operator pod.
    asyncio.run(kopf.operator(
        clusterwide=not args.namespace, namespaces=args.namespace, standalone=True,
        liveness_endpoint=args.liveness,
        memo=operator_memo(args.engine_image, prometheus_url=args.prometheus_url,
                           policy=policy)))
    return 0
