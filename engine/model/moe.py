"""Mixture-of-experts MLPs (Mixtral, Qwen3-MoE, Granite-MoE): a router picks each token's
top-k experts, and each expert runs on the tokens routed to it only.

Module names match Hugging Face's checkpoints, one module per expert as published
(``experts.{i}.w1`` / ``gate_proj`` ...), so a state dict loads as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.engine.checkpoint.moe_config import MoEConfig


class MixtralExpert(nn.Module):
    """Mixtral's names: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """``gate`` (the router, ``[num_experts, hidden]``) and ``experts``.

    Routing is transformers': softmax over all experts in float32, top-k, renormalised
    over the k when the config says so, the weights cast to the model dtype (as its
    Qwen3-MoE does; its Mixtral multiplies in float32, the same in a float32 model).
    Tokens are grouped by expert with one sort and one count read back per layer; each
    expert's output is added into its tokens' rows in expert order, as transformers adds
    them."""

    def __init__(self, hidden_size: int, moe: MoEConfig, expert: type[nn.Module]) -> None:
        super().__init__()
        self.top_k, self.normalize_topk = moe.num_experts_per_tok, moe.normalize_topk
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(expert(hidden_size, moe.intermediate_size)
                                     for _ in range(moe.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [tokens, k]
        if self.normalize_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # (token, expert) pairs sorted by expert; a stable sort keeps tokens in order.
        order = chosen.flatten().argsort(stable=True)
        tokens = order // self.top_k
        pair_weights = weights.to(x.dtype).flatten()[order, None]
        out = torch.zeros_like(x)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        start = 0
        for index, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            rows = tokens[start:end]
            out.index_add_(0, rows, self.experts[index](x.index_select(0, rows)) * pair_weights[start:end])
            start = end
        return out
