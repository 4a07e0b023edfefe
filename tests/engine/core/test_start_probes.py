"""The start's probes of a decode step (core/start_probes.py): the weights' streaming speed
and what a step costs beside them, timed on the model's own kinds of layer shrunk."""

from __future__ import annotations

import weakref

import pytest
import torch

from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.core import start_probes
from kvledger.engine.core.start_probes import (
    PACK_SAMPLE_BYTES,
    SHRUNK_WIDTH,
    pack_speed,
    shrunk,
    step_cost,
    stream_speed,
)
from kvledger.engine.model.cpu_linear import packable
from kvledger.engine.model.moe import SparseMoE
from kvledger.engine.model.transformer import CausalLM

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-mistral"])
def test_the_shrunk_model_keeps_each_kind_of_layer(make_model_dir, name):
    config = ModelConfig.from_dir(make_model_dir(name))
    tiny = shrunk(config, 3)
    group = config.num_attention_heads // config.num_kv_heads
    assert (tiny.num_layers, tiny.num_kv_heads, tiny.num_attention_heads) == (3, 1, group)
    assert tiny.head_dim == config.head_dim and tiny.hidden_size == group * config.head_dim
    assert tiny.intermediate_size == SHRUNK_WIDTH and tiny.weight_format == ""
    # What sets a layer's kernels stays: norms, biases, the window, the routed experts.
    for kept in ("qk_norm", "qkv_bias", "o_bias", "sliding_window", "rms_norm_eps",
                 "rope_scaling"):
        assert getattr(tiny, kept) == getattr(config, kept)
    model = CausalLM(tiny)
    routed = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if config.moe is None:
        assert tiny.moe is None and not routed
    else:
        assert len(routed) == 3 and tiny.moe.num_experts == config.moe.num_experts
        assert tiny.moe.num_experts_per_tok == config.moe.num_experts_per_tok


def test_a_steps_cost_beside_its_weights_is_timed_per_layer_and_per_step(make_model_dir):
    config = ModelConfig.from_dir(make_model_dir("tiny-llama"))
    cost = step_cost(config, CPU, torch.float32, 16, 128, fuse=True, paged=False, repeats=9)
    # A layer is a few dozen kernels, each tens of microseconds to dispatch on this CPU;
    # a busy machine (the tests' other worker) moves a median, not the order of it.
    assert 0 <= cost.per_layer < 0.05 and 0 <= cost.per_step < 0.05
    assert 1e-4 < 3 * cost.per_layer + cost.per_step < 0.1  # a three-layer step costs
    assert 0 <= cost.new_shape < 1  # oneDNN's set-up of the shapes' primitives


def test_the_streaming_speed_reads_a_weight_larger_than_a_cache():
    speed = stream_speed(CPU, torch.float32, 512, sample_bytes=32 << 20)
    assert speed.bytes >= 32 << 20 and speed.seconds > 0
    assert 1e8 < speed.bytes_per_s < 1e12  # memory's speed, not a cache's or nothing


@pytest.mark.skipif(not packable(torch.float32), reason="this CPU's oneDNN packs nothing")
def test_packing_is_timed_on_distinct_weights_each_kept_as_a_model_keeps_them(monkeypatch):
    """One weight reordered again is read from the cache, and a packed copy freed at once
    lends its pages to the next: the packing pass of a model meets neither. It meets the
    MLP's shapes both ways round (gate and up into the MLP's width, down out of it), whose
    reorders run at different speeds."""
    sources, shapes, timed, kept = [], [], [], []
    real = torch.ops.mkldnn._reorder_linear_weight

    class Ops:
        @staticmethod
        def _reorder_linear_weight(weight, rows):
            kept.append(all(ref() is not None for ref in timed))  # the earlier copies
            out = real(weight, rows)
            if len(sources) >= 2:  # the first of each shape, untimed, may go
                timed.append(weakref.ref(out))
            sources.append(weight.data_ptr())
            shapes.append(tuple(weight.shape))
            return out

    monkeypatch.setattr(start_probes.torch.ops, "mkldnn", Ops)
    hidden, intermediate = 512, 1024
    weight_bytes = hidden * intermediate * 4
    speed = pack_speed(CPU, torch.float32, hidden, intermediate, model_bytes=1 << 40)
    count = PACK_SAMPLE_BYTES // weight_bytes
    assert shapes[:2] == [(intermediate, hidden), (hidden, intermediate)]  # set up, untimed
    assert len(set(sources[2:])) == len(sources) - 2 == count  # each timed weight its own
    assert shapes[2:].count((intermediate, hidden)) == 2 * shapes[2:].count((hidden, intermediate))
    assert speed.bytes == count * weight_bytes and speed.seconds > 0
    assert all(kept) and all(ref() is None for ref in timed)  # kept to the end, then freed
    small = pack_speed(CPU, torch.float32, hidden, intermediate, model_bytes=weight_bytes)
    assert small.bytes == 3 * weight_bytes  # a gate, an up and a down at the least
