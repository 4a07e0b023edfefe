"""A real out-of-memory on CUDA while requests run: the step's requests fail, the rest
complete, the engine lives.

small-llama in bfloat16, a pool of 512 blocks, ``--max-num-seqs 4`` and 8 greedy
requests of 300-650 tokens: 4 run, 4 wait. Before the first step (``--steps-before``) another allocation takes
every free byte of the device (the engine's allocator cache is emptied first, so its next
step must ask the device for memory); the prefill's forward pass raises
``torch.OutOfMemoryError``. Then the allocation is given back
and the engine is stepped until idle. Checked, exit 1 if not:

- the 4 running requests finish with ``finish_reason "error"`` naming OutOfMemoryError;
- the 4 waiting ones complete, with the same tokens as the same 4 prompts in a clean run;
- the KV pool is back to 0 reserved and 0 used, and the engine still serves a request.

    python bench/gpu_oom_check.py          # CUDA only; one-line exit 2 without it
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

MiB = 2**20
# Long prompts: their prefill needs megabytes of activations, which a device with no free
# memory cannot give (a decode's few small tensors might fit in the allocator's slack).
PROMPTS = [[5 + i, 17, 40 + 3 * i, 9, 33] * (60 + 10 * i) for i in range(8)]


def take_free_memory(torch, device) -> list:
    """Tensors holding (nearly) every free byte of ``device``: chunks halved down to 2 MiB."""
    hog, chunk = [], 1024 * MiB
    while chunk >= 2 * MiB:
        try:
            hog.append(torch.empty(chunk, dtype=torch.uint8, device=device))
        except torch.OutOfMemoryError:
            chunk //= 2
    return hog


def drain(engine) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps-before", type=int, default=0,
                        help="engine steps before the device's memory is taken")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("error: gpu_oom_check needs a CUDA device (torch sees none)", file=sys.stderr)
        return 2
    from kvledger.engine.core.engine import LLMEngine
    from kvledger.engine.model.builtin import write_model
    from kvledger.engine.sampling.params import SamplingParams
    from kvledger.engine.settings.config import EngineConfig

    model_dir = write_model("small-llama", tempfile.mkdtemp(prefix="kvledger-oom-"))
    # No prefix cache: the reference run would leave prompts 4-7 cached, and computing
    # only their tails later could move a bf16 logit enough to flip a greedy token.
    config = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16",
                          max_model_len=1024, max_num_seqs=4, num_gpu_blocks_override=512,
                          enable_prefix_caching=False)
    engine = LLMEngine.from_config(config)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    device = engine.runner.device

    for i in range(4, 8):  # the reference: the later four alone, as they will run
        engine.add_request(f"ref{i}", PROMPTS[i], params)
    reference = {rid[3:]: out.token_ids for rid, out in drain(engine).items()}

    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    for _ in range(args.steps_before):
        engine.step()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    hog = take_free_memory(torch, device)
    free_after_hog = torch.cuda.mem_get_info(device)[0]
    held = sum(t.numel() for t in hog)
    print(f"after {args.steps_before} steps: another allocation holds {held / MiB:.0f} MiB; "
          f"{free_after_hog / MiB:.1f} MiB of the device left free")
    failed, steps = [], 0
    started = time.perf_counter()
    while not failed and steps < 8 and engine.has_unfinished_requests():
        failed = [o for o in engine.step() if o.finish_reason == "error"]
        steps += 1
    print(f"{steps} step(s) with the memory taken ({time.perf_counter() - started:.3f} s); "
          f"failed {len(failed)} requests: {sorted(o.request_id for o in failed)}")
    for out in failed[:1]:
        print(f"  error: {out.error[:200]}")
    del hog
    torch.cuda.empty_cache()
    rest = drain(engine)

    problems = []
    if not failed:
        problems.append("no step ran out of memory: the allocator still had room")
    if sorted(o.request_id for o in failed) != ["0", "1", "2", "3"]:
        problems.append("the out-of-memory step did not fail exactly the 4 running requests")
    if not all("OutOfMemoryError" in (o.error or "") for o in failed):
        problems.append("a failed request does not name OutOfMemoryError")
    for rid in ("4", "5", "6", "7"):
        out = rest.get(rid)
        if out is None or out.finish_reason != "length":
            problems.append(f"request {rid} did not complete ({out and out.finish_reason})")
        elif out.token_ids != reference[rid]:
            problems.append(f"request {rid}'s tokens differ from the clean run")
    ledger = engine.ledger
    if (ledger.reserved_blocks, ledger.used_blocks) != (0, 0):
        problems.append(f"pool not back to 0: {ledger.reserved_blocks} reserved, "
                        f"{ledger.used_blocks} used")
    engine.add_request("after", PROMPTS[0], params)
    after = drain(engine).get("after")
    if after is None or after.finish_reason != "length":
        problems.append("the engine did not serve a request after the out-of-memory")
    print(f"waiting requests completed: {sum(o.finish_reason == 'length' for o in rest.values())}"
          f"/4, tokens as in the clean run: "
          f"{all(rest.get(r) and rest[r].token_ids == reference[r] for r in reference)}; "
          f"failed steps in a row now {engine.consecutive_failed_steps}; pool reserved "
          f"{ledger.reserved_blocks}, used {ledger.used_blocks}")
    for problem in problems:
        print(f"FAIL: {problem}")
    print("gpu_oom_check passed" if not problems else "gpu_oom_check FAILED")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
