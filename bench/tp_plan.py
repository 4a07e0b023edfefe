"""The per-GPU plan of Llama-3-70B at --tensor-parallel-size 1, 2, 4 and 8 (the figures of
README.md and docs/planner.md, "Tensor parallelism").

Writes the sparse Llama-3-70B-shaped bf16 checkpoint of ``plan_speed.py`` (its real
headers, no tensor data on disk) and runs ``kvledger plan`` on it for an 80 GiB GPU
(what-if), 8192-token context, 16 sequences. Prints each report and a table; exits 1
unless the per-GPU weights of N GPUs add up to no less than one GPU's (nothing lost in
the split) and to at most 1% more (only the norms are held N times).

    .venv/bin/python bench/tp_plan.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from plan_speed import write_sparse_checkpoint

GiB = 2**30
FLAGS = ["--device-memory", "80GiB", "--max-model-len", "8192", "--max-num-seqs", "16"]
KVLEDGER = str(Path(sys.executable).with_name("kvledger"))


def plan_each(model_dir: Path, name: str, flags: list[str], flag: str, values: tuple[int, ...],
              env: dict[str, str] | None = None) -> list[tuple[int, int, dict]]:
    """``kvledger plan`` of ``model_dir`` with ``flags`` and ``flag`` at each of ``values``:
    its report printed (as ``name``), then (value, exit status, plan JSON) of each."""
    rows = []
    for value in values:
        argv = [KVLEDGER, "plan", str(model_dir), *flags, flag, str(value)]
        text = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        print(f"$ kvledger plan {name} {' '.join(flags)} {flag} {value}   (exit "
              f"{text.returncode})\n{text.stdout + text.stderr}")
        raw = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=120,
                             env=env)
        rows.append((value, text.returncode, json.loads(raw.stdout)))
    return rows


def main() -> int:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        write_sparse_checkpoint(model_dir, shards=30)
        rows = plan_each(model_dir, "llama-3-70b", FLAGS, "--tensor-parallel-size", (1, 2, 4, 8))
    whole = rows[0][2]["classes"]["weights"]
    print("| GPUs | fits | weights/GPU | KV/GPU | required/GPU | limit/GPU |")
    print("|---|---|---|---|---|---|")
    for tp, code, p in rows:
        c = p["classes"]
        print(f"| {tp} | {'yes' if p['fits'] else 'no'} (exit {code}) | "
              f"{c['weights'] / GiB:.1f} GiB | {c['kv_cache'] / GiB:.1f} GiB | "
              f"{p['required_bytes'] / GiB:.1f} GiB | {p['limit_bytes'] / GiB:.1f} GiB |")
        if not whole <= c["weights"] * tp <= whole * 1.01:
            print(f"FAIL: {tp} x {c['weights']} weight bytes per GPU against {whole} on one")
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
