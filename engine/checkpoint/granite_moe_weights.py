"""IBM Granite 3.x mixture-of-experts (``GraniteMoeForCausalLM``): its checkpoints store a
layer's experts as two 3D tensors and its router under its own name, which the loader
splits and renames into the engine's Mixtral-shaped ``block_sparse_moe`` (one module per
expert, ``gate_proj``/``up_proj``/``down_proj``, the router ``gate``), as transformers'
own conversion reads them (``block_sparse_moe.input_linear.weight`` is its experts'
``gate_up_proj``):

- ``block_sparse_moe.input_linear.weight`` ``[experts, 2 * intermediate, hidden]``: each
  expert's gate rows, then its up rows;
- ``block_sparse_moe.output_linear.weight`` ``[experts, hidden, intermediate]``: each
  expert's down;
- ``block_sparse_moe.router.layer.weight`` ``[experts, hidden]``: the router.

Torch-free: the pre-flight checks the stored shapes against ``stored_shape``.
"""

from __future__ import annotations

from kvledger.engine.checkpoint.model_config import ModelConfig

GRANITE_MOE = "GraniteMoeForCausalLM"
_AT = ".block_sparse_moe."
_EXPERTS = {"input_linear.weight": ("gate_proj", "up_proj"),
            "output_linear.weight": ("down_proj",)}
_ROUTER = "router.layer.weight"


def granite_moe_names(name: str, shape: tuple[int, ...],
                      config: ModelConfig) -> tuple[str, ...] | None:
    """The engine's tensors a stored Granite-MoE tensor fills, in the order the loader
    splits it (each expert's gate then up; each expert's down); None when ``name`` is none
    of those, or its experts are not config.json's count (the loader could not split it)."""
    if config.architecture != GRANITE_MOE or _AT not in name or config.moe is None:
        return None
    layer, _, what = name.rpartition(_AT)
    if what == _ROUTER:
        return (f"{layer}{_AT}gate.weight",)
    parts = _EXPERTS.get(what)
    if parts is None or len(shape) != 3 or shape[0] != config.moe.num_experts:
        return None
    return tuple(f"{layer}{_AT}experts.{e}.{p}.weight" for e in range(shape[0]) for p in parts)


def stored_shape(name: str, config: ModelConfig) -> tuple[int, int, int] | None:
    """The shape config.json gives a stored expert tensor (None: not one)."""
    if config.architecture != GRANITE_MOE or config.moe is None:
        return None
    experts, inter, hidden = (config.moe.num_experts, config.moe.intermediate_size,
                              config.hidden_size)
    if name.endswith(_AT + "input_linear.weight"):
        return (experts, 2 * inter, hidden)
    if name.endswith(_AT + "output_linear.weight"):
        return (experts, hidden, inter)
    return None
