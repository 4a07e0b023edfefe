"""Time to ready: how long a start takes, predicted before loading and measured after.

A start is phases (``PHASES``): ``read`` the weights (loading: reading the checkpoint and
placing its tensors), ``profile`` (the profiled steps that measure activations), ``kv``
(allocating the KV pool), ``graphs`` (capturing decode steps as CUDA graphs) and
``warmup`` (one tiny request through the whole path, the server's). Before anything is
loaded the read is predicted from the checkpoint's bytes and the bandwidth a short timed
read of the same files gets now (``read_speed.measure_read``: on the model's own volume, through
whatever page cache it has; several files at once where the loader reads them ahead,
``--safetensors-load-strategy``); the profile from the arithmetic of its steps
(``profile_flops``, from config.json's shape) over a timed matmul of the model's own
shape on the device (the engine times it, torch being its room); the KV pool's
allocation from its bytes over the timed copy; the warm-up's steps and the graphs'
captures from a decode step's cost (``StepCost``: the weights streamed at a timed
one-row product's speed, and what a step costs beside them, timed on the model's own
kinds of layer shrunk). The engine logs predicted against measured at start-up,
``/v1/budget`` shows both, and ``bench/cold_start.py`` compares them, cold cache and
warm.

Torch-free: the planner's room.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.checkpoint.read_ahead import (
    AS_VLLM_DEFAULTS,
    WeightReading,
    verdict,
)
from kvledger.engine.planner.estimates import format_size
from kvledger.engine.planner.read_speed import SAMPLE_BYTES, ReadSpeed, measure_read

PHASES = ("read", "profile", "kv", "graphs", "warmup")
WARMUP_STEPS = 4  # the warm-up's request: its prompt's step, then decode steps to 4 tokens


@dataclass(frozen=True)
class StepCost:
    """What a decode step costs beside streaming its weights: ``per_layer`` seconds for
    each layer (its kernels and their dispatch), ``per_step`` once (its metadata, the
    LM head's dispatch, the token back on the host), and ``new_shape`` more the first time
    a step of a new shape runs (its kernels set up)."""

    per_layer: float
    per_step: float
    new_shape: float = 0.0

    def step(self, stream_s: float, layers: int, *, replayed: bool = False) -> float:
        """A decode step of ``layers`` layers whose bytes stream in ``stream_s``: each
        layer's cost too unless it is replayed as a CUDA graph, and the step's."""
        return stream_s + (0.0 if replayed else layers * self.per_layer) + self.per_step

    def capture(self, stream_s: float, layers: int, sizes: int) -> float:
        """Capturing ``sizes`` decode sizes as CUDA graphs: two forwards a size (one run,
        one captured), each the weights streamed and the layers' cost, LM head aside."""
        return 2 * sizes * (stream_s + layers * self.per_layer)


@dataclass
class TimeToReady:
    """A start's phases, predicted (None: not predicted) and measured, in seconds.

    The read is predicted as the files' bytes over the timed read, plus placing the loaded
    weights (``weight_bytes``, in the model's dtype) over a timed copy on the device
    (``place_speed``: each tensor in the model's dtype on its device; the engine measures
    it, torch being its room) where loading copies them (``copies_weights``: onto another
    device, or into another dtype; on the CPU in the checkpoint's own dtype the loaded
    tensors are views of the files' memory maps, and the first pass over them, fusing or
    packing, is their read), plus on the CPU packing them for oneDNN over a timed
    reorder of the model's own shape (``pack_speed``: a reorder is slower than a copy),
    and the timing that decides whether packing pays, its sample's bytes streamed
    (``pack_timing_bytes``) at the decode step's speed (``stream_speed``).
    Where the files are read ahead, the read
    ahead and the loader's memory map go side by side: the slower of the two counts, the
    map's speed over pages already read (``mapped_speed``).

    A decode step is predicted as the weights streamed at a timed one-row product's speed
    (``stream_speed``) plus ``num_layers`` layers' and one step's ``step_cost``; with
    ``graph_sizes`` captured, a replayed step as the weights streamed plus the step's
    cost alone. The warm-up is ``WARMUP_STEPS`` steps, its prompt's eager, its decodes
    replayed where graphs are captured, with each new shape's set-up (``StepCost.new_shape``:
    the prompt's and the decodes', the prompt's alone where they replay); the capture two
    forwards a size (one run, one captured), each the eager step but its LM head."""

    weight_file_bytes: int
    read_speed: ReadSpeed | None
    measured: dict[str, float] = field(default_factory=dict)
    weight_bytes: int = 0
    place_speed: ReadSpeed | None = None
    copies_weights: bool = True  # loading copies the weights (see above)
    pack_speed: ReadSpeed | None = None  # the CPU's oneDNN packing (None: no packing)
    pack_timing_bytes: int = 0  # what deciding whether packing pays streams (cpu_linear)
    profile_flops: float = 0.0  # the profiled steps' arithmetic (``profile_flops``)
    matmul_flops_per_s: float | None = None  # a timed matmul of the model's shape
    kv_bytes: int = 0  # the KV pool the plan allocates
    mapped_speed: ReadSpeed | None = None  # read ahead: the map over pages it has read
    stream_speed: ReadSpeed | None = None  # a decode step's one-row product
    step_cost: StepCost | None = None  # a decode step's cost beside its weights
    num_layers: int = 0
    graph_sizes: int = 0  # decode sizes captured as CUDA graphs (0: none)

    @property
    def predicted(self) -> dict[str, float | None]:
        read = None
        if self.read_speed is not None:
            speed = self.read_speed.bytes_per_s
            if self.mapped_speed is not None:
                speed = min(speed, self.mapped_speed.bytes_per_s)
            # The timed read's own bytes are in the page cache by the time the loader
            # reads them: copied out of it, not read again.
            sampled = min(self.read_speed.bytes, self.weight_file_bytes)
            copy = speed if self.place_speed is None else self.place_speed.bytes_per_s
            read = (self.weight_file_bytes - sampled) / speed + sampled / copy
            place = self.place_speed if self.copies_weights else None
            for pass_speed in (place, self.pack_speed):
                if pass_speed is not None:
                    read += self.weight_bytes / pass_speed.bytes_per_s
            if self.pack_speed is not None and self.stream_speed is not None:
                read += self.pack_timing_bytes / self.stream_speed.bytes_per_s
        speed, place = self.matmul_flops_per_s, self.place_speed
        profile = (self.profile_flops / speed if speed and self.profile_flops else None)
        kv = (self.kv_bytes / place.bytes_per_s if place is not None and self.kv_bytes
              else None)
        graphs = warmup = None
        cost, stream = self.step_cost, self.stream_speed
        if cost is not None and stream is not None and self.weight_bytes:
            weights, sizes = self.weight_bytes / stream.bytes_per_s, self.graph_sizes
            decode = cost.step(weights, self.num_layers, replayed=sizes > 0)
            warmup = (cost.step(weights, self.num_layers) + (WARMUP_STEPS - 1) * decode
                      + (1 if sizes else 2) * cost.new_shape)
            if sizes:
                graphs = cost.capture(weights, self.num_layers, sizes)
        return {"read": read, "profile": profile, "kv": kv, "graphs": graphs,
                "warmup": warmup}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` block as phase ``name``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.measured[name] = time.perf_counter() - started

    def to_json(self) -> dict:
        speed = self.read_speed
        place = self.place_speed
        return {"weight_file_bytes": self.weight_file_bytes, "weight_bytes": self.weight_bytes,
                "read_bytes_per_s": None if speed is None else round(speed.bytes_per_s),
                "read_sample_bytes": None if speed is None else speed.bytes,
                "place_bytes_per_s": None if place is None else round(place.bytes_per_s),
                "pack_bytes_per_s": None if self.pack_speed is None
                else round(self.pack_speed.bytes_per_s),
                "copies_weights": self.copies_weights,
                "pack_timing_bytes": self.pack_timing_bytes,
                "mapped_bytes_per_s": None if self.mapped_speed is None
                else round(self.mapped_speed.bytes_per_s),
                "stream_bytes_per_s": None if self.stream_speed is None
                else round(self.stream_speed.bytes_per_s),
                "step_cost_s": None if self.step_cost is None
                else {"per_layer": round(self.step_cost.per_layer, 6),
                      "per_step": round(self.step_cost.per_step, 6),
                      "new_shape": round(self.step_cost.new_shape, 6)},
                "profile_flops": round(self.profile_flops),
                "matmul_flops_per_s": None if self.matmul_flops_per_s is None
                else round(self.matmul_flops_per_s),
                "predicted_s": {k: _round(v) for k, v in self.predicted.items()},
                "measured_s": {k: _round(v) for k, v in self.measured.items()},
                "measured_total_s": _round(sum(self.measured.values()))}

    def plan_json(self) -> dict:
        """What the plan says of the start before it: the read predicted, and from what."""
        speed = self.read_speed
        return {"weight_file_bytes": self.weight_file_bytes,
                "read_bytes_per_s": None if speed is None else round(speed.bytes_per_s),
                "predicted_s": {"read": _round(self.predicted["read"])}}

    def plan_text(self) -> str | None:
        """The report's line (None: nothing to predict from)."""
        speed = self.read_speed
        read = self.predicted["read"]
        if speed is None or read is None:
            return None
        return (f"  time to ready: reading the weights ~{read:.1f}s "
                f"({format_size(self.weight_file_bytes)} at "
                f"{format_size(round(speed.bytes_per_s))}/s, timed now on their volume)")

    def describe(self) -> str:
        """One log line: each phase predicted vs measured."""
        parts = []
        for phase in PHASES:
            if phase not in self.measured:
                continue
            want = self.predicted[phase]
            got = self.measured[phase]
            parts.append(f"{phase} {got:.2f}s" + ("" if want is None else
                                                  f" (predicted {want:.2f}s)"))
        speed = self.read_speed
        rate = "" if speed is None else (
            f"; {format_size(self.weight_file_bytes)} of weights at "
            f"{format_size(round(speed.bytes_per_s))}/s measured before loading")
        return "time to ready: " + ", ".join(parts) + rate


def predict(files: list[Path], reading: WeightReading = AS_VLLM_DEFAULTS,
            available_bytes: int | None = None, faults: int = 1) -> TimeToReady:
    """The prediction for loading ``files`` as ``reading`` says: their bytes over a timed
    read of them now, several at once where they will be read ahead (``verdict``, with
    ``available_bytes`` of host memory), through a memory map in ``faults`` threads at
    once where the loader's first pass over the weights faults them so (on the CPU,
    torch's threads)."""
    existing = [f for f in files if os.path.isfile(f)]
    ahead = verdict(reading, existing, available_bytes).prefetch
    ready = TimeToReady(sum(os.path.getsize(f) for f in existing),
                        measure_read(existing, threads=reading.threads if ahead else 1,
                                     faults=faults))
    if ahead and ready.read_speed is not None:  # the largest file's share, now read: mapped
        share = SAMPLE_BYTES // max(1, min(reading.threads, len(existing)))
        ready.mapped_speed = measure_read(existing, sample_bytes=share, faults=faults)
    return ready


def profile_flops(config: ModelConfig, num_tokens: int, max_model_len: int, *,
                  mixed_step: bool, max_num_seqs: int, logit_rows: int) -> float:
    """The arithmetic of the engine's profiled steps (``ModelRunner.profile``), in
    floating-point operations: a prefill of ``num_tokens`` tokens as whole prompts of
    ``max_model_len - 1`` tokens, its logits and ``logit_rows`` rows of prompt logprobs;
    with ``mixed_step`` (off the CPU) also ``max_num_seqs - 1`` decodes at the full
    context beside the rest of the budget as a prompt's last chunk. Two operations a
    multiply-add: the linear layers (a routed MLP's chosen experts only), attention's
    scores and sums (causal), the vocabulary's projection."""
    hidden, layers = config.hidden_size, config.num_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    moe = config.moe
    sparse = len(moe.sparse_layers) if moe is not None else 0
    mlp = ((layers - sparse) * 3 * hidden * config.intermediate_size
           + (0 if moe is None else sparse * (moe.num_experts_per_tok * 3 * hidden
                                              * moe.intermediate_size
                                              + hidden * moe.num_experts)))
    per_token = 2 * (layers * (hidden * (q + 2 * kv) + q * hidden) + mlp)
    longest = max(1, max_model_len - 1)
    lengths = [longest] * (num_tokens // longest) + (
        [num_tokens % longest] if num_tokens % longest else [])
    scores = 2 * q * layers  # a query meeting a key: its score, then its share of the sum
    flops = (per_token * num_tokens + scores * sum(n * (n + 1) for n in lengths)
             + 2 * hidden * config.vocab_size * (len(lengths) + logit_rows))
    if mixed_step:
        decodes = max(0, min(max_num_seqs, num_tokens) - 1)
        chunk = num_tokens - decodes
        flops += (per_token * num_tokens + 2 * scores * (decodes + chunk) * longest
                  + 2 * hidden * config.vocab_size * (decodes + 1))
    return float(flops)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
