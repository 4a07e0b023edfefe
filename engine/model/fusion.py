"""Fused projections: each attention's q, k and v as one linear layer, each MLP's gate and
up as one, as vLLM fuses them (``QKVParallelLinear``, ``MergedColumnParallelLinear``).

A decode step multiplies a handful of rows by every weight matrix: its cost is reading the
weights plus a fixed cost per product, so the same weights in fewer, larger products cost
less (docs/benchmarks.md, "Fused projections"). One product computes each output from the
same row and weights, so the result is the separate products' to float rounding
(``tests/engine/model/test_fusion.py``).

Fused after loading (the checkpoint's names load as they are) and after tensor-parallel
sharding (each rank fuses its own shards), before the CPU packs the weights. Only plain
``nn.Linear`` layers of one dtype and device fuse (fp8 and int4 layers keep their
kernels). Not with ``--enable-lora``: an adapter adds its delta to each projection
(``lora.py``), so those engines keep them apart. The fused weight replaces the parts, so
the weights are counted, and held, once.
"""

from __future__ import annotations

import torch
from torch import nn

from kvledger.engine.model.transformer import MLP, Attention

FUSED = {Attention: ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         MLP: ("gate_up_proj", ("gate_proj", "up_proj"))}


def fuse_projections(model: nn.Module) -> int:
    """Fuse every attention's q/k/v and every MLP's gate/up (dense MLPs and Qwen3-MoE
    experts) of ``model`` in place; returns how many fused layers it made."""
    fused = 0
    for module in model.modules():
        # By class or base class: Gemma's attention and MLP (gemma.py) fuse as theirs.
        spec = next((FUSED[c] for c in type(module).__mro__ if c in FUSED), None)
        if spec is not None and _fuse(module, *spec):
            fused += 1
    return fused


def _fuse(module: nn.Module, fused_name: str, names: tuple[str, ...]) -> bool:
    parts = [getattr(module, name) for name in names]
    if not all(type(p) is nn.Linear for p in parts):
        return False
    first = parts[0]
    if any(p.weight.dtype != first.weight.dtype or p.weight.device != first.weight.device
           or p.in_features != first.in_features for p in parts):
        return False
    with_bias = [p.bias is not None for p in parts]
    if any(with_bias) and not all(with_bias):
        return False
    sizes = [p.out_features for p in parts]
    layer = nn.Linear(first.in_features, sum(sizes), bias=all(with_bias), device="meta")
    layer.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
    if layer.bias is not None:
        layer.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    for name in names:
        delattr(module, name)  # the parts go: the fused weight is the only copy
    setattr(module, fused_name, layer)
    module.fused_sizes = sizes
    return True
