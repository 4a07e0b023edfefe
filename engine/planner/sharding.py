"""What one GPU holds when a model is sharded over ``--tensor-parallel-size N`` GPUs, as
vLLM shards it (Megatron-style tensor parallelism):

- column-parallel linear layers (q/k/v, gate/up, MLA's q_b/kv_b): each rank holds 1/N of
  the outputs; row-parallel ones (o, down): 1/N of the inputs, their bias replicated;
- K and V: the KV heads are split across ranks, and once N exceeds their count each is
  replicated, so a rank holds ``max(1, kv_heads / N)`` heads of weights and of KV cache;
  MLA's latent cache is not split (every rank keeps all of it);
- the embedding and the LM head split by vocabulary, padded to a multiple of
  ``VOCAB_PADDING`` first (vLLM's ``pad_vocab_size``);
- MoE experts: every expert's weights split (1/N of each), the router replicated;
- norms, routers and anything not named above replicated (never under-counted).

Refused by name (BadInput, exit 2): an N that does not divide the attention heads, the KV
heads (or that they do not divide), or an MLP width (the experts' too); ``check_shardable``
is the one owner, which the engine's sharding asks as well.
"""

from __future__ import annotations

import dataclasses

from kvledger.engine.checkpoint.contents import ModelShape
from kvledger.engine.checkpoint.layout import MLA, AttentionLayout
from kvledger.engine.errors import BadInput

VOCAB_PADDING = 64  # vLLM: vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE

# Tensor-name parts, as the checkpoints the planner reads name them.
_KV = ("k_proj", "v_proj")
_COLUMN = ("q_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "q_b_proj",
           "kv_b_proj", "w1", "w3", "c_fc")
_ROW = ("o_proj", "down_proj", "w2", "c_proj", "dense")
_VOCAB = ("embed_tokens", "lm_head", "wte", "word_embeddings")


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one rank holds: split across ranks, replicated once N exceeds them."""
    return max(1, num_kv_heads // tp)


def check_shardable(shape: ModelShape, tp: int, expert_width: int | None = None) -> None:
    """BadInput naming why ``shape`` cannot be split over ``tp`` GPUs as vLLM splits it
    (``expert_width``: each routed expert's MLP width, which splits too). The planner
    and the engine's sharding both ask it."""
    if tp == 1:
        return
    flag = f"--tensor-parallel-size {tp}"
    heads, kv = shape.num_attention_heads, shape.num_kv_heads
    if heads % tp:
        raise BadInput(f"{flag}: {shape.architecture} has {heads} attention heads, which "
                       f"{tp} GPUs cannot share equally (use a size that divides {heads})")
    if not _mla(shape) and (kv % tp if kv >= tp else tp % kv):
        raise BadInput(f"{flag}: {shape.architecture} has {kv} KV heads; the size must divide "
                       f"them, or be a multiple of them (each head then on {tp} // {kv} GPUs)")
    for width in (shape.intermediate_size, expert_width):
        if width is not None and width % tp:
            raise BadInput(f"{flag}: {shape.architecture}'s MLP width {width} does not "
                           f"divide into {tp} equal shards")


def rank_shape(shape: ModelShape, tp: int) -> ModelShape:
    """The shape one rank computes with: its heads, its KV heads, its share of the MLP
    and of each expert's (the vocabulary stays whole: the logits are gathered in full on rank 0)."""
    if tp == 1:
        return shape
    kv = kv_heads_per_rank(shape.num_kv_heads, tp)
    return dataclasses.replace(
        shape, num_attention_heads=shape.num_attention_heads // tp,
        num_kv_heads=shape.num_kv_heads if _mla(shape) else kv,
        intermediate_size=shape.intermediate_size // tp,
        moe=shape.moe and shape.moe.sharded(tp),
        layout=None if shape.layout is None else _rank_layout(shape.layout, tp))


def _rank_layout(layout: AttentionLayout, tp: int) -> AttentionLayout:
    layers = tuple(la if la.attention == MLA else dataclasses.replace(
        la, num_kv_heads=kv_heads_per_rank(la.num_kv_heads, tp)) for la in layout.layers)
    return dataclasses.replace(layout, layers=layers)


def _mla(shape: ModelShape) -> bool:
    return shape.layout is not None and any(la.attention == MLA for la in shape.layout.layers)


def rank_share(name: str, dims: tuple[int, ...] | list[int], shape: ModelShape,
               tp: int) -> tuple[int, int]:
    """``(numerator, denominator)``: the fraction of tensor ``name`` (of ``dims``) one rank
    holds. A tensor with one element, or one not split, is held whole."""
    if tp == 1 or not dims or _count(dims) <= 1:
        return 1, 1
    parts = name.split(".")
    if ".experts." in f".{name}" or _expert_pack(parts):
        if "down_proj_bias" in name or name.endswith(("down_proj.bias", "w2.bias")):
            return 1, 1  # a row-parallel bias is added once, whole, on every rank
        return 1, tp  # each expert's intermediate split (vLLM's FusedMoE under TP)
    layer = parts[-2] if len(parts) >= 2 else ""
    if layer in _VOCAB:
        vocab = dims[0]
        padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
        return -(-padded // tp), vocab
    if layer in _KV and not _mla(shape):
        kv = shape.num_kv_heads
        return kv_heads_per_rank(kv, tp), kv
    if layer in _COLUMN:
        return 1, tp
    if layer in _ROW:
        return (1, 1) if parts[-1] == "bias" or len(dims) == 1 else (1, tp)
    return 1, 1


def _expert_pack(parts: list[str]) -> bool:
    """gpt-oss stores its experts packed: ``mlp.experts.gate_up_proj_blocks`` and the like."""
    return len(parts) >= 2 and parts[-2] == "experts"


def _count(dims) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def shard_bytes(nbytes: int, share: tuple[int, int]) -> int:
    """``nbytes`` times the share, rounded up."""
    num, den = share
    return -(-nbytes * num // den)
