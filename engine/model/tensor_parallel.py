"""A loaded ``CausalLM`` cut down to one rank's shard (Megatron-style tensor parallelism,
as the planner counts it in ``planner/sharding.py``):

- attention: q/k/v column-parallel (the rank's query heads and ``max(1, kv_heads / N)`` KV
  heads, a KV head shared by N / kv_heads ranks once N exceeds them), o row-parallel;
- the dense MLP and every expert: gate/up column-parallel, down row-parallel; the router
  and the norms whole;
- the embedding and the LM head split by vocabulary (padded to N equal shards).

A row-parallel output is a partial sum: the attention block's and the MLP's (or the
experts', summed once) outputs are all-reduced across the ranks; the embedding's rows
outside a rank's range are zeros, all-reduced too; the LM head's logits are all-gathered
in full on every rank. Each rank's KV cache then holds only its KV heads
(``model.config`` says how many).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvledger.engine.model.pipeline import StageLM
from kvledger.engine.model.transformer import CausalLM
from kvledger.engine.planner.sharding import check_shardable


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks sharing one model (or one pipeline stage:
    ``group``, the stage's process group; None: the default group, every rank)."""

    rank: int
    world: int
    group: Any = None

    def share(self, size: int) -> slice:
        """This rank's equal share of ``size`` rows (size divisible by world)."""
        step = size // self.world
        return slice(self.rank * step, (self.rank + 1) * step)


def all_reduce_hook(group: Any) -> Callable[..., torch.Tensor]:
    """A forward hook: the sum of every rank's partial output, over ``group``."""
    def all_reduce_output(module: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=group)
        return output

    return all_reduce_output


class VocabParallelEmbedding(nn.Module):
    """One rank's rows ``[start, start + rows)`` of the (padded) vocabulary."""

    def __init__(self, weight: torch.Tensor, start: int, group: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0)
        dist.all_reduce(out, group=self.group)
        return out


class ParallelLMHead(nn.Module):
    """One rank's vocabulary rows of the LM head; logits gathered in full (``vocab``)."""

    def __init__(self, weight: torch.Tensor, vocab: int, world: int, group: Any = None) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(
            weight, requires_grad=False)
        self.vocab, self.world, self.group = vocab, world, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab]


def _vocab_rows(weight: torch.Tensor, ranks: Ranks) -> tuple[torch.Tensor, int]:
    """This rank's rows of a vocabulary-by-hidden matrix padded to ``world`` equal shards."""
    vocab = weight.shape[0]
    rows = -(-vocab // ranks.world)
    start = ranks.rank * rows
    part = weight[start:start + rows]
    if part.shape[0] < rows:
        part = torch.cat([part, part.new_zeros(rows - part.shape[0], weight.shape[1])])
    return part.clone(), start


def _cut(linear: nn.Linear, rows: slice | None = None, cols: slice | None = None,
         keep_bias: bool = True) -> None:
    weight = linear.weight.data
    weight = weight[rows] if rows is not None else weight
    weight = weight[:, cols] if cols is not None else weight
    linear.weight = nn.Parameter(weight.clone(), requires_grad=False)
    linear.out_features, linear.in_features = weight.shape
    if linear.bias is not None:
        bias = linear.bias.data[rows] if rows is not None else linear.bias.data
        # A row-parallel bias is added once, after the sum: rank 0's alone.
        linear.bias = nn.Parameter(bias.clone() if keep_bias else torch.zeros_like(bias),
                                   requires_grad=False)


def _shard_mlp(mlp: nn.Module, ranks: Ranks) -> None:
    names = ("w1", "w3", "w2") if hasattr(mlp, "w1") else ("gate_proj", "up_proj", "down_proj")
    width = getattr(mlp, names[0]).weight.shape[0]
    share = ranks.share(width)
    _cut(getattr(mlp, names[0]), rows=share)
    _cut(getattr(mlp, names[1]), rows=share)
    _cut(getattr(mlp, names[2]), cols=share, keep_bias=ranks.rank == 0)


def _shard_attention(attn: nn.Module, ranks: Ranks) -> None:
    d, heads, kv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    q = ranks.share(heads)
    kv_here = max(1, kv // ranks.world)
    first_kv = ranks.rank * kv // ranks.world  # with N > kv: rank r shares head r*kv//N
    kv_rows = slice(first_kv * d, (first_kv + kv_here) * d)
    _cut(attn.q_proj, rows=slice(q.start * d, q.stop * d))
    _cut(attn.k_proj, rows=kv_rows)
    _cut(attn.v_proj, rows=kv_rows)
    _cut(attn.o_proj, cols=slice(q.start * d, q.stop * d), keep_bias=ranks.rank == 0)
    attn.num_heads, attn.num_kv_heads = heads // ranks.world, kv_here


def shard_model(model: CausalLM | StageLM, ranks: Ranks) -> CausalLM | StageLM:
    """``model`` (whole, or one pipeline stage, loaded) cut to ``ranks.rank``'s shard in
    place; collectives run in ``ranks.group`` (the default group when None), which must
    hold ``ranks.world`` ranks."""
    if ranks.world == 1:
        return model
    config = model.config
    # The plan refused what the engine cannot split (planner/support.py) before anything
    # loaded; a model given here directly is held to the same rule.
    check_shardable(config, ranks.world, config.moe and config.moe.intermediate_size)
    reduce = all_reduce_hook(ranks.group)
    for layer in model.model.layers:
        _shard_attention(layer.self_attn, ranks)
        layer.self_attn.register_forward_hook(reduce)
        feed_forward = layer._modules[layer.feed_forward_name]
        experts = getattr(feed_forward, "experts", None)
        for mlp in experts if experts is not None else [feed_forward]:
            _shard_mlp(mlp, ranks)
        feed_forward.register_forward_hook(reduce)  # experts summed: one reduce
    embedding = getattr(model.model, "embed_tokens", None)  # a later stage has none
    if embedding is not None:
        embed, start = _vocab_rows(embedding.weight.data, ranks)
        model.model.embed_tokens = VocabParallelEmbedding(embed, start, ranks.group)
    if hasattr(model, "lm_head"):  # an earlier stage has none
        if config.tie_word_embeddings and embedding is not None:
            head = model.model.embed_tokens.weight
        else:  # untied, or a last stage holding the tied embedding as its head
            head, _ = _vocab_rows(model.lm_head.weight.data, ranks)
        model.lm_head = ParallelLMHead(head, config.vocab_size, ranks.world, ranks.group)
    moe = config.moe and config.moe.sharded(ranks.world)
    model.config = dataclasses.replace(
        config, num_attention_heads=config.num_attention_heads // ranks.world,
        num_kv_heads=max(1, config.num_kv_heads // ranks.world),
        intermediate_size=config.intermediate_size // ranks.world, moe=moe)
    return model
