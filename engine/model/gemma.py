"""Gemma 1 and Gemma 3's text model over the paged KV cache, as transformers 5 runs them
(``modeling_gemma.py``, ``modeling_gemma3.py``), module names as their checkpoints'.

Where Gemma differs from the Llama family (``transformer.py``, whose projections, KV
writes and attention it reuses):

- the embedding is multiplied by ``sqrt(hidden_size)``, rounded to the model dtype first;
- every RMSNorm scales by ``1 + weight``, in float32, and casts back after;
- the MLP is GeGLU: ``gelu(gate, tanh approximation) * up``;
- Gemma 3: q and k are RMS-normed per head before RoPE; the attention's scale is
  ``query_pre_attn_scalar ** -0.5``; the attention's and the MLP's outputs are normed
  before their residual adds (``post_attention_layernorm``, ``post_feedforward_layernorm``),
  the MLP's input by ``pre_feedforward_layernorm``;
- Gemma 3: a sliding layer sees the last ``sliding_window`` positions (it reads
  ``AttentionMetadata.sliding``, built by ``StepAttention`` with that window) under its own
  RoPE (``rope_local_base_freq``, never scaled); a full layer sees them all under
  ``rope_theta`` with the ``rope_scaling`` given. ``RotaryEmbedding`` then holds both
  tables side by side, the full layers' first. Every layer's KV holds the whole context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.engine.checkpoint.layout import SLIDING
from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.model.attention import AttentionMetadata, attend
from kvledger.engine.model.lora import LoraBatch, project
from kvledger.engine.model.transformer import MLP, Attention, CausalLM


class GemmaRMSNorm(nn.Module):
    """RMSNorm times ``1 + weight``, computed in float32 (weights stored as offsets from 1)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(MLP):
    """GeGLU: the gate through tanh-approximated GELU (Gemma's ``gelu_pytorch_tanh``)."""

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.fused_sizes, dim=-1)
        else:
            gate, up = project(self.gate_proj, x, lora), project(self.up_proj, x, lora)
        return project(self.down_proj, F.gelu(gate, approximate="tanh").mul_(up), lora)


class GemmaAttention(Attention):
    """Llama's attention with Gemma 3's per-head q/k norms and its query scale."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        gemma = config.gemma
        if gemma.sandwich_norms:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.qk_norm = True
        # attend() scales by head_dim ** -0.5 (SDPA's and the kernels' default): q carries
        # the rest. 1.0 where the two agree (Gemma 1, Gemma 3 1B), and then q is not touched.
        scalar = gemma.query_pre_attn_scalar
        self.query_factor = 1.0 if scalar is None else (self.head_dim / scalar) ** 0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata,
                seen: AttentionMetadata) -> torch.Tensor:
        """``seen``: what this layer attends to (``meta``, or its ``sliding`` view);
        ``meta``'s the adapters (the step's)."""
        q, k, v = self._qkv(x, cos.unsqueeze(1), sin.unsqueeze(1), meta.lora)
        if self.query_factor != 1.0:
            q = q * self.query_factor
        if kv_cache is not None:
            self._write_cache(kv_cache, k, v, meta.slot_mapping)
        out = attend(q, k, v, kv_cache, seen, (self.k_scale, self.v_scale))
        return project(self.o_proj, out.view(x.shape[0], -1), meta.lora)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GemmaAttention(config)
        self.mlp = GemmaMLP(hidden, config.intermediate_size)
        self.feed_forward_name = "mlp"  # as DecoderLayer's (tensor_parallel.py reads it)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.sandwich = config.gemma.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.sliding = config.kv_layout().layers[index].attention == SLIDING
        # With two RoPE tables side by side (RotaryEmbedding), the ones this layer reads.
        dim = config.head_dim
        self.rope_half = None if config.gemma.local_rope_theta is None else (
            slice(dim, 2 * dim) if self.sliding else slice(0, dim))

    def forward(self, x, cos, sin, kv_cache, meta):
        if self.rope_half is not None:
            cos, sin = cos[:, self.rope_half], sin[:, self.rope_half]
        # The full layers' metadata sees the whole context; the sliding ones' its window.
        seen = meta
        if self.sliding:
            if meta.sliding is None:
                raise RuntimeError("a sliding layer's step has no sliding-window metadata")
            seen = meta.sliding
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, seen)
        if not self.sandwich:  # Gemma 1: as Llama
            x = x + h
            h = self.post_attention_layernorm(x)
            return x.add_(self.mlp(h, meta.lora))
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), meta.lora)
        return x.add_(self.post_feedforward_layernorm(h))


class GemmaCausalLM(CausalLM):
    """``model.*`` and ``lm_head`` (tied to the embedding) as in ``Gemma*ForCausalLM``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model.layers = nn.ModuleList(GemmaDecoderLayer(config, i)
                                          for i in range(config.num_layers))
        self.model.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.normalizer = config.hidden_size ** 0.5

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_caches: list[torch.Tensor] | None, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm."""
        x = self.model.embed_tokens(input_ids)
        # transformers rounds the scale to the model dtype first (bfloat16: 55.5 for 3072).
        x = x.mul_(float(torch.tensor(self.normalizer, dtype=x.dtype)))
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, None if kv_caches is None else kv_caches[i], meta)
        return self.model.norm(x)


def sliding_layers_window(config: ModelConfig) -> int | None:
    """The window of a model whose layers attend differently (Gemma 3), whose sliding
    layers read ``AttentionMetadata.sliding``; None for one whose layers all attend alike
    (``config.sliding_window``, Mistral's, is every layer's)."""
    if config.gemma is None:
        return None
    windows = config.kv_layout().sliding_windows
    return windows[0] if windows else None
