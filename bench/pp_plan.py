"""The per-stage plan of Llama-3.1-405B on nodes of 8 x 80 GiB GPUs at --pipeline-parallel-size
1, 2, 3 and 4 with --tensor-parallel-size 8 (the figures of README.md and docs/planner.md,
"Pipeline parallelism").

Writes a header-only bf16 checkpoint of Llama-3.1-405B's published config and tensors
(tests/data/published/Llama-3.1-405B.json; 756 GiB of tensors left sparse, 191 shards) and
runs ``kvledger plan`` on it for an 80 GiB GPU (what-if), 8192-token context, 16 sequences.
Prints each report and a table of every stage; exits 1 unless every stage count's per-GPU
weights add up to exactly the one-stage plan's (nothing lost or held twice: the model is
untied), the layers are split as vLLM's ``get_pp_indices`` splits them, and one stage does
not fit where two do.

    .venv/bin/python bench/pp_plan.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from budget_checkpoints import write_header_only  # noqa: E402
from published_models import published_config, published_tensors  # noqa: E402
from tp_plan import plan_each  # noqa: E402

from kvledger.engine.planner.stages import PARTITION_ENV, stage_bounds  # noqa: E402

GiB = 2**30
NAME = "Llama-3.1-405B"
FLAGS = ["--device-memory", "80GiB", "--max-model-len", "8192", "--max-num-seqs", "16",
         "--tensor-parallel-size", "8"]


def main() -> int:
    config = published_config(NAME)
    failed = []
    env = {k: v for k, v in os.environ.items() if k != PARTITION_ENV}  # vLLM's own split
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama-3.1-405b"
        write_header_only(model_dir, config, published_tensors(config), shards=191)
        rows = plan_each(model_dir, "llama-3.1-405b", FLAGS, "--pipeline-parallel-size",
                         (1, 2, 3, 4), env=env)
    whole = rows[0][2]["classes"]["weights"]
    print("| stages x GPUs | fits | stage | layers | weights / GPU | KV cache / GPU "
          "| required / GPU | limit / GPU |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for stages, code, p in rows:
        per_stage = p.get("stages") or [{"stage": 0, "layers": [0, 126], "classes": p["classes"],
                                         "required_bytes": p["required_bytes"],
                                         "limit_bytes": p["limit_bytes"]}]
        for s in per_stage:
            c = s["classes"]
            print(f"| {stages} x 8 | {'yes' if p['fits'] else 'no'} (exit {code}) "
                  f"| {s['stage'] + 1} | {s['layers'][0]}-{s['layers'][1] - 1} "
                  f"| {c['weights'] / GiB:.1f} GiB | {c['kv_cache'] / GiB:.1f} GiB "
                  f"| {s['required_bytes'] / GiB:.1f} GiB | {s['limit_bytes'] / GiB:.1f} GiB |")
        if sum(s["classes"]["weights"] for s in per_stage) != whole:
            failed.append(f"{stages} stages hold {sum(s['classes']['weights'] for s in per_stage)} "
                          f"weight bytes per GPU in all, one stage {whole}")
        split = [tuple(s["layers"]) for s in per_stage]
        if split != [tuple(b) for b in stage_bounds(config["num_hidden_layers"], stages, {})]:
            failed.append(f"{stages} stages split the layers {split}, not as vLLM does")
    if rows[0][2]["fits"] or not rows[1][2]["fits"]:
        failed.append("one stage of 8 x 80 GiB should not fit 405B, and two should")
    for line in failed:
        print(f"FAILED: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
