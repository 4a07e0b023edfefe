"""``kvledger fetch --model hf://ORG/NAME[@REVISION] [--download-dir DIR]``.

Downloads the files the engine needs (config.json, the tokenizer and generation configs,
model.safetensors or the index and its shards) into the hub cache, pinned to the commit
the revision resolves to, and prints one line: what it downloaded and the snapshot's
folder. Files already in the cache are not downloaded again, so a second run downloads
nothing. ``--lora-modules NAME=hf://...`` downloads those LoRA adapters too
(adapter_config.json, adapter_model.safetensors) into the same cache. Exit 0; bad input (unknown repo or revision, a gated repo without a token, no
safetensors, the hub unreachable after bounded retries) is one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse

from kvledger.engine.checkpoint.hub.adapters import adapter_directory
from kvledger.engine.checkpoint.hub.cache import fetch
from kvledger.engine.checkpoint.hub.reads import DEFAULT_HUB_TIMEOUT_S
from kvledger.engine.checkpoint.hub.repo import is_hub_uri, parse_uri
from kvledger.engine.checkpoint.hub.uri import model_reference
from kvledger.engine.errors import EXIT_OK, BadInput
from kvledger.engine.planner.report import format_size
from kvledger.engine.settings.kinds import positive_seconds
from kvledger.engine.settings.lora_config import lora_module_arg

HELP = "download an hf:// model's files the engine needs into the hub cache"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="hf://ORG/NAME[@REVISION]",
                        help="the hub model, hf://ORG/NAME or the bare ORG/NAME as vLLM takes "
                             "it (token: $HF_TOKEN, mirror: $HF_ENDPOINT)")
    parser.add_argument("--download-dir", default=None, metavar="DIR",
                        help="the hub cache to download into (default: huggingface_hub's, "
                             "$HF_HUB_CACHE or $HF_HOME/hub)")
    parser.add_argument("--hub-timeout", type=positive_seconds, default=DEFAULT_HUB_TIMEOUT_S,
                        metavar="SECONDS",
                        help="the listing and index must be read within this (default "
                             f"{DEFAULT_HUB_TIMEOUT_S:g}); the downloads are not bounded by it")
    parser.add_argument("--lora-modules", nargs="+", type=lora_module_arg, default=[],
                        metavar="NAME=hf://ORG/NAME[@REVISION]",
                        help="LoRA adapters on the hub to download into the same cache")


def main(args: argparse.Namespace) -> int:
    args.model = model_reference(args.model)  # a bare ORG/NAME, as `vllm serve` takes it
    if not is_hub_uri(args.model):
        raise BadInput(f"kvledger fetch: --model must be hf://ORG/NAME[@REVISION], got "
                       f"{args.model!r} (a local directory needs no fetch)")
    if args.download_dir is not None and not args.download_dir:
        raise BadInput("--download-dir must not be empty")
    result = fetch(parse_uri(args.model), args.download_dir, timeout_s=args.hub_timeout)
    print(f"fetched {result.model.uri} (commit {result.commit}): downloaded "
          f"{len(result.downloaded_files)} files, {format_size(result.downloaded_bytes)} "
          f"({result.downloaded_bytes} bytes), {result.cached_files} already cached; "
          f"snapshot {result.path}")
    for adapter in args.lora_modules:
        if not is_hub_uri(adapter.path):
            raise BadInput(f"kvledger fetch: --lora-modules {adapter.name}={adapter.path}: a "
                           "local adapter directory needs no fetch")
        where = adapter_directory(adapter.path, args.download_dir, hub_timeout_s=args.hub_timeout)
        print(f"fetched LoRA adapter {adapter.name} ({adapter.path}): {where}")
    return EXIT_OK
