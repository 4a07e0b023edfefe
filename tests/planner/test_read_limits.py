"""read_limits' figures, laid out: the index and safetensors headers the largest published
checkpoints have (their tensors named and shaped as their configs make them, split into
their shard counts), measured as the hub serves them, against ``ReadLimits()``."""

from __future__ import annotations

import json
import math

import pytest

from kvledger.engine.checkpoint.read_limits import MAX_MODEL_BYTES, MAX_TENSORS, ReadLimits
from kvledger.operator.cluster.hub_models import OPERATOR_LIMITS

MiB = 2**20
ELEMENT_BYTES = {"BF16": 2, "F8_E4M3": 1, "F32": 4}


def llama(layers: int, hidden: int, inter: int, heads: int) -> list[tuple[str, list, str]]:
    kv = 8 * hidden // heads
    out = [("model.embed_tokens.weight", [128256, hidden], "BF16"),
           ("model.norm.weight", [hidden], "BF16"), ("lm_head.weight", [128256, hidden], "BF16")]
    for n in range(layers):
        p = f"model.layers.{n}."
        out += [(p + f"self_attn.{w}_proj.weight", [kv if w in "kv" else hidden, hidden], "BF16")
                for w in "qkvo"]
        out += [(p + f"mlp.{w}_proj.weight", [inter, hidden], "BF16") for w in ("gate", "up", "down")]
        out += [(p + "input_layernorm.weight", [hidden], "BF16"),
                (p + "post_attention_layernorm.weight", [hidden], "BF16")]
    return out


def experts(prefix: str, count: int, inter: int, hidden: int, fp8: bool) -> list:
    """A mixture's experts, each weight in FP8 with its block scales when ``fp8``."""
    out = []
    for e in range(count):
        for w in ("gate_proj", "up_proj", "down_proj"):
            name = f"{prefix}mlp.experts.{e}.{w}.weight"
            out.append((name, [inter, hidden], "F8_E4M3" if fp8 else "BF16"))
            if fp8:
                out.append((name + "_scale_inv", [inter // 128, hidden // 128], "F32"))
    return out


def qwen3_moe(layers: int, count: int, hidden: int, inter: int, fp8: bool) -> list:
    """Qwen3-MoE (Qwen3ForCausalLM's mixture: the engine runs it)."""
    out = [("model.embed_tokens.weight", [151936, hidden], "BF16"),
           ("lm_head.weight", [151936, hidden], "BF16")]
    for n in range(layers):
        p = f"model.layers.{n}."
        for w in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.append((p + f"self_attn.{w}.weight", [4096, hidden], "F8_E4M3" if fp8 else "BF16"))
            if fp8:
                out.append((p + f"self_attn.{w}.weight_scale_inv", [32, hidden // 128], "F32"))
        out += [(p + n_, [hidden], "BF16") for n_ in ("input_layernorm.weight",
                                                      "post_attention_layernorm.weight")]
        out += [(p + f"self_attn.{w}_norm.weight", [128], "BF16") for w in "qk"]
        out += [(p + "mlp.gate.weight", [count, hidden], "BF16")]
        out += experts(p, count, inter, hidden, fp8=fp8)
    return out


def kimi_k2() -> list:
    """DeepSeek-V3's architecture at 1T: 61 layers, the first dense, 384 experts, FP8."""
    out = [("model.embed_tokens.weight", [163840, 7168], "BF16")]
    for n in range(61):
        p = f"model.layers.{n}."
        for w in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            out += [(p + f"self_attn.{w}.weight", [1536, 7168], "F8_E4M3"),
                    (p + f"self_attn.{w}.weight_scale_inv", [12, 56], "F32")]
        out += [(p + "mlp.gate.weight", [384, 7168], "BF16")]
        out += (experts(p, 384, 2048, 7168, fp8=True) if n else
                [(p + f"mlp.{w}.weight", [18432, 7168], "BF16") for w in ("gate_proj", "up_proj",
                                                                          "down_proj")])
    return [*out, ("lm_head.weight", [163840, 7168], "BF16")]


def served_bytes(tensors: list, shards: int) -> int:
    """The index and every shard's header (with its 8-byte length) as published."""
    per = -(-len(tensors) // shards)
    total, weight_map = 0, {}
    for k in range(shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        name_of = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        for name, shape, dtype in tensors[k * per:(k + 1) * per]:
            nbytes = math.prod(shape) * ELEMENT_BYTES[dtype]
            header[name] = {"dtype": dtype, "shape": shape,
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = name_of
        total += 8 + len(json.dumps(header, separators=(",", ":")))
    return total + len(json.dumps({"metadata": {"total_size": 10**12},
                                   "weight_map": weight_map}, indent=2))


@pytest.mark.parametrize(("name", "tensors", "shards", "mib", "count", "operator"), [
    ("Llama-3-70B", lambda: llama(80, 8192, 28672, 64), 30, 0.14, 723, True),
    ("Llama-3.1-405B", lambda: llama(126, 16384, 53248, 128), 191, 0.22, 1137, True),
    ("Qwen3-235B-A22B", lambda: qwen3_moe(94, 128, 4096, 1536, False), 118, 7.6, 36_944, True),
    ("Qwen3-Coder-480B-A35B-FP8", lambda: qwen3_moe(62, 160, 6144, 2560, True), 49, 12.9,
     60_328, True),
    ("Qwen3-235B-A22B-FP8", lambda: qwen3_moe(94, 128, 4096, 1536, True), 48, 15.7, 73_416,
     False),
    ("Kimi-K2", kimi_k2, 61, 30.0, 138_916, False),
])
def test_published_checkpoints_read_well_within_the_limits(name, tensors, shards, mib, count,
                                                          operator):
    """Each well within kvledger's limits (the pre-flight's); ``operator``: within the
    operator's too (its webhook plans it rather than leave it to the pre-flight)."""
    made = tensors()
    size = served_bytes(made, shards)
    assert len(made) == count, name
    assert size / MiB == pytest.approx(mib, rel=0.06), name
    limits = ReadLimits()
    assert size * 2 <= limits.model_bytes == MAX_MODEL_BYTES
    assert len(made) * 1.8 <= limits.tensors == MAX_TENSORS
    assert shards * 4 <= limits.shards
    within = size <= OPERATOR_LIMITS.model_bytes and len(made) <= OPERATOR_LIMITS.tensors
    assert within is operator, name
