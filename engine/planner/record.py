"""What a plan says: the bytes of each class, the limit, the KV pool and, when it does not
fit, the remedies found; the records ``make_plan`` (``plan.py``) builds and the report,
the remedies and the engine read. No computation lives here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvledger.engine.checkpoint.contents import ModelShape, ModelSource, WeightsInfo
from kvledger.engine.errors import EXIT_DOES_NOT_FIT, EXIT_OK
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.limit import cap_above_free
from kvledger.engine.planner.pool import ENGINE_RULE, PoolGroup
from kvledger.engine.planner.ready_time import TimeToReady
from kvledger.engine.settings.config import EngineConfig


@dataclass(frozen=True)
class Remedy:
    flag: str
    value: int | float | str | None  # None for a flag that takes no value (--enforce-eager)
    kv_bytes: int  # the KV cache class after the change
    note: str = ""
    also: tuple[tuple[str, int | float], ...] = ()  # other flag changes this remedy needs

    def to_json(self) -> dict:
        return {"flag": self.flag, "value": self.value, "kv_bytes": self.kv_bytes,
                "note": self.note, "also": {flag: value for flag, value in self.also}}


CLASSES = ("weights", "activations", "kv_cache", "cuda_graphs", "context", "lora")


@dataclass(frozen=True)
class Measured:
    """Figures the engine measured; each one given replaces the planner's estimate."""

    weights_bytes: int | None = None
    activation_peak_bytes: int | None = None
    context_bytes: int | None = None
    cuda_graph_bytes: int | None = None
    # The seats (max_num_seqs) the activations were profiled at: a concurrency the plan
    # derives from the pool (planner/seats.py) is never more, as the peak grows with it.
    max_num_seqs: int | None = None
    # Under --pipeline-parallel-size: each stage's own (its fullest rank's); the figures
    # above then stand for none.
    stages: tuple[Measured, ...] = ()

    def of_stage(self, stage: int) -> Measured:
        """What stage ``stage`` measured (nothing when the stages reported nothing)."""
        if not self.stages:
            return Measured(max_num_seqs=self.max_num_seqs)
        return self.stages[stage]

    def given(self) -> tuple[str, ...]:
        names = {"weights_bytes": "weights", "activation_peak_bytes": "activations",
                 "context_bytes": "context", "cuda_graph_bytes": "cuda_graphs"}
        return tuple(names[f.name] for f in dataclasses.fields(self)
                     if f.name in names and getattr(self, f.name) is not None)


@dataclass(frozen=True)
class KVInfo:
    block_size: int
    num_blocks: int
    bytes_per_block: int
    bytes_per_token: int
    dtype: str
    pool_mode: str = "workload"  # "override" | "kv-cache-memory-bytes" | "cap" | "workload"
    required_blocks: int = 0  # blocks the pool must hold for the run to fit
    blocks_per_seq: int = 0  # one max_model_len sequence, every layer group together
    layout: str = "full"  # as allocated: "full", "mla", "sliding", "sliding+full (hybrid)"
    rule: str = ENGINE_RULE  # who allocates: ENGINE_RULE or VLLM_RULE (kv_pool)
    note: str = ""  # the rule applied, in words
    layers_per_block: int = 0  # a block is one page in each of this many layers
    bytes_per_seq: int = 0  # blocks_per_seq * bytes_per_block
    groups: tuple[PoolGroup, ...] = ()  # per kind of layer: layers, window, blocks per sequence
    sequences: int = 0  # whole max_model_len sequences the pool holds


@dataclass(frozen=True)
class StageFigures:
    """One pipeline stage's figures (``stages.py``): its layers ``[first, end)`` and what one
    of its GPUs holds."""

    stage: int
    first_layer: int
    end_layer: int
    fits: bool
    required_bytes: int
    limit_bytes: int
    classes: dict[str, int]
    bytes_per_block: int

    def to_json(self) -> dict:
        return {"stage": self.stage, "layers": [self.first_layer, self.end_layer],
                "fits": self.fits, "required_bytes": self.required_bytes,
                "limit_bytes": self.limit_bytes,
                "short_by_bytes": max(0, self.required_bytes - self.limit_bytes),
                "classes": dict(self.classes), "bytes_per_block": self.bytes_per_block}


@dataclass(frozen=True)
class Plan:
    fits: bool
    limit_bytes: int
    required_bytes: int
    short_by_bytes: int
    limit_source: str  # "--memory-limit" | "--gpu-memory-utilization" | "free-memory"
    classes: dict[str, int]  # keys exactly CLASSES
    kv: KVInfo
    remedies: list[Remedy]
    unified_memory: bool
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    warnings: list[str]
    device: DeviceMemory
    model_dtype: str  # the dtype floating weights are loaded in, e.g. "bfloat16"
    config: EngineConfig
    shape: ModelShape
    weights: WeightsInfo
    margin_bytes: int = 0  # kept free when the limit is free memory
    measured: tuple[str, ...] = ()  # classes whose figure the engine measured
    source: ModelSource | None = None  # where the checkpoint was read; a hub model's commit
    tensor_parallel_size: int = 1  # every figure above is what one of these GPUs holds
    # "--max-num-seqs" (declared), "default" (16), or "kv-pool" (not declared, under a cap:
    # the whole sequences the pool holds, bounded; planner/seats.py)
    max_num_seqs_source: str = "--max-num-seqs"
    seats_note: str = ""  # why a derived max_num_seqs is fewer than the sequences the pool holds
    # --pipeline-parallel-size: the figures above are stage ``stage``'s (the first that does
    # not fit, else the one nearest its limit); ``stages`` has every stage's
    pipeline_parallel_size: int = 1
    stage: int = 0
    stages: tuple[StageFigures, ...] = ()
    # The start's read, predicted from a timed read of the checkpoint (``kvledger plan`` and
    # ``preflight``; ``predicted_start``); None for a hub model's headers.
    time_to_ready: TimeToReady | None = None

    @property
    def exit_code(self) -> int:
        """What `kvledger plan` and `preflight` exit with: 0 when it fits, 3 when not."""
        return EXIT_OK if self.fits else EXIT_DOES_NOT_FIT

    @property
    def cap_above_free(self) -> bool:
        """Refused because the cap given is more than the device's free memory."""
        return cap_above_free(self.limit_bytes, self.limit_source, self.device)

    def to_json(self) -> dict:
        """The plan JSON of docs/architecture.md (bytes as integers), plus context keys."""
        return {
            "fits": self.fits,
            "limit_bytes": self.limit_bytes,
            "required_bytes": self.required_bytes,
            "short_by_bytes": self.short_by_bytes,
            "limit_source": self.limit_source,
            "classes": dict(self.classes),
            "kv": dataclasses.asdict(self.kv),
            "remedies": [r.to_json() for r in self.remedies],
            "unified_memory": self.unified_memory,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            **({"stage": self.stage, "stages": [f.to_json() for f in self.stages]}
               if self.stages else {}),
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_seqs_source": self.max_num_seqs_source,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "model_dtype": self.model_dtype,
            "margin_bytes": self.margin_bytes,
            "measured": list(self.measured),
            "warnings": list(self.warnings),
            "device": dataclasses.asdict(self.device),
            "model": self._model_json(),
            **({"time_to_ready": self.time_to_ready.plan_json()}
               if self.time_to_ready is not None else {}),
        }

    def _model_json(self) -> dict:
        model = {"architecture": self.shape.architecture, "num_layers": self.shape.num_layers,
                 "weights_dtype": self.weights.dtype, "num_tensors": self.weights.num_tensors}
        if self.source is not None and self.source.uri is not None:
            model |= {"uri": self.source.uri, "commit": self.source.commit}
        return model
