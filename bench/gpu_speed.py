"""The engine's speed on an NVIDIA GPU, judged against the card's own limits, in one run.

On the device itself it measures the achievable HBM bandwidth (a large device-to-device
copy) and the bf16 matmul peak (a large ``torch.matmul``); then, on random bf16 weights of
Llama-3-8B's shape (no checkpoint needed), the model runner's decode step at batch 1, 8, 64
and 256, contexts 1k and 8k, on both attention paths (``TORCH_SDPA``: each sequence's
blocks gathered for SDPA; ``TRITON_ATTN``: the paged kernel reads them in place), each as a
fraction of the bandwidth limit (weights + the KV bytes a step reads, over the measured
bandwidth), the paged path eagerly and replayed as a CUDA graph (``TRITON_ATTN+graphs``,
its capture time too); a prefill of 8 x 2,048 tokens as a fraction of the matmul peak; a
2,048-token later chunk over 6,144 cached tokens (a long prompt's last chunk, or a prompt
after a prefix-cache hit) on both paths as a fraction of the matmul peak (``TORCH_SDPA``
gathers the sequence for SDPA under a causal mask; ``TRITON_ATTN`` reads it in place
through the query-tiled kernel, model/prefill_attention.py); and the planned vs profiled
activation peak of each path (the gathered copy is planned on TORCH_SDPA only). Beside
each decode step (and each graph's capture), what the start's prediction says of it
(``predicted_step_s``, ``predicted_capture_s``: planner/ready_time.py's ``StepCost`` from
the start's probes on this device, core/start_probes.py), so a GPU run checks the warm-up's
and the capture's predictions too.

Every sequence has blocks of its own (shared blocks would be read from L2, not HBM); a
shape whose KV pool (or gathered copy) does not fit the free memory is skipped, and says so.

    .venv/bin/python bench/gpu_speed.py [--out bench/results/gpu_speed.json]
    .venv/bin/python bench/gpu_speed.py --smoke   # a tiny shape on the CPU (CI's test)

Claims on a GPU (exit 1 when one fails): batch-1 decode at 1k context >= 75% of the
bandwidth limit, batch-64 decode at 8k >= 60%, prefill >= 50% of the matmul peak, each on
the faster path; the later chunk read in place at least as fast as gathered (it exists to
drop the gathered copy, not to trade it for time). ``--smoke`` checks nothing but that
every figure is produced.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
TINY = dict(LLAMA3_8B, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=256)
CLAIMS = {"decode b1 c1024": 0.75, "decode b64 c8192": 0.60, "prefill": 0.50}
CHUNK_CLAIM = 1.0  # the paged path's later chunk against the gathered path's, in speed
BLOCK_SIZE = 16


def timed(fn, repeat: int, device: torch.device) -> float:
    """Seconds per call of ``fn`` (after one warm-up call), the device synchronised."""
    fn()
    sync(device)
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - started) / repeat


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def card_limits(device: torch.device, smoke: bool) -> dict:
    """Bytes/s of a device-to-device copy (read + write) and bf16 FLOP/s of a matmul."""
    n = 2**20 if smoke else 2**31  # bytes copied: 2 GiB on a GPU
    buffers = torch.empty((2, n), dtype=torch.uint8, device=device)
    copy_s = timed(lambda: buffers[1].copy_(buffers[0]), 3 if smoke else 20, device)
    m = 256 if smoke else 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    mm_s = timed(lambda: torch.matmul(a, b), 3 if smoke else 50, device)
    return {"bandwidth_bytes_per_s": 2 * n / copy_s, "matmul_flops_per_s": 2 * m**3 / mm_s}


def build_runner(config: dict, device: torch.device, paged: bool, max_model_len: int):
    from kvledger.engine.checkpoint.model_config import ModelConfig
    from kvledger.engine.core.runner import ModelRunner
    from kvledger.engine.model.transformer import CausalLM

    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = CausalLM(ModelConfig.from_dict(config))
    finally:
        torch.set_default_dtype(before)
    return ModelRunner(model.eval(), device, max_model_len, BLOCK_SIZE, paged=paged)


def start_probes(config: dict, device: torch.device, max_model_len: int, *, paged: bool):
    """The start's probes of a decode step (core/start_probes.py) for this shape: what a
    step costs beside its bytes, and the speed they stream at."""
    from kvledger.engine.checkpoint.model_config import ModelConfig
    from kvledger.engine.core.start_probes import step_cost, stream_speed

    shape = ModelConfig.from_dict(config)
    cost = step_cost(shape, device, torch.bfloat16, BLOCK_SIZE, max_model_len, fuse=True,
                     paged=paged)
    return cost, stream_speed(device, torch.bfloat16, shape.hidden_size).bytes_per_s


def weight_bytes(runner) -> int:
    return sum(p.numel() * p.element_size() for p in runner.model.parameters())


def kv_bytes_per_token(config: dict) -> int:
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 2


def free_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 2**34


def decode(runner, config: dict, batch: int, context: int, device: torch.device,
           repeat: int, graphs: bool) -> dict:
    """One decode step of ``batch`` sequences at ``context`` tokens, each on its own blocks:
    seconds, and the bytes it reads (weights once, each sequence's K and V). ``graphs``:
    the step replayed as a CUDA graph of exactly this batch (core/decode_graphs.py; on the
    CPU its static buffers, eagerly)."""
    per_seq = -(-context // BLOCK_SIZE)
    kv_bytes = batch * per_seq * BLOCK_SIZE * kv_bytes_per_token(config)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    gathered = 0 if runner.paged else (batch * per_seq * BLOCK_SIZE
                                       * config["num_key_value_heads"] * head_dim * 2 * 2)
    if kv_bytes + gathered > 0.85 * free_bytes(device):
        return {"skipped": f"needs {(kv_bytes + gathered) / 2**30:.1f} GiB of KV"
                           f"{' and gathered copy' if gathered else ''}"}
    runner.allocate_kv_cache(batch * per_seq + (1 if graphs else 0), "auto")
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    ids = torch.randint(0, config["vocab_size"], (batch,)).tolist()
    position = context - 1
    slots = [t[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE for t in tables]
    rows = list(range(batch))

    def step():
        if graphs:
            hidden = runner.decode_graphs.run(ids, [position] * batch, slots, tables,
                                              [context] * batch)
            return runner._logits(hidden, rows)
        meta = runner.attention.metadata(
            [], [(t, context) for t in tables],
            torch.tensor(slots, dtype=torch.long, device=device))
        hidden = runner._hidden(ids, [position] * batch, meta, runner.kv_cache)
        return runner._logits(hidden, rows)

    started = time.perf_counter()
    if graphs:
        runner.use_decode_graphs([batch], capture=device.type == "cuda")
    capture_s = time.perf_counter() - started
    with torch.inference_mode():
        seconds = timed(step, repeat, device)
    runner.kv_cache = runner.decode_graphs = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    read = weight_bytes(runner) + kv_bytes
    row = {"step_s": seconds, "tokens_per_s": batch / seconds, "bytes_read": read,
           "weight_bytes": weight_bytes(runner)}
    return dict(row, capture_s=capture_s) if graphs else row


def prefill(runner, config: dict, prompts: int, length: int, device: torch.device,
            repeat: int) -> dict:
    """``prompts`` whole prompts of ``length`` tokens in one step: seconds and FLOPs (every
    linear layer per token, causal attention, the LM head on each prompt's last token)."""
    from kvledger.engine.model.attention import AttentionMetadata, PrefillSpan

    tokens = prompts * length
    ids = torch.randint(0, config["vocab_size"], (tokens,)).tolist()
    positions = [p for _ in range(prompts) for p in range(length)]
    meta = AttentionMetadata(None, [PrefillSpan(0, length, None) for _ in range(prompts)], [])
    last = [(i + 1) * length - 1 for i in range(prompts)]
    with torch.inference_mode():
        seconds = timed(lambda: runner._logits(runner._hidden(ids, positions, meta, None), last),
                        repeat, device)
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    linear = layers * (h * (h + 2 * kv) + h * h + 3 * h * i)
    attention = layers * 2 * 2 * h * length * length // 2 * prompts  # QK^T and PV, causal
    flops = 2 * linear * tokens + attention + 2 * h * config["vocab_size"] * prompts
    return {"step_s": seconds, "tokens_per_s": tokens / seconds, "flops": flops}


def chunk_prefill(runner, config: dict, chunk: int, cached: int, device: torch.device,
                  repeat: int) -> dict:
    """One later chunk of ``chunk`` tokens after ``cached`` tokens already in the pool (its
    own blocks, in order), on the runner's attention path: seconds and FLOPs (every linear
    layer per token, QK^T and PV over the positions each query sees, the LM head on its
    last token)."""
    per_seq = -(-(cached + chunk) // BLOCK_SIZE)
    runner.allocate_kv_cache(per_seq, "auto")
    table = list(range(per_seq))
    ids = torch.randint(0, config["vocab_size"], (chunk,)).tolist()
    positions = list(range(cached, cached + chunk))
    slots = torch.tensor(positions, dtype=torch.long, device=device)  # blocks in order
    meta = runner.attention.metadata([(table, cached, chunk)], [], slots)
    with torch.inference_mode():
        seconds = timed(lambda: runner._logits(
            runner._hidden(ids, positions, meta, runner.kv_cache), [chunk - 1]), repeat, device)
    runner.kv_cache = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    linear = layers * (h * (h + 2 * kv) + h * h + 3 * h * i)
    seen = chunk * cached + chunk * (chunk + 1) // 2  # (query, position) pairs
    flops = 2 * linear * chunk + layers * 2 * 2 * h * seen + 2 * h * config["vocab_size"]
    return {"step_s": seconds, "tokens_per_s": chunk / seconds, "flops": flops}


def activation_plan(config: dict, backend: str, runner, device: torch.device, batched: int,
                    max_model_len: int, seqs: int) -> dict:
    """The planner's activation estimate for this run (a what-if card of the device's
    size), beside the profile pass's measured peak (None on the CPU)."""
    from kvledger.engine.checkpoint.contents import WeightsInfo, model_shape
    from kvledger.engine.planner.plan import make_plan
    from kvledger.engine.settings.config import EngineConfig

    total = weight_bytes(runner)
    plan = make_plan(EngineConfig(model="random", device_memory_bytes=free_bytes(device),
                                  max_model_len=max_model_len, max_num_seqs=seqs,
                                  max_num_batched_tokens=batched, attention_backend=backend,
                                  enforce_eager=True),
                     shape=model_shape(config),
                     weights=WeightsInfo(total, 0, "BF16", (), {"BF16": total}))
    with torch.inference_mode():
        measured = runner.profile(batched, max_model_len, seqs)
    return {"planned_bytes": plan.classes["activations"], "measured_peak_bytes": measured}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    device = torch.device("cpu" if args.smoke else "cuda")
    config = TINY if args.smoke else LLAMA3_8B
    batches, contexts = ([1, 2], [40]) if args.smoke else ([1, 8, 64, 256], [1024, 8192])
    prompts, length = (2, 32) if args.smoke else (8, 2048)
    chunk, cached = (16, 24) if args.smoke else (2048, 6144)  # ends at max(contexts)
    repeat = 1 if args.smoke else 10
    from kvledger.engine.model import paged_attention

    # (path, attention backend, decode graphs)
    paths = [("TORCH_SDPA", "TORCH_SDPA", False)]
    if paged_attention.available(device):
        paths += [("TRITON_ATTN", "TRITON_ATTN", False), ("TRITON_ATTN+graphs", "TRITON_ATTN", True)]
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "shape": "tiny" if args.smoke else "Llama-3-8B",
              "limits": card_limits(device, args.smoke), "decode": {}, "prefill": {},
              "chunk_prefill": {}, "activations": {}}
    bandwidth = result["limits"]["bandwidth_bytes_per_s"]
    peak = result["limits"]["matmul_flops_per_s"]
    max_model_len = max(contexts)
    cost, stream = start_probes(config, device, max_model_len,
                                paged=paged_attention.available(device))
    result["start_probes"] = {"stream_bytes_per_s": stream, "per_layer_s": cost.per_layer,
                              "per_step_s": cost.per_step}
    for path, backend, graphs in paths:
        runner = build_runner(config, device, backend == "TRITON_ATTN", max_model_len)
        for batch in batches:
            for context in contexts:
                row = decode(runner, config, batch, context, device, repeat, graphs)
                if "step_s" in row:
                    row["of_bandwidth"] = row["bytes_read"] / row["step_s"] / bandwidth
                    # What the start's prediction (planner/ready_time.py) says of it.
                    layers, streamed = config["num_hidden_layers"], row["bytes_read"] / stream
                    row["predicted_step_s"] = cost.step(streamed, layers, replayed=graphs)
                    if graphs:
                        row["predicted_capture_s"] = cost.capture(
                            row["weight_bytes"] / stream, layers, 1)
                result["decode"][f"{path} b{batch} c{context}"] = row
                print(f"decode {path} batch {batch} context {context}: {row}", flush=True)
        if graphs:  # prefill and activations are the eager path's
            del runner
            continue
        row = prefill(runner, config, prompts, length, device, repeat)
        row["of_matmul_peak"] = row["flops"] / row["step_s"] / peak
        result["prefill"][backend] = row
        print(f"prefill {backend}: {row}", flush=True)
        row = chunk_prefill(runner, config, chunk, cached, device, repeat)
        row["of_matmul_peak"] = row["flops"] / row["step_s"] / peak
        result["chunk_prefill"][backend] = row
        print(f"chunk of {chunk} after {cached} cached, {backend}: {row}", flush=True)
        result["activations"][backend] = activation_plan(
            config, backend, runner, device, prompts * length, max_model_len, max(batches))
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    failed = [] if args.smoke else judge(result, [p for p, _, _ in paths])
    result["failed"] = failed
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for line in failed:
        print(f"gpu_speed: FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


def judge(result: dict, backends: list[str]) -> list[str]:
    """Each claim on the faster path; a shape skipped on every path fails its claim."""
    failed = []
    for name, target in CLAIMS.items():
        if name == "prefill":
            got = max(result["prefill"][b]["of_matmul_peak"] for b in backends
                      if b in result["prefill"])
        else:
            got = max((result["decode"][f"{b} {name.removeprefix('decode ')}"]
                       .get("of_bandwidth", 0.0) for b in backends), default=0.0)
        result.setdefault("claims", {})[name] = {"got": got, "target": target}
        if got < target:
            failed.append(f"{name}: {got:.2f} of the card's limit, target {target:.2f}")
    chunks = result["chunk_prefill"]
    if "TRITON_ATTN" in chunks:
        got = chunks["TORCH_SDPA"]["step_s"] / chunks["TRITON_ATTN"]["step_s"]
        result["claims"]["chunk prefill, in place vs gathered"] = {"got": got,
                                                                  "target": CHUNK_CLAIM}
        if got < CHUNK_CLAIM:
            failed.append(f"chunk prefill: in place {got:.2f}x the gathered path's speed, "
                          f"target {CHUNK_CLAIM:.2f}x")
    return failed


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
