"""Output tokens/s of kvledger's engine at concurrency 1, 8 and 32 against Hugging Face
transformers ``generate()`` one request at a time and as a padded static batch, on the
same model, prompts and output lengths, all measured in this run.

    .venv/bin/python bench/throughput.py [--model small-llama] [--requests 64]

The model is a built-in checkpoint (``kvledger make-model``) with random weights; greedy
decoding with EOS ignored, so every request produces exactly its ``max_tokens``.
Output lengths are mixed (16..256): the static batch pads every request in a batch to
the longest one, continuous batching lets short requests leave and new ones join.
Every setup is warmed up on the same model before it is timed (a few tokens through the
same call), so none pays first-call costs inside its measurement.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

# New tokens per request in each warm-up call: enough to run prefill and decode steps.
WARMUP_NEW_TOKENS = 8


def workload(num_requests: int, vocab_size: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(6, vocab_size) for _ in range(rng.randint(16, 128))]
               for _ in range(num_requests)]
    output_lens = [rng.choice([16, 32, 64, 128, 256]) for _ in range(num_requests)]
    return prompts, output_lens


class Clock:
    """Wall time and this process's CPU time. Other processes on a shared machine slow the
    wall clock of whichever setup they overlap; CPU time (with one torch thread, so no
    spinning peers) is what the work itself cost, and its ratios are stable run to run."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu

    def rates(self, tokens: int) -> tuple[float, float]:
        """(tokens per wall second, tokens per CPU second)"""
        return tokens / self.wall, tokens / self.cpu


def bench_engine(model_dir: str, prompts, output_lens, concurrency: int) -> tuple[float, float]:
    from kvledger.engine import LLM, SamplingParams

    llm = LLM(model_dir, max_model_len=512, max_num_seqs=concurrency, device="cpu")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    # Warm-up: a full batch of `concurrency` sequences through prefill and decode.
    llm.generate(prompts[:concurrency], SamplingParams(temperature=0, max_tokens=WARMUP_NEW_TOKENS,
                                                       ignore_eos=True))
    with Clock() as clock:
        outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == output_lens
    return clock.rates(sum(output_lens))


def _hf_model(model_dir: str):
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: exactly max_new_tokens each
    model.generation_config.pad_token_id = 0
    return model


def _hf_generate_one(model, prompt: list[int], n: int) -> None:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False)
    assert out.shape[1] == len(prompt) + n


def _hf_generate_batch(model, batch: list[list[int]], n: int) -> None:
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)


def bench_hf_one_at_a_time(model, prompts, output_lens) -> tuple[float, float]:
    with torch.inference_mode():
        _hf_generate_one(model, prompts[0], WARMUP_NEW_TOKENS)  # warm-up
    with Clock() as clock, torch.inference_mode():
        for prompt, n in zip(prompts, output_lens, strict=True):
            _hf_generate_one(model, prompt, n)
    return clock.rates(sum(output_lens))


def bench_hf_static_batch(model, prompts, output_lens, batch_size: int) -> tuple[float, float]:
    """Left-padded batches of ``batch_size`` in arrival order, each run to its longest output;
    only the tokens each request asked for count."""
    with torch.inference_mode():
        _hf_generate_batch(model, prompts[:batch_size], WARMUP_NEW_TOKENS)  # warm-up
    with Clock() as clock, torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch, lens = prompts[i:i + batch_size], output_lens[i:i + batch_size]
            _hf_generate_batch(model, batch, max(lens))
    return clock.rates(sum(output_lens))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="small-llama", help="built-in model name")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--static-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: CPU-time rates stay comparable)")
    args = parser.parse_args()
    import json

    from kvledger.engine.model.builtin import write_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_model(args.model, tmp))
        with open(f"{model_dir}/config.json") as f:
            vocab = json.load(f)["vocab_size"]
        prompts, output_lens = workload(args.requests, vocab)
        print(f"model {args.model}, {args.requests} requests, prompts 16-128 tokens, outputs "
              f"{sorted(set(output_lens))} ({sum(output_lens)} tokens), {args.threads} torch "
              f"thread(s), load average {os.getloadavg()[0]:.1f}", flush=True)
        header = f"{'setup':<34}{'wall tok/s':>11}{'CPU tok/s':>11}   ratios by CPU time (wall)"
        print(header, flush=True)
        hf = _hf_model(model_dir)
        one = bench_hf_one_at_a_time(hf, prompts, output_lens)
        print(f"{'transformers one at a time':<34}{one[0]:>11.1f}{one[1]:>11.1f}", flush=True)
        static = bench_hf_static_batch(hf, prompts, output_lens, args.static_batch)
        print(f"{f'transformers static batch of {args.static_batch}':<34}{static[0]:>11.1f}"
              f"{static[1]:>11.1f}   {static[1] / one[1]:.2f}x ({static[0] / one[0]:.2f}x) "
              "one-at-a-time", flush=True)
        del hf
        for concurrency in (1, 8, 32):
            rate = bench_engine(model_dir, prompts, output_lens, concurrency)
            print(f"{f'kvledger concurrency {concurrency}':<34}{rate[0]:>11.1f}{rate[1]:>11.1f}   "
                  f"{rate[1] / one[1]:.2f}x ({rate[0] / one[0]:.2f}x) one-at-a-time, "
                  f"{rate[1] / static[1]:.2f}x ({rate[0] / static[0]:.2f}x) static batch",
                  flush=True)
        print(f"load average at the end {os.getloadavg()[0]:.1f} (other processes share the CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
