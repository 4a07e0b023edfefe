"""Whether kvledger's engine can run a declared run, beyond whether it fits: the one owner
of each rule the planner and the engine share. ``make_plan`` applies them before it counts
a byte, and the engine's start-up plans before it loads anything, so ``plan``,
``preflight``, ``run`` and ``serve`` refuse alike, by name (BadInput, exit 2), and the
engine does not check them again.

``RULE_OWNERS`` says where each rule about what can run lives; a test holds it true (each
owner exists, and each rule's refusal is written in its owner's file alone under engine/;
the CRD's rules in operator/api/spec_rules.py refuse the same at ``kubectl apply``).
"""

from __future__ import annotations

from kvledger.engine.checkpoint.contents import ModelShape, WeightsInfo
from kvledger.engine.checkpoint.gemma_config import GEMMA_ARCHITECTURES
from kvledger.engine.checkpoint.weight_formats import run_format
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config import EngineConfig

# rule -> (file under engine/, the function or class that owns it, its refusal's words)
RULE_OWNERS = {
    "the architectures, activations, RoPE types and quantization methods the engine runs":
        ("checkpoint/model_config.py", "ModelConfig.from_dict",
         "unsupported architecture {some(archs"),
    "the quantized weight formats served, and all the planner and the loader ask of one":
        ("checkpoint/weight_formats.py", "Int4Weights.quantized_tensors",
         "4-bit layers the engine cannot load"),
    "heads, KV heads and MLP widths split over --tensor-parallel-size":
        ("planner/sharding.py", "check_shardable", "cannot share equally"),
    "quantized weights are not sharded":
        ("planner/support.py", "check_engine_run", "kvledger's engine does not shard"),
    "no LoRA adapters with --tensor-parallel-size above 1":
        ("planner/support.py", "check_engine_run", "does not serve LoRA adapters with"),
    "Gemma on one GPU, in one stage":
        ("planner/support.py", "check_engine_run", "runs Gemma on one GPU"),
    "LoRA adapters on dense models only":
        ("planner/support.py", "check_engine_run", "serves LoRA adapters on dense models"),
    "no LoRA adapters across pipeline stages":
        ("core/startup.py", "check_stages", "does not serve LoRA "),
    "--max-num-batched-tokens at least --max-num-seqs":
        ("settings/workload_config.py", "WorkloadSettings.check_workload",
         "every running sequence decodes"),
    "prompt logprobs need every prompt position computed, no cached blocks":
        ("core/request.py", "EngineRequest.uses_cached_blocks", "needs every prompt position"),
}


def is_mixture_of_experts(weights: WeightsInfo) -> bool:
    """Whether the checkpoint's tensors hold routed experts."""
    return any(".experts." in t.name for t in weights.tensors)


def expert_width(weights: WeightsInfo) -> int | None:
    """Each expert's MLP width, from the first expert's down projection (``down_proj``,
    Mixtral's ``w2``: ``[hidden, width]``); None for a dense model or packed experts."""
    for t in weights.tensors:
        if ".experts." in t.name and t.name.endswith((".down_proj.weight", ".w2.weight")) \
                and len(t.shape) == 2:
            return t.shape[1]
    return None


def check_engine_run(config: EngineConfig, shape: ModelShape, weights: WeightsInfo) -> None:
    """BadInput naming the first rule of kvledger's engine that ``config`` breaks on this
    checkpoint (``shape``: the whole model's): quantized weights (the checkpoint's or
    ``--quantization``'s) are not sharded; Gemma runs on one GPU in one stage; LoRA
    adapters run on one GPU and on dense models only."""
    tp = config.tensor_parallel_size
    quantized = shape.quantization or config.quantization
    served = run_format(shape, weights, config.quantization == "fp8")
    if tp > 1 and quantized and not (served is not None and served.can_shard):
        raise BadInput(f"--tensor-parallel-size {tp}: kvledger's engine does not shard "
                       f"{quantized} weights yet (serve them on one GPU, or unquantized)")
    pp = config.pipeline_parallel_size
    if shape.architecture in GEMMA_ARCHITECTURES and (tp > 1 or pp > 1):
        # Its layers (gemma.py) are not those the shards and stages are cut from yet.
        raise BadInput(f"--tensor-parallel-size {tp} --pipeline-parallel-size {pp}: "
                       f"kvledger's engine runs Gemma on one GPU, in one stage, for now")
    if config.enable_lora and tp > 1:
        raise BadInput(f"--enable-lora: kvledger's engine does not serve LoRA adapters "
                       f"with --tensor-parallel-size {tp} yet")
    if config.enable_lora and is_mixture_of_experts(weights):
        raise BadInput(f"--enable-lora: kvledger serves LoRA adapters on dense models; "
                       f"{shape.architecture} is a mixture of experts")
