"""The Llama-family transformer (Llama 2/3, Mistral, Qwen2, Qwen3, Granite, Phi-3; Mixtral
and Qwen3-MoE with the experts of engine/model/moe.py) over a paged KV cache.

Module names match Hugging Face's, so a checkpoint's state dict loads as is. The forward
pass takes every token of a step flattened into one ``[num_tokens]`` batch: the linear
layers see all of them at once; attention (``attention.py``) runs per prefill and batched
over decodes, reading keys and values from the paged cache through each sequence's block
table.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.checkpoint.tensor_shapes import BLOCK_SPARSE_MOE
from kvledger.engine.model.attention import AttentionMetadata, as_bytes, attend
from kvledger.engine.model.longrope import longrope_frequencies
from kvledger.engine.model.lora import LoraBatch, project
from kvledger.engine.model.moe import MixtralExpert, SparseMoE


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused op, the same figures as the lines below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding:
    """cos/sin tables for every position up to ``max_positions``, computed as HF does;
    ``sin``'s first half negated, so that ``rotate(x)`` is one ``roll`` (``_rope``). As wide
    as the dimensions RoPE turns (``rotary_dim``: Phi-4-mini's first 3/4 of a head). With
    Gemma 3's sliding layers' own RoPE (``local_rope_theta``), their tables follow the
    others' on the last dimension (``gemma.py`` reads its layer's half)."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        dim = config.rotary_dim or config.head_dim
        scaling, scale = config.rope_scaling, 1.0
        if scaling and scaling.get("rope_type") == "longrope":  # Phi-3's (longrope.py)
            inv_freq, scale = longrope_frequencies(dim, config.rope_theta, scaling, max_positions)
            emb = _table(inv_freq, max_positions)
        else:
            emb = _angles(config.rope_theta, scaling, dim, max_positions)
        sign = torch.ones(dim).index_fill_(0, torch.arange(dim // 2), -1.0)
        local = config.gemma.local_rope_theta if config.gemma is not None else None
        if local is not None:
            emb = torch.cat((emb, _angles(local, None, dim, max_positions)), dim=-1)
            sign = sign.repeat(2)
        # cos and sin times longrope's attention factor, as transformers scales them.
        self.cos = (emb.cos() * scale).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scale * sign).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


def _angles(theta: float, scaling: dict | None, dim: int, max_positions: int) -> torch.Tensor:
    """Each position's rotation angles ``[max_positions, dim]``, both halves alike."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return _table(_scale_inv_freq(inv_freq, scaling), max_positions)


def _table(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """The angles ``[max_positions, 2 * len(inv_freq)]`` of inverse frequencies ``inv_freq``."""
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs, freqs), dim=-1)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by `factor`, short kept, the middle interpolated.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``x * cos + rotate_half(x) * sin``, figure for figure, in four ops:
    ``rotate_half(x)`` is ``x``'s halves swapped with the first negated, and ``sin`` (from
    ``RotaryEmbedding``) carries that sign. Tables narrower than ``x`` turn its first
    dimensions only, the rest passed as they are (partial rotary)."""
    if cos.shape[-1] < x.shape[-1]:
        turned, kept = x.split((cos.shape[-1], x.shape[-1] - cos.shape[-1]), dim=-1)
        return torch.cat((_rope(turned, cos, sin), kept), dim=-1)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, head_dim = config.hidden_size, config.head_dim
        q_size, kv_size = config.num_attention_heads * head_dim, config.num_kv_heads * head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_bias)
        self.qkv_proj: nn.Module | None = None  # q, k and v as one layer (fusion.py)
        self.fused_sizes: list[int] | None = None  # its outputs' split
        if config.qk_norm:  # Qwen3: per head, over head_dim
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.scale = config.attention_scale  # None: 1/sqrt(head_dim); Granite's multiplier
        # An fp8 KV cache holds K / k_scale and V / v_scale: the checkpoint's (loader.py).
        self.k_scale = self.v_scale = 1.0

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self._qkv(x, cos.unsqueeze(1), sin.unsqueeze(1), meta.lora)
        if kv_cache is not None:
            self._write_cache(kv_cache, k, v, meta.slot_mapping)
        out = attend(q, k, v, kv_cache, meta, (self.k_scale, self.v_scale), self.scale)
        return project(self.o_proj, out.view(x.shape[0], -1), meta.lora)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             lora: LoraBatch | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[tokens, heads, head_dim]``, k and v ``[tokens, kv_heads, head_dim]``, RoPE
        applied (after Qwen3's per-head norm)."""
        num_tokens = x.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None and not self.qk_norm:  # q and k side by side: one rope
            qkv = self.qkv_proj(x)
            qk = _rope(qkv[:, :(heads + kv_heads) * head_dim].view(num_tokens, -1, head_dim),
                       cos, sin)
            v = qkv[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
            return qk[:, :heads], qk[:, heads:], v
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.fused_sizes, dim=-1)
        else:
            q, k, v = (project(p, x, lora) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(num_tokens, heads, head_dim)
        k = k.view(num_tokens, kv_heads, head_dim)
        v = v.view(num_tokens, kv_heads, head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _write_cache(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
        """Each token's K and V into its slot of ``kv_cache`` ``[2 (K, V), kv_heads,
        num_blocks, block_size, head_dim]``; an fp8 cache holds them scaled and cast
        (saturating), written as bytes."""
        if kv_cache.element_size() > 1:
            slots = kv_cache.view(2, self.num_kv_heads, -1, self.head_dim)
            slots[0].index_copy_(1, slot_mapping, k.transpose(0, 1).to(kv_cache.dtype))
            slots[1].index_copy_(1, slot_mapping, v.transpose(0, 1).to(kv_cache.dtype))
            return
        slots = as_bytes(kv_cache).view(2, self.num_kv_heads, -1, self.head_dim)
        if (self.k_scale, self.v_scale) != (1.0, 1.0):  # by numbers: no host copy (graphs)
            k, v = k / self.k_scale, v / self.v_scale
        kv = torch.stack((k, v)).transpose(1, 2)
        slots.index_copy_(2, slot_mapping, as_bytes(kv.to(kv_cache.dtype)))


class MLP(nn.Module):
    """The dense SwiGLU MLP; also each Qwen3-MoE expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up as one layer (fusion.py)
        self.fused_sizes: list[int] | None = None  # its outputs' split

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.fused_sizes, dim=-1)
        else:
            gate, up = project(self.gate_proj, x, lora), project(self.up_proj, x, lora)
        return project(self.down_proj, F.silu(gate).mul_(up), lora)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        mixtral = config.architecture == "MixtralForCausalLM"
        if config.moe is None or index not in config.moe.sparse_layers:
            feed_forward = MLP(config.hidden_size, config.intermediate_size)
        else:
            feed_forward = SparseMoE(config.hidden_size, config.moe, MixtralExpert if mixtral else MLP)
        # Mixtral's and Granite-MoE's checkpoints name it block_sparse_moe, the others' mlp.
        self.feed_forward_name = ("block_sparse_moe" if config.architecture in BLOCK_SPARSE_MOE
                                  else "mlp")
        self.add_module(self.feed_forward_name, feed_forward)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier  # Granite's; 1.0 otherwise

    def forward(self, x, cos, sin, kv_cache, meta):
        r = self.residual_multiplier
        attended = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        x = x + (attended if r == 1.0 else attended * r)
        feed_forward = self._modules[self.feed_forward_name]
        h = self.post_attention_layernorm(x)
        # LoRA adapts dense MLPs only (--enable-lora refuses mixture-of-experts models).
        out = feed_forward(h) if meta.lora is None else feed_forward(h, meta.lora)
        return x.add_(out if r == 1.0 else out * r)


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """``model.*`` and ``lm_head`` as in Hugging Face's ``*ForCausalLM``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_caches: list[torch.Tensor] | None, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm."""
        x = embed(self.model.embed_tokens, input_ids, self.config)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, None if kv_caches is None else kv_caches[i], meta)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return scaled_logits(self.lm_head(hidden), self.config)


def embed(embedding: nn.Module, input_ids: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The input embeddings, times Granite's ``embedding_multiplier``."""
    x = embedding(input_ids)
    return x if config.embedding_multiplier == 1.0 else x * config.embedding_multiplier


def scaled_logits(logits: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """float32 logits, divided by Granite's ``logits_scaling`` (as transformers divides
    them, in the model's dtype)."""
    if config.logits_scaling != 1.0:
        logits = logits / config.logits_scaling
    return logits.float()
