"""Time to ready, predicted and measured: `kvledger serve` started on a few checkpoints, from
a cold page cache (where this process may drop it) and a warm one.

    .venv/bin/python bench/cold_start.py [--big-layers 16] [--json]
    .venv/bin/python bench/cold_start.py --model DIR [--serve-flag=--FLAG=VALUE ...]

Checkpoints: the built-in tiny-llama and small-llama (``make-model``), and a Llama written
by transformers' ``save_pretrained`` (random bf16 weights, hidden 2048, ``--big-layers``
layers: about 1.6 GB at 16). For each, cold (``sync; echo 3 > /proc/sys/vm/drop_caches``
before the launch; skipped, and said, where that is not allowed) and then warm: the
launch to ``/ready`` timed here, and the engine's own phases from ``/v1/budget``'s
``time_to_ready`` (``planner/ready_time.py``): the read predicted before loading (the
weights' bytes over a timed read of the same files), the profile (its arithmetic over a
timed matmul) and the KV pool, against what each measured, then the warm-up.

Claim (exit 1 with a line when it fails): on the transformers checkpoint (or ``--model``'s,
served with the ``--serve-flag``s given) the read is predicted within 25% of what it
measured, cold and warm. The small built-in models are
reported, not claimed: their read is fixed costs (building modules, packing), not bytes.
Nor is the CPU's profile: a check of one short prompt (``profile_steps.CPU_CHECK_TOKENS``), fixed
costs, where a GPU's profiles the whole step budget.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from local_server import free_port, wait_ready  # noqa: E402

TOLERANCE = 0.25
CLAIMED = ("read",)  # the phases whose prediction is claimed (on the CPU)


def drop_caches() -> bool:
    """Empty the page cache; False where this process may not."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def write_big(folder: Path, layers: int, tokenizer_from: Path,
              max_shard_size: str | None = None) -> Path:
    """A Llama as transformers writes it: random weights in bfloat16, our tokenizer; in
    shards of at most ``max_shard_size`` (``"200MB"``) with an index, when given."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(
        folder, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


async def start(model_dir: Path, flags: tuple[str, ...] = ()) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "kvledger.engine.cli", "serve", "--model", str(model_dir),
               "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "512", "--log-level", "warning", *flags]
    began = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        await wait_ready(base, proc)
        wall = time.perf_counter() - began
        async with aiohttp.ClientSession() as session, session.get(base + "/v1/budget") as r:
            ready = (await r.json())["time_to_ready"]
        return {"launch_to_ready_s": round(wall, 3), **ready}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big-layers", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--model", type=Path,
                        help="time this checkpoint alone (claimed as the transformers one)")
    parser.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                        help="a flag for kvledger serve, e.g. --serve-flag="
                             "--safetensors-load-strategy=prefetch (repeatable)")
    args = parser.parse_args()
    from kvledger.engine.model.builtin import write_model

    report, failures = {}, []
    claimed = "transformers-llama" if args.model is None else str(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is not None:
            folders = {claimed: args.model}
        else:
            folders = {name: write_model(name, Path(tmp) / name)
                       for name in ("tiny-llama", "small-llama")}
            folders[claimed] = write_big(Path(tmp) / "big", args.big_layers,
                                         folders["small-llama"])
        for name, folder in folders.items():
            runs = {}
            for cache in ("cold", "warm"):
                if cache == "cold" and not drop_caches():
                    runs["cold"] = "not measured: the page cache cannot be dropped here"
                    continue
                runs[cache] = asyncio.run(start(folder, tuple(args.serve_flag)))
            report[name] = runs
            if name != claimed:
                continue
            for cache, run in runs.items():
                if isinstance(run, str):
                    continue
                for phase in CLAIMED:
                    want, got = run["predicted_s"][phase], run["measured_s"][phase]
                    if want is None or abs(want - got) > TOLERANCE * got:
                        failures.append(f"{name} ({cache} cache): {phase} predicted {want}s, "
                                        f"measured {got}s (claim: within {TOLERANCE:.0%})")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for name, runs in report.items():
            for cache, run in runs.items():
                if isinstance(run, str):
                    print(f"{name} {cache}: {run}")
                    continue
                phases = ", ".join(
                    f"{k} {v}s" + ("" if run["predicted_s"].get(k) is None
                                   else f" (predicted {run['predicted_s'][k]}s)")
                    for k, v in run["measured_s"].items())
                print(f"{name} {cache}: launch to ready {run['launch_to_ready_s']}s; "
                      f"{run['weight_file_bytes'] / 2**20:.0f} MiB at "
                      f"{(run['read_bytes_per_s'] or 0) / 2**20:.0f} MiB/s, matmuls at "
                      f"{(run['matmul_flops_per_s'] or 0) / 1e9:.0f} GFLOP/s; {phases}")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
