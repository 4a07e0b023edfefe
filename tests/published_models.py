"""Published models as test data: each ``config.json`` as its repository publishes it
(``tests/data/published/NAME.json``, sources in the README there) and the tensors such a
checkpoint stores (names, dtypes, shapes), for header-only checkpoints
(``budget_checkpoints.write_header_only``) and plans without any file."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from budget_checkpoints import tensor_bytes

from kvledger.engine.checkpoint.contents import ModelShape, WeightsInfo, model_shape

PUBLISHED = Path(__file__).parent / "data" / "published"

Tensors = dict[str, tuple[str, list[int]]]


def published_config(name: str) -> dict:
    """``tests/data/published/{name}.json``: e.g. ``Llama-3-8B``, ``gpt-oss-20b``."""
    return json.loads((PUBLISHED / f"{name}.json").read_text())


def published_shape(name: str) -> ModelShape:
    return model_shape(published_config(name))


def published_weights(name: str) -> WeightsInfo:
    """The weights of ``name``'s published tensors, as the planner counts a header."""
    by_dtype: Counter[str] = Counter()
    tensors = published_tensors(published_config(name))
    for dtype, shape in tensors.values():
        by_dtype[dtype] += tensor_bytes(dtype, shape)
    return WeightsInfo(sum(by_dtype.values()), len(tensors), max(by_dtype, key=by_dtype.get),
                       (), dict(by_dtype))


def published_tensors(c: dict) -> Tensors:
    """The tensors a checkpoint of config ``c`` stores, by its ``model_type``."""
    decoders = {
        "llama": lambda: _decoder(c),
        "mistral": lambda: _decoder(c),
        "qwen3": lambda: _decoder(c, qk_norm=True),
        "qwen3_moe": lambda: _decoder(c, qk_norm=True, moe="qwen3"),
        "mixtral": lambda: _decoder(c, moe="mixtral"),
        "gemma": lambda: _decoder(c, tied=True),
        "gemma2": lambda: _decoder(c, sandwich_norms=True, tied=True),
        "gemma3_text": lambda: _decoder(c, qk_norm=True, sandwich_norms=True, tied=True),
        "gemma3": lambda: _gemma3_multimodal(c),
        "deepseek_v2": lambda: _deepseek(c),
        "deepseek_v3": lambda: _deepseek(c),
        "kimi_k2": lambda: _deepseek(c),
        "gpt_oss": lambda: _gpt_oss(c),
    }
    return decoders[c["model_type"]]()


def _decoder(c: dict, *, prefix: str = "model.", qk_norm: bool = False,
             sandwich_norms: bool = False, moe: str = "",
             tied: bool = False) -> Tensors:
    """A Llama-family decoder: attention, a dense or mixture-of-experts MLP, the norms;
    no ``lm_head`` when it is the embedding (Gemma)."""
    h, v, n = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    d = c.get("head_dim") or h // n
    kv = c["num_key_value_heads"] * d
    t = {f"{prefix}embed_tokens.weight": ("BF16", [v, h]), f"{prefix}norm.weight": ("BF16", [h])}
    for k in range(c["num_hidden_layers"]):
        p = f"{prefix}layers.{k}."
        t |= {p + "self_attn.q_proj.weight": ("BF16", [n * d, h]),
              p + "self_attn.k_proj.weight": ("BF16", [kv, h]),
              p + "self_attn.v_proj.weight": ("BF16", [kv, h]),
              p + "self_attn.o_proj.weight": ("BF16", [h, n * d]),
              p + "input_layernorm.weight": ("BF16", [h]),
              p + "post_attention_layernorm.weight": ("BF16", [h])}
        if qk_norm:
            t |= {p + "self_attn.q_norm.weight": ("BF16", [d]),
                  p + "self_attn.k_norm.weight": ("BF16", [d])}
        if sandwich_norms:
            t |= {p + "pre_feedforward_layernorm.weight": ("BF16", [h]),
                  p + "post_feedforward_layernorm.weight": ("BF16", [h])}
        if moe == "mixtral":
            i, experts = c["intermediate_size"], c["num_local_experts"]
            t[p + "block_sparse_moe.gate.weight"] = ("BF16", [experts, h])
            for e in range(experts):
                q = f"{p}block_sparse_moe.experts.{e}."
                t |= {q + "w1.weight": ("BF16", [i, h]), q + "w2.weight": ("BF16", [h, i]),
                      q + "w3.weight": ("BF16", [i, h])}
        elif moe == "qwen3":
            i, experts = c["moe_intermediate_size"], c["num_experts"]
            t[p + "mlp.gate.weight"] = ("BF16", [experts, h])
            for e in range(experts):
                t |= _mlp(f"{p}mlp.experts.{e}.", h, i)
        else:
            t |= _mlp(p + "mlp.", h, c["intermediate_size"])
    if not tied:
        t["lm_head.weight"] = ("BF16", [v, h])
    return t


def _mlp(p: str, h: int, i: int, linear=None) -> Tensors:
    linear = linear or (lambda name, out, inp: {name + ".weight": ("BF16", [out, inp])})
    return (linear(p + "gate_proj", i, h) | linear(p + "up_proj", i, h)
            | linear(p + "down_proj", h, i))


def _deepseek(c: dict) -> Tensors:
    """DeepSeek-V2/V3 (and Kimi-K2): MLA, dense first layers, routed + shared experts;
    V3's linear weights are fp8 blocks of 128 x 128 with F32 inverse scales; its
    multi-token-prediction layer is stored too (and so counted)."""
    h, v, heads = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    rank, q_rank, experts = c["kv_lora_rank"], c["q_lora_rank"], c["n_routed_experts"]
    fp8 = (c.get("quantization_config") or {}).get("quant_method") == "fp8"

    def linear(name: str, out: int, inp: int) -> Tensors:
        if not fp8:
            return {name + ".weight": ("BF16", [out, inp])}
        return {name + ".weight": ("F8_E4M3", [out, inp]),
                name + ".weight_scale_inv": ("F32", [-(-out // 128), -(-inp // 128)])}

    t = {"model.embed_tokens.weight": ("BF16", [v, h]), "model.norm.weight": ("BF16", [h]),
         "lm_head.weight": ("BF16", [v, h])}
    for k in range(c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{k}."
        if q_rank:
            t |= linear(p + "self_attn.q_a_proj", q_rank, h)
            t[p + "self_attn.q_a_layernorm.weight"] = ("BF16", [q_rank])
            t |= linear(p + "self_attn.q_b_proj", heads * (nope + rope), q_rank)
        else:
            t |= linear(p + "self_attn.q_proj", heads * (nope + rope), h)
        t |= linear(p + "self_attn.kv_a_proj_with_mqa", rank + rope, h)
        t[p + "self_attn.kv_a_layernorm.weight"] = ("BF16", [rank])
        t |= linear(p + "self_attn.kv_b_proj", heads * (nope + vd), rank)
        t |= linear(p + "self_attn.o_proj", h, heads * vd)
        t |= {p + "input_layernorm.weight": ("BF16", [h]),
              p + "post_attention_layernorm.weight": ("BF16", [h])}
        if k < c["first_k_dense_replace"]:
            t |= _mlp(p + "mlp.", h, c["intermediate_size"], linear)
            continue
        i = c["moe_intermediate_size"]
        t[p + "mlp.gate.weight"] = ("BF16", [experts, h])
        if c.get("topk_method") == "noaux_tc":
            t[p + "mlp.gate.e_score_correction_bias"] = ("F32", [experts])
        for e in range(experts):
            t |= _mlp(f"{p}mlp.experts.{e}.", h, i, linear)
        t |= _mlp(p + "mlp.shared_experts.", h, i * c["n_shared_experts"], linear)
        if k >= c["num_hidden_layers"]:  # the multi-token-prediction module
            t |= {p + "embed_tokens.weight": ("BF16", [v, h]), p + "enorm.weight": ("BF16", [h]),
                  p + "hnorm.weight": ("BF16", [h]), p + "eh_proj.weight": ("BF16", [h, 2 * h]),
                  p + "shared_head.norm.weight": ("BF16", [h]),
                  p + "shared_head.head.weight": ("BF16", [v, h])}
    return t


def _gpt_oss(c: dict) -> Tensors:
    """gpt-oss: biased attention with a learned sink per head, MXFP4 experts stored as U8
    blocks of 32 values (16 bytes) and one U8 scale per block, BF16 expert biases."""
    h, v, n, d = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["head_dim"]
    kv, i, experts = c["num_key_value_heads"] * d, c["intermediate_size"], c["num_local_experts"]
    t = {"model.embed_tokens.weight": ("BF16", [v, h]), "model.norm.weight": ("BF16", [h]),
         "lm_head.weight": ("BF16", [v, h])}
    for k in range(c["num_hidden_layers"]):
        p = f"model.layers.{k}."
        for name, out, inp in (("q_proj", n * d, h), ("k_proj", kv, h), ("v_proj", kv, h),
                               ("o_proj", h, n * d)):
            t |= {f"{p}self_attn.{name}.weight": ("BF16", [out, inp]),
                  f"{p}self_attn.{name}.bias": ("BF16", [out])}
        e = p + "mlp.experts."
        t |= {p + "self_attn.sinks": ("BF16", [n]),
              p + "mlp.router.weight": ("BF16", [experts, h]),
              p + "mlp.router.bias": ("BF16", [experts]),
              e + "gate_up_proj_blocks": ("U8", [experts, 2 * i, h // 32, 16]),
              e + "gate_up_proj_scales": ("U8", [experts, 2 * i, h // 32]),
              e + "gate_up_proj_bias": ("BF16", [experts, 2 * i]),
              e + "down_proj_blocks": ("U8", [experts, h, i // 32, 16]),
              e + "down_proj_scales": ("U8", [experts, h, i // 32]),
              e + "down_proj_bias": ("BF16", [experts, h]),
              p + "input_layernorm.weight": ("BF16", [h]),
              p + "post_attention_layernorm.weight": ("BF16", [h])}
    return t


def _gemma3_multimodal(c: dict) -> Tensors:
    """Gemma 3's language model (262,208-token vocabulary by default) and its SigLIP tower."""
    text = {"vocab_size": 262_208, **c["text_config"]}
    t = _decoder(text, prefix="language_model.model.", qk_norm=True, sandwich_norms=True,
                 tied=True)
    vc = c["vision_config"]
    w, i = vc["hidden_size"], vc["intermediate_size"]
    patches = (vc["image_size"] // vc["patch_size"]) ** 2
    vt = "vision_tower.vision_model."
    t |= {vt + "embeddings.patch_embedding.weight": ("BF16", [w, 3, vc["patch_size"],
                                                              vc["patch_size"]]),
          vt + "embeddings.patch_embedding.bias": ("BF16", [w]),
          vt + "embeddings.position_embedding.weight": ("BF16", [patches, w]),
          vt + "post_layernorm.weight": ("BF16", [w]), vt + "post_layernorm.bias": ("BF16", [w]),
          "multi_modal_projector.mm_input_projection_weight": ("BF16", [w, text["hidden_size"]]),
          "multi_modal_projector.mm_soft_emb_norm.weight": ("BF16", [w])}
    for k in range(vc["num_hidden_layers"]):
        p = f"{vt}encoder.layers.{k}."
        for name, out, inp in (("self_attn.q_proj", w, w), ("self_attn.k_proj", w, w),
                               ("self_attn.v_proj", w, w), ("self_attn.out_proj", w, w),
                               ("mlp.fc1", i, w), ("mlp.fc2", w, i)):
            t |= {f"{p}{name}.weight": ("BF16", [out, inp]), f"{p}{name}.bias": ("BF16", [out])}
        for norm in ("layer_norm1", "layer_norm2"):
            t |= {f"{p}{norm}.weight": ("BF16", [w]), f"{p}{norm}.bias": ("BF16", [w])}
    return t


def parameter_count(tensors: Tensors) -> int:
    """Parameters as model cards count them: elements, an MXFP4 byte holding two, its
    scales not counted."""
    total = 0
    for name, (_, shape) in tensors.items():
        if name.endswith("_scales"):
            continue
        n = 1
        for d in shape:
            n *= d
        total += 2 * n if name.endswith("_blocks") else n
    return total
