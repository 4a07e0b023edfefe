"""``kvledger run SERVICE.yaml``: the same InferenceService manifest, on this machine.

1. validate it against the CRD schema (crd.py) and the CRD's cross-field rules (spec_rules.py);
2. run the pre-flight in-process with the flags the pod's containers would get: on a
   refusal, print the breakdown and remedies and exit 3, before loading anything;
3. exec ``kvledger serve`` with those flags. exec replaces this process, so SIGTERM and
   Ctrl-C reach the server directly (it drains and exits on its own).

``spec.model.path`` is read the way the kubelet mounts it: with a ``hostPath`` volume,
``mountPath/x`` is ``hostPath.path/x`` here; otherwise the path is used as is.
``--model-path`` overrides it (e.g. for a manifest whose model lives on a PVC).

``spec.resources.limits.memory`` is the pod's cgroup limit, which caps what host memory
the engine sees (``--device cpu`` with ``gpus: 0``, or a unified pool). There is no such
cgroup here, so the pre-flight and the exec'd ``serve`` get ``--container-memory-limit``
and read host memory as the pod would.

``spec.nodes`` above 1 (a LeaderWorkerSet group on a cluster) runs as that many processes
of this machine, as the group's pods run: machine 0 (``serve --node-rank 0``, the API) and
the others ``--headless``, meeting at 127.0.0.1 with a key drawn for the run (as the
operator's Secret is), each with ``gpus`` GPUs of its own (``CUDA_VISIBLE_DEVICES``). The
others start in sessions of their own, so Ctrl-C reaches machine 0 alone: it drains, then
stops them; they end with it however it ends.

A hub model (``spec.model.uri``) is passed as ``--model hf://...``: the pre-flight reads
its headers over HTTP and ``serve`` downloads it into the engine's default cache. The
shell's ``HF_TOKEN`` and ``HF_ENDPOINT`` apply; ``model.tokenSecretRef``,
``model.endpoint`` and ``model.cache`` name cluster objects and are ignored here, as are
the pod's placement and environment fields and ``autoscaling`` (one process serves: there
is nothing to scale), validated all the same, and a line says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import posixpath
import secrets
import subprocess
import sys
from typing import Any

import yaml

from kvledger.engine.checkpoint.hub.uri import is_hub_uri
from kvledger.engine.errors import EXIT_DOES_NOT_FIT, BadInput
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.node_config import NODE_KEY_ENV, free_port_pair
from kvledger.engine.settings.serve_config import ServeConfig
from kvledger.operator.api.crd import validate_manifest
from kvledger.operator.api.spec import Model, ServiceSpec, parse_spec

HELP = "run an InferenceService manifest locally, no cluster"

# What only a cluster gives meaning to: validated, then ignored by `kvledger run`.
CLUSTER_ONLY_FIELDS = ("nodeSelector", "tolerations", "affinity", "priorityClassName",
                       "runtimeClassName", "imagePullSecrets", "serviceAccountName", "env",
                       "envFrom", "podAnnotations", "podLabels", "autoscaling", "inferencePool",
                       "apiKeySecretRef",  # locally: serve's --api-key or KVLEDGER_API_KEY
                       "tenantsSecretRef",  # locally: serve's --tenants-file
                       "sleep")  # locally: serve's --sleep-level-file, or POST /sleep
CLUSTER_ONLY_MODEL_FIELDS = ("tokenSecretRef", "endpoint", "cache")


# A manifest is a few KiB; these bound what a hostile file can cost before it is refused.
MAX_MANIFEST_BYTES = 1536 * 1024
MAX_MANIFEST_DEPTH = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", metavar="SERVICE.yaml", help="an InferenceService manifest")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on")
    parser.add_argument("--port", type=int, default=None,
                        help=f"port to serve on (default: spec.port, else {ServeConfig.port})")
    parser.add_argument("--model-path", default=None, metavar="DIR",
                        help="local checkpoint directory (default: spec.model.path, mapped "
                             "through a hostPath volume)")
    parser.add_argument("--preflight-only", action="store_true",
                        help="validate and plan, then exit (0 fits, 3 does not fit)")


def load_manifest(path: str) -> dict[str, Any]:
    """The one InferenceService in a YAML file; BadInput with a one-line reason otherwise,
    a file over ``MAX_MANIFEST_BYTES`` or nested deeper than ``MAX_MANIFEST_DEPTH``
    included (checked on the event stream, before anything is built from it)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise BadInput(f"{path} is over {MAX_MANIFEST_BYTES // 1024} KiB: too large for a "
                           "manifest (a Kubernetes object is at most about 1.5 MiB)")
        text = raw.decode("utf-8")
        depth = deepest = 0
        for event in yaml.parse(text):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                deepest = max(deepest, depth)
                if deepest > MAX_MANIFEST_DEPTH:
                    raise BadInput(f"{path} nests deeper than {MAX_MANIFEST_DEPTH} levels: "
                                   "not an InferenceService manifest")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except OSError as exc:
        raise BadInput(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path} is not UTF-8 text (byte {exc.start}): not a YAML manifest") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise BadInput(f"{path} is not valid YAML{where}") from None
    if len(docs) != 1:
        raise BadInput(f"{path} must hold exactly one InferenceService, found {len(docs)} documents")
    return validate_manifest(docs[0])


def local_config(spec: ServiceSpec, model_path: str | None = None,
                 ) -> EngineConfig:
    """The pod's flags, for this machine: the model path mapped to a local one, the
    device left to auto-detect unless the spec asks for none (``gpus: 0`` -> the CPU), and
    host memory capped by the container's memory limit as the pod's cgroup caps it.
    Adapter directories (``spec.adapters``) are mapped as the model's path is."""
    adapters = tuple(m if is_hub_uri(m.path) else
                     dataclasses.replace(m, path=local_path(spec.model, m.path))
                     for m in spec.engine.lora_modules)
    return dataclasses.replace(
        spec.engine, model=model_path or local_model_path(spec), lora_modules=adapters,
        device="cpu" if spec.gpus == 0 else "auto",
        container_memory_limit_bytes=spec.container_memory_limit_bytes)


def ignored_fields(spec: dict[str, Any]) -> list[str]:
    """The spec's fields that mean something on a cluster only, as ``spec.X`` paths."""
    model = spec.get("model") or {}
    return ([f"spec.{field}" for field in CLUSTER_ONLY_FIELDS if field in spec]
            + [f"spec.model.{field}" for field in CLUSTER_ONLY_MODEL_FIELDS if field in model])


def serve_argv(flags: list[str], host: str, port: int,
               spec: ServiceSpec) -> list[str]:
    """``serve`` with the pod's flags, its own ones (port, drain, queue) included, but the
    files only a cluster mounts (``tenantsSecretRef`` and ``sleep`` are cluster-only here)."""
    local = dataclasses.replace(spec, serve=dataclasses.replace(
        spec.serve, port=port, tenants_file=None, sleep_level_file=None))
    return [sys.executable, "-m", "kvledger.engine.cli", "serve", *flags,
            "--host", host, *local.serving_flags()]


def main(args: argparse.Namespace) -> int:
    doc = load_manifest(args.manifest)
    spec = parse_spec(doc["spec"])
    config = local_config(spec, args.model_path)
    flags = config.to_flags()
    name = doc["metadata"]["name"]
    ignored = ignored_fields(doc["spec"])
    if ignored:
        sys.stdout.write(f"{name}: ignored off the cluster: {', '.join(ignored)}\n")
    if spec.model.uri is not None and args.model_path is None:
        return _run_hub_model(name, spec, flags, args)

    # The planner is torch-free; importing it here keeps `run --help` instant.
    from kvledger.engine.checkpoint.model_config import ModelConfig
    from kvledger.engine.planner.plan import make_plan
    from kvledger.engine.planner.predicted_start import with_predicted_start
    from kvledger.engine.planner.report import render_report

    plan = with_predicted_start(make_plan(config))
    ModelConfig.from_dir(config.model)  # what `serve` would refuse at once (as the preflight)
    if not plan.fits:
        sys.stderr.write(f"{name}: pre-flight refused the plan\n{render_report(plan)}")
        return EXIT_DOES_NOT_FIT
    sys.stdout.write(f"{name}: pre-flight passed\n{render_report(plan)}")
    return 0 if args.preflight_only else _exec_serve(name, spec, flags, args)


def _run_hub_model(name: str, spec: ServiceSpec, flags: list[str],
                   args: argparse.Namespace) -> int:
    """The pod's own pre-flight, ``kvledger preflight --model hf://...``, in-process (it
    reads the headers over HTTP and prints the report), then ``serve``."""
    from kvledger.engine.cli import build_parser

    sys.stdout.write(f"{name}: pre-flight of {spec.model.uri} (headers over HTTP)\n")
    sys.stdout.flush()
    preflight = build_parser("preflight").parse_args([*flags, "--termination-log", os.devnull])
    preflight.log_plan_line = False  # a person reads it, not the operator
    code = preflight._module.main(preflight)  # bad input raises: one line, exit 2
    if code == EXIT_DOES_NOT_FIT:
        sys.stderr.write(f"{name}: pre-flight refused the plan\n")
    if code != 0:
        return code
    sys.stdout.write(f"{name}: pre-flight passed\n")
    return 0 if args.preflight_only else _exec_serve(name, spec, flags, args)


def _exec_serve(name: str, spec: ServiceSpec, flags: list[str],
                args: argparse.Namespace) -> int:
    port = args.port if args.port is not None else spec.serve.port
    argv = serve_argv(flags, args.host, port, spec)
    env = None
    if spec.nodes > 1:
        argv, env = _start_group(name, spec, argv)
    sys.stdout.write(f"{name}: exec kvledger serve {' '.join(argv[4:])}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    if env is None:
        os.execv(argv[0], argv)
    else:
        os.execve(argv[0], argv, env)
    return 1  # not reached: exec replaced this process


def _start_group(name: str, spec: ServiceSpec, argv: list[str]
                 ) -> tuple[list[str], dict[str, str]]:
    """Machines 1..nodes-1 started (headless, sessions of their own); machine 0's argv
    and environment, for this process to become."""
    master = free_port_pair()
    group = ["--nnodes", str(spec.nodes), "--master-addr", "127.0.0.1",
             "--master-port", str(master)]
    env = {**os.environ, NODE_KEY_ENV: secrets.token_hex(32)}
    for rank in range(1, spec.nodes):
        sys.stdout.write(f"{name}: machine {rank} of {spec.nodes}: kvledger serve --node-rank "
                         f"{rank} --headless\n")
        subprocess.Popen([*argv, *group, "--node-rank", str(rank), "--headless"],
                         env=_gpus_of(env, spec.gpus, rank), start_new_session=True)
    return [*argv, *group, "--node-rank", "0"], _gpus_of(env, spec.gpus, 0)


def _gpus_of(env: dict[str, str], gpus: int, rank: int) -> dict[str, str]:
    """``env`` with machine ``rank``'s own ``gpus`` GPUs visible (of those visible here)."""
    if gpus == 0:
        return env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(64)]
    mine = devices[rank * gpus:(rank + 1) * gpus]
    if len(mine) < gpus:
        raise BadInput(f"nodes x gpus GPUs: machine {rank} finds no {gpus} GPUs of its own in "
                       f"CUDA_VISIBLE_DEVICES={visible}")
    return {**env, "CUDA_VISIBLE_DEVICES": ",".join(mine)}


def local_model_path(spec: ServiceSpec) -> str:
    """Where ``spec.model.path`` is on this machine, mapped the way the kubelet mounts it
    (a ``spec.model.uri`` is returned as it is).

    With a ``hostPath`` volume, the pod sees ``hostPath.path`` at ``mountPath``, so
    ``mountPath/x`` is ``hostPath.path/x`` here. Without a volume, or with a PVC (which has
    no meaning off the cluster), the path is taken as a local path. Paths are normalised
    (``/models/./m/`` is ``/models/m``); the rules refuse a ``..`` segment.
    """
    model = spec.model
    if model.path is None:
        return model.uri or ""  # the engine downloads it into its own cache
    return local_path(model, model.path)


def local_path(model: Model, pod_path: str) -> str:
    """Where a path the pod sees (on ``spec.model.volume``) is on this machine."""
    path = posixpath.normpath(pod_path)
    if model.volume is None or model.volume.host_path is None:
        return path
    relative = posixpath.relpath(path, posixpath.normpath(model.volume.mount_path))
    host = model.volume.host_path
    return host if relative == "." else posixpath.join(host, relative)
