"""Pipeline parallelism in the planner (``--pipeline-parallel-size``, ``planner/stages.py``):
layers split as vLLM's ``get_pp_indices`` splits them, each tensor on the stage that loads
it, every figure per GPU of each stage, one pool of blocks across the stages, the refusal
naming the stage and remedies in stages. Plans of published shapes (Llama-3.1-405B,
Llama-3-70B, DeepSeek-V3) from header-only checkpoints of their real tensors."""

from __future__ import annotations

import dataclasses

import pytest
from published_models import published_config, published_tensors, published_weights

from kvledger.engine.checkpoint.contents import TensorInfo, model_shape
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.planner.report import render_report
from kvledger.engine.planner.stages import (
    stage_bounds,
    stage_layer_counts,
    stage_weights,
    tensor_stages,
)
from kvledger.engine.settings.config import EngineConfig

GiB = 2**30


@pytest.mark.parametrize(("layers", "stages", "counts"), [
    (61, 2, [31, 30]),  # vLLM's documented examples (DeepSeek-V3's 61 layers)
    (61, 4, [15, 15, 16, 15]),
    (80, 3, [27, 27, 26]),
    (80, 4, [20, 20, 20, 20]),
    (126, 2, [63, 63]),
    (10, 4, [2, 3, 3, 2]),
])
def test_layers_split_as_vllm_splits_them(layers, stages, counts):
    assert stage_layer_counts(layers, stages, env={}) == counts


def test_the_partition_variable_overrides_the_split_as_in_vllm():
    env = {"VLLM_PP_LAYER_PARTITION": "24,37"}
    assert stage_bounds(61, 2, env) == [(0, 24), (24, 61)]
    for bad in ("24,36", "61", "a,b", "0,61"):
        with pytest.raises(BadInput, match="VLLM_PP_LAYER_PARTITION"):
            stage_layer_counts(61, 2, {"VLLM_PP_LAYER_PARTITION": bad})
    with pytest.raises(BadInput, match="more stages than the model's 4 layers"):
        stage_layer_counts(4, 5, env={})


def weights_of(name: str):
    """WeightsInfo with the published checkpoint's tensors (names, dtypes, shapes)."""
    base = published_weights(name)
    tensors = tuple(TensorInfo(n, dtype, tuple(shape), _bytes(dtype, shape))
                    for n, (dtype, shape) in published_tensors(published_config(name)).items())
    return dataclasses.replace(base, tensors=tensors)


def _bytes(dtype: str, shape) -> int:
    from budget_checkpoints import tensor_bytes

    return tensor_bytes(dtype, list(shape))


def test_each_tensor_is_on_one_stage_the_embedding_on_both_ends_when_tied():
    weights = weights_of("Llama-3-70B")
    bounds = stage_bounds(80, 4, env={})
    parts = [stage_weights(weights, bounds, s, tied=False) for s in range(4)]
    assert sum(p.total_bytes for p in parts) == weights.total_bytes
    assert [t.name for t in parts[0].tensors if "layers" not in t.name] == [
        "model.embed_tokens.weight"]
    assert sorted(t.name for t in parts[3].tensors if "layers" not in t.name) == [
        "lm_head.weight", "model.norm.weight"]
    assert all(int(t.name.split(".")[2]) in range(20, 40)
               for t in parts[1].tensors)  # only layers 20-39
    assert tensor_stages("model.embed_tokens.weight", bounds, tied=True) == (0, 3)
    assert tensor_stages("model.layers.99.mlp.up_proj.weight", bounds, tied=False) == (3,)


def plan(name: str, **flags):
    config = EngineConfig(**{"model": name, "device_memory_bytes": 80 * GiB,
                             "max_model_len": 8192, "max_num_seqs": 16, **flags})
    return make_plan(config, shape=model_shape(published_config(name)),
                     weights=weights_of(name))


def test_405b_on_two_nodes_of_eight_80_gib_gpus():
    one = plan("Llama-3.1-405B", tensor_parallel_size=8)
    assert not one.fits
    assert [r.flag for r in one.remedies] == ["--pipeline-parallel-size"]
    assert one.remedies[0].value == 2
    two = plan("Llama-3.1-405B", tensor_parallel_size=8, pipeline_parallel_size=2)
    assert two.fits and two.pipeline_parallel_size == 2
    stages = two.stages
    assert [(f.first_layer, f.end_layer) for f in stages] == [(0, 63), (63, 126)]
    # nothing lost or doubled in the split: the stages' weights are the one plan's
    assert sum(f.classes["weights"] for f in stages) == one.classes["weights"]
    # each stage holds its own layers' KV for every sequence: half a block each
    assert [f.bytes_per_block * 2 for f in stages] == [one.kv.bytes_per_block] * 2
    assert sum(f.classes["kv_cache"] for f in stages) == one.classes["kv_cache"]
    report = render_report(two)
    assert report.startswith("fits: engine requires 54.0 GiB per GPU on stage 2 of 2 "
                             "(layers 63-125), x 8 GPUs x 2 stages")
    assert "  stages, per GPU: 1: layers 0-62, 54.0 GiB | 2: layers 63-125, 54.0 GiB" in report
    figures = two.to_json()
    assert (figures["pipeline_parallel_size"], figures["stage"]) == (2, 1)
    assert [s["layers"] for s in figures["stages"]] == [[0, 63], [63, 126]]


def test_a_refusal_names_the_stage_that_does_not_fit():
    refused = plan("Llama-3.1-405B", tensor_parallel_size=8, pipeline_parallel_size=2,
                   max_model_len=131072)
    assert not refused.fits
    headline = render_report(refused).splitlines()[0]
    assert headline.startswith("error: engine requires") and "on stage 1 of 2 (layers 0-62)" \
        in headline
    flags = {r.flag: r.value for r in refused.remedies}
    assert flags["--pipeline-parallel-size"] > 2 and flags["--max-model-len"] < 131072


def test_one_pool_of_blocks_across_the_stages_under_a_cap():
    """Under --gpu-memory-utilization each stage's pool would be what its own limit leaves;
    the engine runs one block count on every stage, the fewest (vLLM takes the minimum
    across its workers), here the last stage's, which also holds the LM head."""
    shape = model_shape(published_config("Llama-3.1-405B"))
    weights = weights_of("Llama-3.1-405B")
    config = EngineConfig(model="x", device_memory_bytes=80 * GiB, max_model_len=8192,
                          gpu_memory_utilization=0.9, tensor_parallel_size=8,
                          pipeline_parallel_size=2)
    staged = make_plan(config, shape=shape, weights=weights)
    assert staged.fits and staged.stage == 1
    assert {f.classes["kv_cache"] // f.bytes_per_block for f in staged.stages} == {
        staged.kv.num_blocks}
    first, last = staged.stages
    assert first.required_bytes < last.required_bytes == staged.required_bytes
    assert last.limit_bytes - last.required_bytes < staged.kv.bytes_per_block  # its pool
    assert first.limit_bytes - first.required_bytes > first.bytes_per_block  # room unused


def test_deepseek_v3_in_four_stages_keeps_every_tensor_once():
    weights = weights_of("DeepSeek-V3")
    shape = model_shape(published_config("DeepSeek-V3"))
    bounds = stage_bounds(shape.num_layers, 4, env={})
    assert [end - start for start, end in bounds] == [15, 15, 16, 15]
    parts = [stage_weights(weights, bounds, s, tied=False) for s in range(4)]
    assert sum(p.total_bytes for p in parts) == weights.total_bytes
    staged = make_plan(EngineConfig(model="x", device_memory_bytes=141 * GiB,
                                    max_model_len=8192, max_num_seqs=8,
                                    tensor_parallel_size=8, pipeline_parallel_size=4),
                       shape=shape, weights=weights)
    assert [len(s.classes) for s in staged.stages] == [6] * 4
    assert staged.stages[0].classes["kv_cache"] < staged.stages[2].classes["kv_cache"]


def test_a_vision_tower_goes_to_the_first_stage_with_its_own_layer_numbers():
    """Gemma 3 27B's checkpoint (text and vision): the encoder's layers are numbered on their
    own; vLLM runs the encoder on the first stage, so every vision tensor is stage 1's."""
    weights = weights_of("gemma-3-27b")
    shape = model_shape(published_config("gemma-3-27b"))
    bounds = stage_bounds(shape.num_layers, 2, env={})
    parts = [stage_weights(weights, bounds, s, shape.tie_word_embeddings) for s in range(2)]
    vision = [t.name for t in weights.tensors if "vision_tower." in t.name]
    assert vision and all(n in {t.name for t in parts[0].tensors} for n in vision)
    assert not any("vision_tower." in t.name for t in parts[1].tensors)
