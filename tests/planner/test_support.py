"""Each rule about what kvledger's engine can run has one owner (planner/support.py's
RULE_OWNERS), and the planner and the engine give the same verdict from it."""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from pathlib import Path

import pytest

from kvledger.engine.checkpoint.contents import ModelShape, WeightsInfo
from kvledger.engine.checkpoint.safetensors_header import TensorInfo
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.sharding import check_shardable
from kvledger.engine.planner.support import RULE_OWNERS, check_engine_run, expert_width
from kvledger.engine.settings.config import EngineConfig

ENGINE = Path(importlib.import_module("kvledger.engine").__file__).parent
SHAPE = ModelShape("MixtralForCausalLM", 2, 8, 4, 16, 128, 256, 1000, 4096, "bfloat16")


def _weights(*names_and_shapes: tuple[str, tuple[int, ...]]) -> WeightsInfo:
    tensors = tuple(TensorInfo(name, "BF16", shape, 2 * math.prod(shape))
                    for name, shape in names_and_shapes)
    return WeightsInfo(0, len(tensors), "BF16", (), tensors=tensors)


@pytest.mark.parametrize("rule", list(RULE_OWNERS))
def test_each_rule_is_written_in_its_owner_alone(rule):
    path, owner, words = RULE_OWNERS[rule]
    source = (ENGINE / path).read_text()
    name = owner.rsplit(".", 1)[-1]
    assert f"def {name}(" in source or f"class {name}" in source, (path, owner)
    assert words in source, (path, words)
    elsewhere = [str(p.relative_to(ENGINE)) for p in ENGINE.rglob("*.py")
                 if p.relative_to(ENGINE).as_posix() not in (path, "planner/support.py")
                 and words in p.read_text()]
    assert not elsewhere, f"{rule!r} is also written in {elsewhere}"


def test_the_engine_rules_refuse_by_name():
    dense = _weights(("model.layers.0.mlp.down_proj.weight", (128, 256)))
    moe = _weights(("model.layers.0.block_sparse_moe.experts.0.w2.weight", (128, 96)))
    check_engine_run(EngineConfig(model="/m", enable_lora=True), SHAPE, dense)
    with pytest.raises(BadInput, match="on dense models; MixtralForCausalLM is a mixture"):
        check_engine_run(EngineConfig(model="/m", enable_lora=True), SHAPE, moe)
    with pytest.raises(BadInput, match="does not serve LoRA adapters with --tensor-parallel"):
        check_engine_run(EngineConfig(model="/m", enable_lora=True, tensor_parallel_size=2),
                         SHAPE, dense)
    fp8 = dataclasses.replace(SHAPE, quantization="fp8")
    with pytest.raises(BadInput, match="does not shard fp8 weights yet"):
        check_engine_run(EngineConfig(model="/m", tensor_parallel_size=2), fp8, dense)
    with pytest.raises(BadInput, match="does not shard fp8 weights yet"):
        check_engine_run(EngineConfig(model="/m", tensor_parallel_size=2, quantization="fp8"),
                         SHAPE, dense)


def test_an_expert_width_that_does_not_split_is_refused_by_the_planner_too():
    """Before, only the engine's own check looked at the experts' width: the planner said
    fits and the engine then refused."""
    moe = _weights(("model.layers.0.mlp.experts.0.down_proj.weight", (128, 96)))
    assert expert_width(moe) == 96
    check_shardable(SHAPE, 4, expert_width(moe))
    with pytest.raises(BadInput, match="MLP width 96 does not divide into 64"):
        check_shardable(dataclasses.replace(SHAPE, num_attention_heads=64, num_kv_heads=64,
                                            intermediate_size=512), 64, expert_width(moe))


def test_each_weight_format_has_one_owner():
    """Every served format answers every question in checkpoint/weight_formats.py; nothing
    else in the planner, the pre-flight or the loader branches on a format's name (a new
    format is a class there and its torch layer in model/)."""
    from kvledger.engine.checkpoint import weight_formats

    assert set(weight_formats.WEIGHT_FORMATS) == {"fp8", "gptq", "awq", "w4a16"}
    for served in weight_formats.WEIGHT_FORMATS.values():
        for question in ("declared", "stored", "quantized_tensors", "layer_tensors",
                         "kept_as_stored", "workspace_bytes"):
            assert callable(getattr(served, question)), (served.name, question)
        assert served.label and isinstance(served.can_shard, bool)
    owners = {"checkpoint/fp8_format.py", "checkpoint/int4_format.py",
              "checkpoint/weight_formats.py", "model/fp8_linear.py", "model/int4_linear.py"}
    branching = re.compile(r"INT4_METHODS|LAYER_TENSORS\[|== (FP8|GPTQ|AWQ|W4A16)\b|"
                           r"in \(GPTQ|fp8_method\(|int4_method\(")
    found = [f"{p.relative_to(ENGINE)}: {m.group()}" for p in ENGINE.rglob("*.py")
             if p.relative_to(ENGINE).as_posix() not in owners
             for m in branching.finditer(p.read_text())]
    assert not found, found
