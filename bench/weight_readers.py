"""Weights from the checkpoint's files to tensors on the device: kvledger's reader against
fastsafetensors and runai-model-streamer, cold page cache and warm, beside a plain read.

    .venv/bin/python bench/weight_readers.py [--device cpu|cuda] [--model DIR] [--json OUT]

Without ``--model`` it writes a Llama as transformers writes it (random bf16 weights,
hidden 2048, 16 layers: 1.45 GB, one file), as bench/cold_start.py does. Each way runs in a
process of its own (no allocator or page-cache state carried from the one before), in
alternating order over ``--rounds`` rounds, cold (``drop_caches`` before it, where this
process may) and warm (after one untimed run); the median counts:

- ``plain read``: the files read in 64 MiB blocks into one reused buffer, nothing kept: the
  volume's (or the page cache's) own speed, the reference;
- ``kvledger``: what the engine's loader reads with, views of each file's memory map
  (``model/mapped_file.py``; safetensors' ``safe_open`` before 2026-12-07), each
  tensor on the device as an owned copy (``.clone()`` on the CPU: the engine's tensors are
  the file's mapped pages until used; ``.to(device)`` on a GPU);
- ``fastsafetensors`` (``SafeTensorsFileLoader``; on the CPU its ``nogds`` pread path) and
  ``runai-model-streamer`` (``SafetensorsStreamer``, to the CPU, then ``.to(device)``), when
  importable (neither is a dependency: ``pip install fastsafetensors
  runai-model-streamer``);
- ``engine load``: the engine's read phase as its start measures it: ``load_model``, then
  (on the CPU) q/k/v and gate/up fused and the linear layers packed for oneDNN, the files
  read as the default does (``--safetensors-load-strategy`` not given: read ahead on a
  remote volume); ``engine load, lazy|prefetch|eager`` the same with that strategy
  (checkpoint/read_ahead.py: the memory map alone, the files read ahead by 8 threads, or
  each read whole first).
  ``--shards N`` writes the checkpoint in about N files, where reading ahead has files to
  read side by side.

Claim (exit 1 with a line when it fails): no library reads more than 20% faster than
kvledger's reader in one cache (cold, warm) while no slower in the other: one that did would
be worth its dependency; one that trades a warm start for a cold one is not.
Reported, not claimed: the engine's whole load against the plain read (on the CPU packing
is compute, not reading).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from cold_start import drop_caches, write_big  # noqa: E402

TOLERANCE = 0.20
WAYS = ("plain read", "kvledger", "fastsafetensors", "runai-model-streamer", "engine load",
        "engine load, lazy", "engine load, prefetch", "engine load, eager")
LIBRARIES = ("fastsafetensors", "runai-model-streamer")


def weight_files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


# -- one way, in a process of its own ---------------------------------------------------------

def _plain(files: list[Path], device: str) -> None:
    buffer = bytearray(64 << 20)
    view = memoryview(buffer)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def _kvledger(files: list[Path], device: str) -> dict:
    from kvledger.engine.model.mapped_file import MappedFile

    out = {}
    for path in files:
        mapped = MappedFile(path)
        for name in mapped.names:
            tensor = mapped.tensor(name)
            out[name] = tensor.clone() if device == "cpu" else tensor.to(device)
    return out


def _fastsafetensors(files: list[Path], device: str) -> dict:
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    loader = SafeTensorsFileLoader(SingleGroup(), device, nogds=device == "cpu")
    try:
        loader.add_filenames({0: [str(p) for p in files]})
        buffers = loader.copy_files_to_device()
        out = {name: buffers.get_tensor(name) for name in loader.get_keys()}
        buffers.close()
    finally:
        loader.close()
    return out


def _runai(files: list[Path], device: str) -> dict:
    from runai_model_streamer import SafetensorsStreamer

    out = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files([str(p) for p in files])
        for name, tensor in streamer.get_tensors():
            out[name] = tensor if device == "cpu" else tensor.to(device)
    return out


def _engine(files: list[Path], device: str, strategy: str | None = None):
    import torch

    from kvledger.engine.checkpoint.model_config import ModelConfig
    from kvledger.engine.checkpoint.read_ahead import WeightReading
    from kvledger.engine.model.cpu_linear import pack_linears
    from kvledger.engine.model.fusion import fuse_projections
    from kvledger.engine.model.loader import load_model

    model_dir = files[0].parent
    target = torch.device(device)
    model = load_model(model_dir, ModelConfig.from_dir(model_dir), torch.bfloat16, target,
                       reading=WeightReading(strategy))
    fuse_projections(model)
    pack_linears(model, target, measure=False)
    return model


ENGINE_IMPORTS = ("safetensors.torch", "kvledger.engine.model.loader",
                  "kvledger.engine.model.fusion", "kvledger.engine.model.cpu_linear",
                  "kvledger.engine.checkpoint.model_config",
                  "kvledger.engine.checkpoint.read_ahead")
IMPORTS = {"plain read": (), "kvledger": ("safetensors", "safetensors.torch"),
           "fastsafetensors": ("fastsafetensors",),
           "runai-model-streamer": ("runai_model_streamer",),
           "engine load": ENGINE_IMPORTS, "engine load, lazy": ENGINE_IMPORTS,
           "engine load, prefetch": ENGINE_IMPORTS, "engine load, eager": ENGINE_IMPORTS}
RUNS = {"plain read": _plain, "kvledger": _kvledger, "fastsafetensors": _fastsafetensors,
        "runai-model-streamer": _runai, "engine load": _engine,
        "engine load, lazy": functools.partial(_engine, strategy="lazy"),
        "engine load, prefetch": functools.partial(_engine, strategy="prefetch"),
        "engine load, eager": functools.partial(_engine, strategy="eager")}


def run_one(way: str, model: Path, device: str) -> None:
    """The child: import what the way needs, then time it alone; prints its seconds."""
    import importlib

    import torch  # imports are not the read: each way's modules are loaded first

    for module in IMPORTS[way]:
        importlib.import_module(module)
    files = weight_files(model)
    if device == "cuda":
        torch.cuda.init()
    started = time.perf_counter()
    result = RUNS[way](files, device)
    if device == "cuda":
        torch.cuda.synchronize()
    print(json.dumps({"seconds": time.perf_counter() - started}))
    del result


# -- the parent ---------------------------------------------------------------------------------

def available(way: str) -> bool:
    module = {"fastsafetensors": "fastsafetensors",
              "runai-model-streamer": "runai_model_streamer"}.get(way)
    if module is None:
        return True
    import importlib.util
    return importlib.util.find_spec(module) is not None


def timed(way: str, model: Path, device: str) -> float:
    answer = subprocess.run(
        [sys.executable, __file__, "--child", way, "--model", str(model), "--device", device],
        capture_output=True, text=True, timeout=600, check=False)
    if answer.returncode != 0:
        raise RuntimeError(f"{way}: exit {answer.returncode}: {answer.stderr.strip()[-400:]}")
    return json.loads(answer.stdout.strip().splitlines()[-1])["seconds"]


def write_model(folder: Path, shards: int = 1) -> Path:
    tokenizer = folder / "tiny"
    subprocess.run([sys.executable, "-m", "kvledger.engine.cli", "make-model", "tiny-llama",
                    str(tokenizer)], check=True, capture_output=True)
    # 1.45 GB in all; transformers cuts shards at tensor boundaries, below the size given
    return write_big(folder / "big", 16, tokenizer,
                     None if shards <= 1 else f"{1450 // shards + 1}MB")


def measure(model: Path, device: str, rounds: int, cold: bool = True,
            only: tuple[str, ...] = WAYS, partial: Path | None = None) -> dict:
    """Every importable way's seconds (of ``only``), cold and warm, over ``rounds``; a way
    that fails (a library that cannot run on this device) is reported with its error and
    left out of the later rounds, so one failure costs a GPU run none of the others'
    figures. After each way of each round the report so far is written to ``partial``: a
    run stopped by its time limit keeps what it measured."""
    ways = [w for w in WAYS if w in only and available(w)]
    size = sum(p.stat().st_size for p in weight_files(model))
    cold_ok = cold and drop_caches()
    seconds: dict[str, dict[str, list[float]]] = {"cold": {}, "warm": {}}
    failed: dict[str, str] = {}
    for round_ in range(rounds):
        order = ways if round_ % 2 == 0 else ways[::-1]
        for way in order:
            if way in failed:
                continue
            try:
                if cold_ok:
                    drop_caches()
                    cold_s = timed(way, model, device)
                timed("plain read", model, device)  # the files in the page cache
                warm_s = timed(way, model, device)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                failed[way] = str(exc).strip().splitlines()[-1][:300]
                continue
            if cold_ok:
                seconds["cold"].setdefault(way, []).append(cold_s)
            seconds["warm"].setdefault(way, []).append(warm_s)
            if partial is not None:
                partial.write_text(json.dumps(_report(
                    device, size, round_ + 1, cold_ok, only, ways, failed, seconds)) + "\n")
    return _report(device, size, rounds, cold_ok, only, ways, failed, seconds)


def _report(device: str, size: int, rounds: int, cold_ok: bool, only: tuple[str, ...],
            ways: list[str], failed: dict[str, str],
            seconds: dict[str, dict[str, list[float]]]) -> dict:
    report = {"device": device, "file_bytes": size, "rounds": rounds, "cold_measured": cold_ok,
              "missing": [w for w in WAYS if w in only and w not in ways], "failed": failed,
              "seconds": seconds, "MiB_per_s": {}}
    for cache, by_way in seconds.items():
        report["MiB_per_s"][cache] = {way: round(size / statistics.median(s) / 2**20)
                                      for way, s in by_way.items() if way not in failed}
    return report


def verdict(report: dict) -> list[str]:
    """The claim's failures, one line each: a library more than ``TOLERANCE`` faster than
    kvledger's reader in one cache and no slower in the other (one that trades a warm start
    for a cold one, or back, is no reason to switch)."""
    speeds = report["MiB_per_s"]
    caches = [cache for cache in ("cold", "warm") if "kvledger" in speeds.get(cache, {})]
    failures = []
    for library in LIBRARIES:
        if not all(library in speeds[cache] for cache in caches):
            continue
        ratios = {cache: speeds[cache][library] / speeds[cache]["kvledger"] for cache in caches}
        if caches and max(ratios.values()) > 1 + TOLERANCE and min(ratios.values()) >= 1:
            failures.append(f"{library} reads " + ", ".join(
                f"{ratio:.2f}x kvledger's speed {cache}" for cache, ratio in ratios.items()))
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", type=Path, help="a checkpoint folder (default: write one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=1,
                        help="write the checkpoint in about this many files (default 1)")
    parser.add_argument("--json", type=Path, help="write the report here too")
    parser.add_argument("--warm-only", action="store_true",
                        help="leave the page cache alone (no cold runs)")
    parser.add_argument("--only", nargs="+", choices=WAYS, default=WAYS, metavar="WAY",
                        help="time these ways alone (default: all)")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_one(args.child, args.model, args.device)
        return 0
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("error: --device cuda needs a CUDA device; this machine has none",
                  file=sys.stderr)
            return 2
    if args.model is not None and not weight_files(args.model):
        print(f"error: {args.model} holds no .safetensors file", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_model(Path(tmp), args.shards)
        report = measure(model, args.device, args.rounds, cold=not args.warm_only,
                         only=tuple(args.only), partial=args.json)
    for cache, speeds in report["MiB_per_s"].items():
        print(f"{cache}: " + ", ".join(f"{way} {speed} MiB/s" for way, speed in speeds.items()))
    if not report["cold_measured"]:
        print("cold: not measured (--warm-only, or this process may not drop the page cache)")
    if report["missing"]:
        print(f"not importable, not measured: {', '.join(report['missing'])}")
    for way, error in report["failed"].items():
        print(f"{way}: failed, not measured: {error}")
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    failures = verdict(report)
    for line in failures:
        print(f"CLAIM FAILED: {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
