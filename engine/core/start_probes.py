"""What the start's prediction times on the device before anything is loaded
(``planner/ready_time.py`` predicts from them): a copy from host memory to the device in
the model's dtype (placing each loaded tensor; allocating the KV pool), on the CPU a
oneDNN reorder of the model's own MLP shape (packing the linear layers), a matmul of
the model's own shape (the profiled steps' arithmetic), a decode step's product of one
row (streaming weights) and decode steps of the model's own kinds of layer, shrunk (what
a step costs beside its weights: per layer and per step). Each takes a few tens of
milliseconds."""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch

from kvledger.engine.checkpoint.files import checkpoint_files
from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.core.profile_steps import CPU_CHECK_TOKENS
from kvledger.engine.core.runner import PROMPT_LOGPROBS_ROWS, TORCH_DTYPES, ModelRunner
from kvledger.engine.model.cpu_linear import (
    PACK_FOR_ROWS,
    PackedLinear,
    measured_bytes,
    packable,
)
from kvledger.engine.model.loader import model_class
from kvledger.engine.planner.device import host_available_bytes
from kvledger.engine.planner.dtypes import checkpoint_dtype
from kvledger.engine.planner.plan import Plan
from kvledger.engine.planner.read_speed import ReadSpeed
from kvledger.engine.planner.ready_time import StepCost, TimeToReady, predict, profile_flops
from kvledger.engine.settings.config import EngineConfig

# The shrunk layers of ``step_cost``: one KV head with its query heads at the model's
# head size, an MLP (or each expert's) this wide, this many tokens of vocabulary.
SHRUNK_WIDTH = 64
SHRUNK_VOCAB = 256
# The streaming probe's weight: a model's weights up to this, more than the device's
# last-level cache (a CPU's tens of MiB; an H100's or H200's L2, 50 MiB): a model that fits
# in the cache streams from it in its steps, and is timed so.
STREAM_SAMPLE_BYTES = {"cpu": 64 << 20, "cuda": 512 << 20}

# The packing probe's weights, in all: more than a CPU's last-level cache.
PACK_SAMPLE_BYTES = 96 << 20

# Tokens of the timed matmul: a prefill's, not a decode's; a GPU needs more rows than the
# CPU to run at the rate a long prefill gets (timed here on the CPU only).
MATMUL_ROWS = {"cpu": 256, "cuda": 2048}


def predict_start(config: EngineConfig, plan: Plan, model_config: ModelConfig,
                  model_dir: Path, device: torch.device, *, paged: bool) -> TimeToReady:
    """The start's phases predicted before anything is loaded: a timed read of the
    weights' files as they will be read, then this module's probes on ``device`` (those
    of a step, in one process only: ranks time their own)."""
    ready = predict(checkpoint_files(model_dir), config.weight_reading, host_available_bytes(),
                    faults=torch.get_num_threads() if device.type == "cpu" else 1)
    ready.weight_bytes = plan.classes["weights"]
    ready.kv_bytes = plan.classes["kv_cache"]
    ready.num_layers = model_config.num_layers
    dtype = TORCH_DTYPES[plan.model_dtype]
    hidden, intermediate = model_config.hidden_size, model_config.intermediate_size
    ready.place_speed = place_speed(device, dtype)
    ready.copies_weights = (device.type != "cpu"  # onto the device, into another dtype,
                            or checkpoint_dtype(plan.shape, plan.weights) != plan.model_dtype
                            or (config.quantization == "fp8"  # or quantized as they load
                                and not model_config.weight_format))
    ready.pack_speed = pack_speed(device, dtype, hidden, intermediate,  # the CPU's
                                  ready.weight_bytes)
    if config.tensor_parallel_size == config.pipeline_parallel_size == 1:
        ready.matmul_flops_per_s = matmul_speed(device, dtype, hidden, intermediate)
        ready.profile_flops = _profile_flops(model_config, plan, device)
        ready.stream_speed = stream_speed(device, dtype, hidden,
                                          min(_stream_sample(device), ready.weight_bytes))
        if ready.pack_speed is not None:  # the timing that decides whether packing pays
            ready.pack_timing_bytes = measured_bytes(ready.weight_bytes)
        ready.step_cost = step_cost(model_config, device, dtype, plan.kv.block_size,
                                    plan.max_model_len, fuse=not config.enable_lora,
                                    paged=paged)
    return ready


def _profile_flops(model_config: ModelConfig, plan: Plan, device: torch.device) -> float:
    """The arithmetic of ``ModelRunner.profile``'s steps: the prefill and the mixed step
    at the plan's budget, or on the CPU the one short prompt that checks the model runs."""
    if device.type == "cpu":
        return profile_flops(model_config, CPU_CHECK_TOKENS, CPU_CHECK_TOKENS + 1,
                             mixed_step=False, max_num_seqs=1, logit_rows=CPU_CHECK_TOKENS)
    return profile_flops(model_config, plan.max_num_batched_tokens, plan.max_model_len,
                         mixed_step=True, max_num_seqs=plan.max_num_seqs,
                         logit_rows=PROMPT_LOGPROBS_ROWS)


def place_speed(device: torch.device, dtype: torch.dtype,
                sample_bytes: int = 64 << 20) -> ReadSpeed:
    """A timed copy of ``sample_bytes`` from host memory to ``device`` in ``dtype`` (a
    loaded tensor's placing): what the start's prediction counts per pass."""
    source = torch.empty(sample_bytes // dtype.itemsize, dtype=dtype)
    source.fill_(1)  # touched: the pages exist before the timing
    started = time.perf_counter()
    placed = source.to(device, copy=True)
    _sync(device)
    elapsed = time.perf_counter() - started
    del placed
    if device.type == "cuda":  # not left in the allocator's cache for the weights to meet
        torch.cuda.empty_cache()
    return ReadSpeed(sample_bytes, elapsed)


@torch.inference_mode()
def pack_speed(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int,
               model_bytes: int) -> ReadSpeed | None:
    """On the CPU, timed oneDNN reorders of the model's own MLP (``cpu_linear.PackedLinear``'s
    packing): its gate's and up's ``[intermediate, hidden]`` weights and its down's
    ``[hidden, intermediate]`` in turn (a reorder's speed depends on the shape: here the
    down's ran 2-3 times the gate's; a model's projections in and out of the hidden width
    hold its bytes about two to one, as an MLP's do) in ``dtype``, as the packing pass
    meets a model's: distinct weights, as many bytes as the model's up to
    ``PACK_SAMPLE_BYTES`` (more than a last-level cache: one weight reordered again comes
    from the cache), each packed copy kept to the end (written to new pages: a copy freed
    at once lends its pages to the next) and each dense weight let go once packed; after
    one untimed reorder of each shape, which sets its primitive up. None where nothing is
    packed (another device, a dtype this CPU's oneDNN cannot pack)."""
    if device.type != "cpu" or not packable(dtype):
        return None
    shapes = [(intermediate, hidden)] * 2 + [(hidden, intermediate)]  # gate, up, down
    for shape in dict.fromkeys(shapes):
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(shape, dtype=dtype), PACK_FOR_ROWS)
    weight_bytes = intermediate * hidden * dtype.itemsize
    count = max(len(shapes), -(-min(PACK_SAMPLE_BYTES, model_bytes) // weight_bytes))
    weights = [torch.ones(shapes[i % len(shapes)], dtype=dtype) for i in range(count)]
    packed = []
    started = time.perf_counter()
    while weights:
        packed.append(torch.ops.mkldnn._reorder_linear_weight(weights.pop(), PACK_FOR_ROWS))
    elapsed = time.perf_counter() - started
    del packed
    return ReadSpeed(weight_bytes * count, elapsed)


@torch.inference_mode()
def matmul_speed(device: torch.device, dtype: torch.dtype, hidden: int,
                 intermediate: int, min_seconds: float = 0.03, max_repeats: int = 20) -> float:
    """Floating-point operations a second of a ``[MATMUL_ROWS, hidden] x [hidden,
    intermediate]`` product in ``dtype`` on ``device`` (an MLP's projection): the fastest
    of at least three runs, repeated for ``min_seconds`` (a small model's product is
    microseconds, where one run times the thread pool waking, not the arithmetic), after
    one untimed run (the library's first call sets itself up)."""
    count = MATMUL_ROWS.get(device.type, MATMUL_ROWS["cpu"])
    rows = torch.ones(count, hidden, dtype=dtype, device=device)
    weight = torch.ones(intermediate, hidden, dtype=dtype, device=device)
    torch.nn.functional.linear(rows, weight)
    _sync(device)
    fastest, spent, runs = float("inf"), 0.0, 0
    while runs < 3 or (spent < min_seconds and runs < max_repeats):
        started = time.perf_counter()
        torch.nn.functional.linear(rows, weight)
        _sync(device)
        elapsed = time.perf_counter() - started
        fastest, spent, runs = min(fastest, elapsed), spent + elapsed, runs + 1
    del rows, weight
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * count * hidden * intermediate / max(fastest, 1e-9)


@torch.inference_mode()
def stream_speed(device: torch.device, dtype: torch.dtype, hidden: int,
                 sample_bytes: int | None = None, min_seconds: float = 0.02) -> ReadSpeed:
    """A decode step's product: one row times a ``sample_bytes`` weight of the model's
    ``hidden`` width (a model's weights, up to more than the device's last-level cache:
    what a step streams; None: the device's ``STREAM_SAMPLE_BYTES``), packed where the
    CPU packs the linear layers (one row reads a packed weight faster: 19 against 14 GB/s
    here); the median of at least five, repeated for ``min_seconds``, after one untimed: a
    step as it runs, not at its best."""
    sample_bytes = _stream_sample(device) if sample_bytes is None else sample_bytes
    weight = torch.ones(max(1, sample_bytes // (hidden * dtype.itemsize)), hidden,
                        dtype=dtype, device=device)
    row = torch.ones(1, hidden, dtype=dtype, device=device)
    layer = (PackedLinear(weight, None) if device.type == "cpu" and packable(dtype)
             else torch.nn.Linear(hidden, weight.shape[0], bias=False, device="meta"))
    if not isinstance(layer, PackedLinear):
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    read = weight.numel() * weight.element_size()
    del weight
    layer(row)
    _sync(device)
    seconds: list[float] = []
    while len(seconds) < 5 or (sum(seconds) < min_seconds and len(seconds) < 50):
        started = time.perf_counter()
        layer(row)
        _sync(device)
        seconds.append(time.perf_counter() - started)
    del layer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ReadSpeed(read, statistics.median(seconds))


@torch.inference_mode()
def step_cost(config: ModelConfig, device: torch.device, dtype: torch.dtype,
              block_size: int, max_model_len: int, *, fuse: bool, paged: bool,
              repeats: int = 5) -> StepCost:
    """What a decode step costs beside streaming its weights, per layer and per step: a
    one-sequence decode step (the runner's path: its metadata, rotary lookup, layers and
    LM head) of the model's own kinds of layer shrunk (``shrunk``), with one layer and
    with three, each run first once, then in turn ``repeats`` times (a machine that slows
    down meanwhile slows both), each the median; a layer's cost is half the difference,
    the step's the rest. On the CPU a new shape's is the one-layer model's first run
    beyond its median (oneDNN sets up its primitives for a shape on its first call). On a
    GPU the first call of a shape compiles the paged kernels, once a process (the probe
    runs at the model's ``max_model_len``, so the engine's own kernels are the ones
    compiled here), and the profile meets them before the warm-up: none counted."""
    context = max_model_len if device.type == "cuda" else 2 * block_size
    runners = {}
    for layers in (1, 3):
        with torch.device(device):
            small = shrunk(config, layers)
            model = model_class(small)(small).to(dtype).eval().requires_grad_(False)
        runners[layers] = ModelRunner(model, device, context, block_size, fuse=fuse,
                                      paged=paged)
        runners[layers].allocate_kv_cache(2, "auto")
    timed: dict[int, list[float]] = {1: [], 3: []}
    for _ in range(repeats + 1):
        for layers, runner in runners.items():
            timed[layers].append(_decode_step_seconds(runner, device))
    del runners
    if device.type == "cuda":  # nothing of the probe left in the allocator's cache
        torch.cuda.empty_cache()
    one, three = (statistics.median(timed[n][1:]) for n in (1, 3))
    first = max(0.0, timed[1][0] - one) if device.type == "cpu" else 0.0
    per_layer = max(0.0, (three - one) / 2)
    return StepCost(per_layer, max(0.0, one - per_layer), first)


def _decode_step_seconds(runner: ModelRunner, device: torch.device) -> float:
    """One sequence's decode step through ``runner``, as ``ModelRunner.execute`` runs one
    (its metadata, the model's hidden states, the logits), its token back on the host."""
    started = time.perf_counter()
    meta = runner.attention.metadata([], [([0], 2)], torch.tensor([1], device=device))
    hidden = runner._hidden([0], [1], meta, runner.kv_cache)
    runner._logits(hidden, [0]).argmax(-1).tolist()
    return time.perf_counter() - started


def shrunk(config: ModelConfig, layers: int) -> ModelConfig:
    """``config``'s kinds of layer (norms, biases, q/k norms, sliding window, routed
    experts) at a tiny size: ``layers`` of them, one KV head with as many query heads as
    share it at the model's head size, MLPs ``SHRUNK_WIDTH`` wide, a vocabulary of
    ``SHRUNK_VOCAB``; unquantized, as a step's cost beside its weights is the layers'
    kernels and their dispatch."""
    group = max(1, config.num_attention_heads // max(1, config.num_kv_heads))
    moe = config.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe, intermediate_size=SHRUNK_WIDTH,
            sparse_layers=tuple(range(layers)) if moe.sparse_layers else ())
    return dataclasses.replace(
        config, num_layers=layers, num_attention_heads=group, num_kv_heads=1,
        hidden_size=group * config.head_dim, intermediate_size=SHRUNK_WIDTH,
        vocab_size=SHRUNK_VOCAB, tie_word_embeddings=False, layout=None, quantization="",
        weight_format="", moe=moe)


def _stream_sample(device: torch.device) -> int:
    return STREAM_SAMPLE_BYTES.get(device.type, STREAM_SAMPLE_BYTES["cpu"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
