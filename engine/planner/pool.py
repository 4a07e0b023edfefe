"""What a KV block is, and how many one sequence takes, under the allocator that serves it.

Two rules, picked by architecture:

- ``ENGINE_RULE``, for what kvledger's engine serves: one tensor ``[layers, 2, kv_heads,
  blocks, block_size, head_dim]`` (``ModelRunner.allocate_kv_cache``), every layer the
  whole context, so a declared sliding window saves nothing.
- ``VLLM_RULE``, a what-if for a vLLM launch line, for the rest: vLLM's hybrid KV cache
  manager (vllm/v1/kv_cache_interface.py, vllm/v1/core/kv_cache_utils.py). A layer's page
  is ``block_size`` tokens: ``2 * kv_heads * head_size`` elements per token
  (``FullAttentionSpec``/``SlidingWindowSpec``), ``1 * head_size`` for MLA's latent
  (``MLAAttentionSpec``). Layers of one kind form one group; when kinds differ they are cut
  into groups of ``group_size`` layers (the smallest kind's count, or the largest when
  within 1.5x, ``_get_kv_cache_groups_uniform_page_size``). A block is one page in each
  of ``group_size`` layers (``get_kv_cache_config_from_groups``); each group draws its own
  blocks from the shared pool, a full one ``ceil(max_model_len / block_size)`` per
  sequence, a sliding one ``ceil(min(window - 1 + max_num_batched_tokens, max_model_len)
  / block_size) + 1`` (``SlidingWindowSpec.max_memory_usage_bytes``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from kvledger.engine.checkpoint.layout import FULL, SLIDING, AttentionLayout, LayerKV, declared_only
from kvledger.engine.errors import BadInput


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The blocks ``num_tokens`` tokens take: THE rule, which the plan, the ledger, the
    admission line and the model runner all call."""
    return -(-num_tokens // block_size)

ENGINE_RULE = "kvledger-engine"
VLLM_RULE = "vllm-hybrid-kv-cache-manager"
ENGINE_NOTE = "kvledger's engine allocates every layer the whole context"
# vLLM pads the smaller kinds up to the largest when they are this close (kv_cache_utils.py).
VLLM_GROUP_SIZE_SLACK = 1.5


@dataclass(frozen=True)
class PoolGroup:
    """Layers of one kind that share a block table; a sequence takes ``blocks_per_seq``."""

    attention: str
    num_groups: int  # block tables of this kind (vLLM cuts a kind into groups of group_size)
    num_layers: int  # layers of this kind, in all its groups
    num_kv_heads: int
    head_size: int
    sliding_window: int | None
    bytes_per_token_per_layer: int
    blocks_per_seq: int  # in all this kind's groups together


@dataclass(frozen=True)
class KVGeometry:
    rule: str  # ENGINE_RULE | VLLM_RULE
    layout: str  # as allocated: "full", "mla", "sliding", "sliding+full (hybrid)"
    bytes_per_block: int  # one page in each of layers_per_block layers
    layers_per_block: int
    bytes_per_token: int  # one token held in every layer that keeps it
    blocks_per_seq: int  # one max_model_len sequence, all groups together
    groups: tuple[PoolGroup, ...]
    note: str  # the rule applied, in words


def kv_geometry(layout: AttentionLayout, architecture: str, rule: str, block_size: int,
                dtype_bytes: int, max_model_len: int, max_num_batched_tokens: int) -> KVGeometry:
    """The pool's block and one sequence's blocks; the layout's notes join the rule's."""
    if rule == ENGINE_RULE:
        geometry = _engine(layout, architecture, block_size, dtype_bytes, max_model_len)
    else:
        geometry = _vllm(layout, architecture, block_size, dtype_bytes, max_model_len,
                         max_num_batched_tokens)
    if layout.notes:
        geometry = replace(geometry, note="; ".join((geometry.note, *layout.notes)))
    return geometry


def _engine(layout: AttentionLayout, architecture: str, block_size: int, dtype_bytes: int,
            max_model_len: int) -> KVGeometry:
    """Every layer K and V of the whole context (a sliding window is applied in attention
    only); the engine's one tensor needs the same heads and head size on every layer."""
    shapes = {(la.num_kv_heads, la.head_size) for la in layout.layers}
    if any(la.attention not in (FULL, SLIDING) for la in layout.layers):
        raise BadInput(f"{architecture}: kvledger's engine has no {layout.name} KV cache")
    if len(shapes) != 1:
        raise BadInput(f"{architecture}: layers of different KV shapes {sorted(shapes)}: "
                       "kvledger's engine allocates one shape for every layer")
    (kv_heads, head_size), = shapes
    layer = LayerKV(FULL, kv_heads, head_size)
    per_layer = layer.bytes_per_token(dtype_bytes)
    n = len(layout.layers)
    blocks = blocks_for(max_model_len, block_size)
    note = ENGINE_NOTE
    if declared := declared_only(layout):
        note = f"{declared} saves no memory here: {note}"
    group = PoolGroup(FULL, 1, n, kv_heads, head_size, None, per_layer, blocks)
    return KVGeometry(ENGINE_RULE, FULL, per_layer * block_size * n, n, per_layer * n, blocks,
                      (group,), note)


def _vllm(layout: AttentionLayout, architecture: str, block_size: int, dtype_bytes: int,
          max_model_len: int, batched_tokens: int) -> KVGeometry:
    kinds = Counter(layout.layers)  # layers of identical spec, in first-seen order
    pages = {kind.bytes_per_token(dtype_bytes) for kind in kinds}
    if len(kinds) > 1 and len(pages) > 1:
        raise BadInput(f"{architecture}: layer kinds with different page sizes are not "
                       "modelled (vLLM would grow the smaller kinds' block size)")
    if len(kinds) == 1:
        group_size = len(layout.layers)
    else:
        smallest, largest = min(kinds.values()), max(kinds.values())
        group_size = largest if largest < smallest * VLLM_GROUP_SIZE_SLACK else smallest
    groups = []
    for kind, count in kinds.items():
        num_groups = -(-count // group_size)
        per_group = _blocks_per_seq(kind, block_size, max_model_len, batched_tokens)
        groups.append(PoolGroup(kind.attention, num_groups, count, kind.num_kv_heads,
                                kind.head_size, kind.sliding_window,
                                kind.bytes_per_token(dtype_bytes), per_group * num_groups))
    page_per_token = max(pages)
    note = f"vLLM's hybrid KV cache manager rule; kvledger's engine does not serve {architecture}"
    return KVGeometry(
        rule=VLLM_RULE, layout=layout.name,
        bytes_per_block=page_per_token * block_size * group_size, layers_per_block=group_size,
        bytes_per_token=sum(la.bytes_per_token(dtype_bytes) for la in layout.layers),
        blocks_per_seq=sum(g.blocks_per_seq for g in groups), groups=tuple(groups), note=note)


def _blocks_per_seq(kind: LayerKV, block_size: int, max_model_len: int,
                    batched_tokens: int) -> int:
    """The most blocks one sequence holds in one group of this kind (vLLM's
    ``max_memory_usage_bytes`` in pages): a sliding window keeps the last ``window - 1``
    tokens plus a step's new ones, and one block more when the window starts mid-block."""
    if kind.attention != SLIDING:
        return blocks_for(max_model_len, block_size)
    tokens = min(kind.sliding_window - 1 + batched_tokens, max_model_len)
    return blocks_for(tokens, block_size) + 1
