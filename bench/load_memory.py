"""The memory promise while loading, on the CPU: the process's memory sampled every 2 ms
through the engine's read phase (the weights loaded, fused and packed, as
``ModelRunner`` arranges them at start-up), against the plan made before it.

    .venv/bin/python bench/load_memory.py [--model DIR] [--big-layers 16] [--json OUT]

Without ``--model`` it writes a Llama as transformers writes it (random bf16 weights,
hidden 2048: 1.45 GB at 16 layers), as bench/cold_start.py does. The load runs in a
process of its own, a thread reading ``/proc/self/status`` beside it: the anonymous
memory (the process's own: the weights it copies, fuses and packs) and the file pages
it maps (the checkpoint's pages, the page cache's: shared, and taken back by the kernel
under pressure, a container's limit included), each less what the process held before
loading.

Claim (exit 1 with a line when it fails): the process's anonymous memory (its runtime's
included) peaks, while loading, at no more than the plan gives everything but the KV pool
(``required_bytes`` less ``kv_cache``: the load never borrows from the pool, which comes
after it). Reported, not claimed: what the load adds, peak and settled, against the
weights (on the CPU, while the timing that decides whether packing pays runs, its sample
is held packed beside its dense weights: up to ``cpu_linear.SAMPLE_BYTES``, the whole of a
small model's layers).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from cold_start import write_big  # noqa: E402

SAMPLE_S = 0.002


def status_kib() -> dict[str, int]:
    """This process's ``RssAnon`` and ``RssFile`` now, in KiB."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(value.split()[0])
    return out


class PeakSampler:
    """``status_kib``'s peaks, read every ``SAMPLE_S`` by a thread of its own from
    ``start`` to ``stop`` (the last moment counted too)."""

    def __init__(self) -> None:
        self.peak = status_kib()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            self._take()
            time.sleep(SAMPLE_S)

    def _take(self) -> dict[str, int]:
        now = status_kib()
        for key, value in now.items():
            self.peak[key] = max(self.peak[key], value)
        return now

    def start(self) -> PeakSampler:
        self._thread.start()
        return self

    def stop(self) -> dict[str, int]:
        """The figures at the stop; ``peak`` then holds the run's peaks."""
        self._done.set()
        self._thread.join()
        return self._take()


def child(model_dir: Path) -> dict:
    """One load, sampled: what the engine's read phase adds to the process's memory."""
    import torch

    from kvledger.engine.checkpoint.model_config import ModelConfig
    from kvledger.engine.core.cpu_threads import cap_torch_threads
    from kvledger.engine.core.runner import TORCH_DTYPES, ModelRunner
    from kvledger.engine.model.loader import Weights, weights_bytes
    from kvledger.engine.planner.plan import make_plan
    from kvledger.engine.settings.config import EngineConfig

    cap_torch_threads(torch)
    config = EngineConfig(model=str(model_dir), device="cpu", max_model_len=512)
    plan = make_plan(config)
    model_config = ModelConfig.from_dir(model_dir)
    before = status_kib()
    sampler = PeakSampler().start()
    started = time.perf_counter()
    weights = Weights(model_dir, model_config, TORCH_DTYPES[plan.model_dtype],
                      torch.device("cpu"))
    runner = ModelRunner(weights.load(), torch.device("cpu"), plan.max_model_len,
                         plan.kv.block_size)
    seconds = time.perf_counter() - started
    after = sampler.stop()
    peak = sampler.peak
    return {"plan_weights_bytes": plan.classes["weights"],
            "plan_required_bytes": plan.required_bytes,
            "plan_kv_cache_bytes": plan.classes["kv_cache"],
            "anon_before_bytes": before["RssAnon"] << 10,
            "resident_weights_bytes": weights_bytes(runner.model),
            "packed": runner.packed, "load_s": round(seconds, 3),
            "anon_peak_bytes": (peak["RssAnon"] - before["RssAnon"]) << 10,
            "anon_settled_bytes": (after["RssAnon"] - before["RssAnon"]) << 10,
            "file_peak_bytes": (peak["RssFile"] - before["RssFile"]) << 10,
            "file_settled_bytes": (after["RssFile"] - before["RssFile"]) << 10}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint folder (default: write one)")
    parser.add_argument("--big-layers", type=int, default=16)
    parser.add_argument("--json", type=Path, help="write the report here too")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from kvledger.engine.model.builtin import write_model
            model = write_big(Path(tmp) / "big", args.big_layers,
                              write_model("small-llama", Path(tmp) / "small"))
        done = subprocess.run([sys.executable, __file__, "--child", str(model)],
                              capture_output=True, text=True, check=False)
    if done.returncode:
        print(f"the load failed: {done.stderr.strip()[-2000:]}", file=sys.stderr)
        return 1
    report = json.loads(done.stdout.strip().splitlines()[-1])
    weights = report["plan_weights_bytes"]
    allowed = report["plan_required_bytes"] - report["plan_kv_cache_bytes"]
    report["anon_peak_over_weights"] = round(report["anon_peak_bytes"] / weights, 3)
    report["anon_settled_over_weights"] = round(report["anon_settled_bytes"] / weights, 3)
    peak = report["anon_before_bytes"] + report["anon_peak_bytes"]
    report["anon_peak_over_plan_but_kv"] = round(peak / allowed, 3)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    failures = []
    if peak > allowed:
        failures.append(f"the process's anonymous memory peaked at {peak} bytes while "
                        f"loading, over the plan's figure for all but the KV pool ({allowed})")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
