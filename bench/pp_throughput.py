"""Decode throughput at --pipeline-parallel-size 2 against 1 on the CPU, and each rank's
memory (issue 44).

``bench/tp_throughput.py``'s workload (small-llama fp32, 8 layers, 8 sequences x 64 greedy
tokens), one engine after the other in this process: pp=1, then pp=2 (two processes,
stage 1 here, stage 2 spawned; hidden states and logits over gloo). Prints tokens/s and
the ratio, each process's resident memory (VmRSS; rank 0 is this process, which held the
pp=1 engine before), the weights rank 0 holds (measured) against the whole model's, and
the plan's weights of each stage: each rank holds only its stage's layers. Then a prefill-heavy workload (16 prompts
of 480 tokens), whose steps run in micro-batches that overlap the stages. On 2 cores pp=2
is expected to be slower; the figures are reported, not tuned. Last, pp=2 as two machines
(``--nnodes 2``: stage 2 a ``kvledger serve --node-rank 1 --headless`` process, rank 0's
calls over the authenticated control channel on 127.0.0.1 instead of a pipe). Exits 1
unless every decode run's tokens are equal.

    .venv/bin/python bench/pp_throughput.py
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tp_throughput import PARAMS, PROMPTS, run, same_tokens

from kvledger.engine.llm import LLM
from kvledger.engine.model.builtin import write_model
from kvledger.engine.model.loader import weights_bytes
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.settings.node_config import NODE_KEY_ENV, Nodes, free_port_pair

MiB = 2**20


def rss(pid: int) -> int:
    """Resident bytes of process ``pid`` (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


LONG_PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(480)] for i in range(16)]
LONG_PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def prefill_rate(model_dir: Path, stages: int) -> float:
    """Prompt tokens/s of 16 prompts of 480 tokens (2048-token steps: several parts each)."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=512,
              max_num_seqs=16, max_num_batched_tokens=2048, pipeline_parallel_size=stages)
    try:
        llm.generate(LONG_PROMPTS[:2], LONG_PARAMS)  # warm up
        started = time.perf_counter()
        llm.generate(LONG_PROMPTS, LONG_PARAMS)
        return sum(map(len, LONG_PROMPTS)) / (time.perf_counter() - started)
    finally:
        ranks = getattr(llm.engine.runner, "ranks", None)
        if ranks is not None:
            ranks.stop()


def two_machines(model_dir: Path) -> tuple[float, list[list[int]]]:
    """``run`` at pp=2 with stage 2 on "another machine": its own ``kvledger serve
    --node-rank 1 --headless`` process, joined over 127.0.0.1."""
    master = free_port_pair()
    key = secrets.token_hex(16)
    other = subprocess.Popen(
        [sys.executable, "-m", "kvledger.engine.cli", "serve", str(model_dir), "--device",
         "cpu", "--dtype", "float32", "--max-model-len", "256", "-pp", "2", "--nnodes", "2",
         "--node-rank", "1", "--headless", "--master-port", str(master)],
        env={**os.environ, NODE_KEY_ENV: key}, stderr=subprocess.DEVNULL)
    try:
        nodes = Nodes(2, 0, "127.0.0.1", master, key.encode())
        return run(model_dir, pipeline_parallel_size=2, nodes=nodes)
    finally:
        other.wait(timeout=30)


def main() -> int:
    memory: dict[str, int] = {}
    stages: list = []

    held: dict[str, int] = {}

    def one_process(llm) -> None:
        memory["pp=1"] = rss(os.getpid())
        held["pp=1"] = weights_bytes(llm.engine.runner.model)

    def two_stages(llm) -> None:
        memory["pp=2 rank 0 (stage 1)"] = rss(os.getpid())
        held["pp=2 rank 0 (stage 1)"] = weights_bytes(llm.engine.runner.model)
        for process in llm.engine.runner.ranks.processes:
            memory["pp=2 rank 1 (stage 2)"] = rss(process.pid)
        stages.extend(llm.engine.plan.stages)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model("small-llama", Path(tmp) / "small-llama")
        one, tokens_one = run(model_dir, during=one_process)
        long_one = prefill_rate(model_dir, 1)
        two, tokens_two = run(model_dir, during=two_stages, pipeline_parallel_size=2)
        long_two = prefill_rate(model_dir, 2)
        apart, tokens_apart = two_machines(model_dir)
    print(f"small-llama fp32, {len(PROMPTS)} sequences x {PARAMS.max_tokens} tokens, CPU: "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print(f"pp=1: {one:.1f} tokens/s")
    print(f"pp=2: {two:.1f} tokens/s ({two / one:.2f}x pp=1)")
    print(f"pp=2 on two machines (127.0.0.1, --nnodes 2): {apart:.1f} tokens/s "
          f"({apart / two:.2f}x pp=2 in one)")
    print(f"prefill, {len(LONG_PROMPTS)} prompts x {len(LONG_PROMPTS[0])} tokens: pp=1 "
          f"{long_one:.0f}, pp=2 {long_two:.0f} prompt tokens/s ({long_two / long_one:.2f}x; "
          "each step in micro-batches, the stages overlapping)")
    for what, nbytes in memory.items():
        weights = f", weights held {held[what] / MiB:.1f} MiB (measured)" if what in held else ""
        print(f"{what}: resident {nbytes / MiB:.0f} MiB{weights}")
    for f in stages:
        print(f"stage {f.stage + 1}: layers {f.first_layer}-{f.end_layer - 1}, weights "
              f"{f.classes['weights'] / MiB:.1f} MiB (plan)")
    return max(same_tokens("pp=2", tokens_two, "pp=1", tokens_one),
               same_tokens("pp=2 on two machines", tokens_apart, "pp=1", tokens_one))


if __name__ == "__main__":
    sys.exit(main())
