"""Routed experts as config.json declares them: which layers hold experts, how many, how
wide, and how tokens are routed to them. Part of a model's shape (``ModelShape.moe``): the
planner sizes a routed layer's activations from it, the engine builds its layers from it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvledger.engine.checkpoint.config_numbers import positive
from kvledger.engine.checkpoint.hf_config import HFConfig
from kvledger.engine.checkpoint.read_limits import MAX_TENSORS
from kvledger.engine.errors import BadInput, shown


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts, as Mixtral and Qwen3-MoE route: a softmax over all ``num_experts``
    router logits, the top ``num_experts_per_tok`` kept (renormalised to sum to 1 when
    ``normalize_topk``), each token's output the weighted sum of its experts' MLPs."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # each expert's
    normalize_topk: bool
    sparse_layers: tuple[int, ...]  # the layers with experts; the others have a dense MLP

    def sharded(self, ranks: int) -> MoEConfig:
        """One rank's share under tensor parallelism: each expert's width split (vLLM's
        FusedMoE under TP), every expert on every rank."""
        return dataclasses.replace(self, intermediate_size=self.intermediate_size // ranks)


def read_moe(read: HFConfig) -> MoEConfig | None:
    """The experts of a config read as ``read.architecture``; None for a dense model (and
    for the architectures whose experts the engine does not run, planned as dense).
    Mixtral and Granite-MoE: experts in every layer, top-k always renormalised. Qwen3-MoE: experts in the
    layers ``(i + 1) % decoder_sparse_step == 0`` not in ``mlp_only_layers``. Fields left
    out take transformers' defaults (MixtralConfig's, Qwen3MoeConfig's)."""
    raw, arch, layers = read.raw, read.architecture, read.num_layers
    if arch in ("MixtralForCausalLM", "GraniteMoeForCausalLM"):
        # Granite-MoE: a softmax over the top-k logits, the same weights as Mixtral's.
        num_experts, top_k = positive(raw, "num_local_experts", 8), 2
        sparse, expert_size, normalize = tuple(range(layers)), read.intermediate_size, True
    elif arch == "Qwen3MoeForCausalLM":
        # transformers 5 writes Qwen3MoeConfig's num_experts as num_local_experts.
        key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
        if raw.get(key) == 0:
            return None  # every layer dense
        num_experts, top_k = positive(raw, key, 128), 8
        step = positive(raw, "decoder_sparse_step", 1)
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise BadInput(f"config.json 'mlp_only_layers' must be a list of layer indices, got {shown(dense)}")
        dense = set(dense)
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        expert_size = positive(raw, "moe_intermediate_size", 768)
        normalize = bool(raw.get("norm_topk_prob", False))
        if not sparse:
            return None
    else:
        return None
    if len(sparse) * num_experts * 3 > MAX_TENSORS:  # each expert's three projections
        raise BadInput(f"config.json declares {num_experts} experts in each of {len(sparse)} "
                       f"layers: more tensors than the {MAX_TENSORS:,} kvledger reads of one model")
    top_k = positive(raw, "num_experts_per_tok", top_k)
    if top_k > num_experts:
        raise BadInput(f"config.json 'num_experts_per_tok' {top_k} is more than the {num_experts} experts")
    return MoEConfig(num_experts, top_k, expert_size, normalize, sparse)


def refuse_unknown_routing(raw: Mapping[str, Any]) -> None:
    """Experts routed any other way than a softmax over all of them then top-k (and
    shared experts) would load and run wrong: refuse them by name."""
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if raw.get(key):
            raise BadInput(f"unsupported: a shared expert ({key} {shown(raw[key])}); kvledger runs "
                           "routed experts only")
    router = {"scoring_func": (None, "softmax"), "topk_method": (None, "greedy"),
              "n_group": (None, 0, 1), "topk_group": (None, 0, 1),
              "routed_scaling_factor": (None, 1, 1.0)}
    for key, allowed in router.items():
        if raw.get(key) not in allowed:
            raise BadInput(f"unsupported MoE router: {key} {shown(raw[key])} (kvledger routes by a "
                           "softmax over all experts, then top-k)")
