"""A hostile config.json against the planner: refused in one line, or planned, quickly.

A tenant names any hub repo (or model folder) in an InferenceService; the operator and the
``kvledger plan`` / ``preflight`` init container read its config.json (and safetensors
headers) and plan memory from them before anything is loaded. Whatever config.json says,
``read_checkpoint`` + ``make_plan`` must end in ``BadInput`` or in a ``Plan`` whose byte
figures are non-negative integers and which ``kvledger plan`` can print (text and JSON),
within ``TIME_LIMIT_S`` and ``MEMORY_LIMIT_BYTES``: never another exception, a hang, or
memory that grows with a number the file states.

The configs mutated are real ones, written by transformers' ``save_pretrained`` for tiny
random models of the architectures kvledger plans (once per module, weights included);
each example rewrites only config.json. ``KVLEDGER_FUZZ_EXAMPLES=N`` hunts with N examples
per fuzz test and shrinks what fails (off by default to keep a failing run short).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _budget import Budget
from _tiny_models import ENGINE_MODELS, MODELS, TINY, save_tiny
from budget_checkpoints import write_header_only
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvledger.engine.checkpoint.contents import read_weights
from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.cli import main
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.plan import make_plan, read_checkpoint
from kvledger.engine.planner.pool import ENGINE_RULE, VLLM_RULE
from kvledger.engine.planner.record import Plan
from kvledger.engine.planner.report import render_report
from kvledger.engine.settings.config import EngineConfig

GiB = 2**30
MiB = 2**20
TIME_LIMIT_S = 2.0  # what one config may cost the planner (tiny weights: ~10 ms)
HARD_STOP_S = 2.5  # where the alarm stops a runaway example (it would grow memory for minutes)
ALARM_REPEAT_S = 0.25  # and again, until it has stopped
MEMORY_LIMIT_BYTES = 200 * MiB  # traced peak; a published model's metadata needs far less
MESSAGE_LIMIT_CHARS = 64 * 1024  # a "one-line refusal" nobody could read is not one

_HUNT = int(os.environ.get("KVLEDGER_FUZZ_EXAMPLES", "0"))
FUZZ_SETTINGS = settings(
    max_examples=_HUNT or 200, deadline=None, derandomize=not _HUNT,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=tuple(Phase) if _HUNT else (Phase.explicit, Phase.reuse, Phase.generate))

# --- the checkpoints: tiny random models, as transformers writes them --------------------

GEMMA3_MULTIMODAL = "gemma3mm"  # Gemma3ForConditionalGeneration: the text model nested
NAMES = (*MODELS, GEMMA3_MULTIMODAL)


class Checkpoint:
    """A written checkpoint and its config.json as transformers wrote it (a plain class:
    Hypothesis prints a failing example's fixtures, a dataclass field by field)."""

    def __init__(self, path: Path, config: dict[str, Any]) -> None:
        self.path, self.config = path, config

    def __repr__(self) -> str:
        return f"Checkpoint({self.path.name})"

    def write(self, config: dict[str, Any] | str) -> None:
        """config.json replaced (a dict is dumped as json does: NaN and Infinity raw)."""
        text = config if isinstance(config, str) else json.dumps(config)
        (self.path / "config.json").write_text(text)


def _write_checkpoints(root: Path) -> dict[str, Checkpoint]:
    import transformers

    written = {}
    for name in MODELS:
        save_tiny(name, root / name)
    text = transformers.Gemma3TextConfig(**{**TINY, "head_dim": 8})
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    multimodal = transformers.Gemma3Config(text_config=text, vision_config=vision)
    multimodal.architectures = ["Gemma3ForConditionalGeneration"]
    multimodal.save_pretrained(root / GEMMA3_MULTIMODAL)
    shutil.copy(root / "gemma3" / "model.safetensors", root / GEMMA3_MULTIMODAL)
    for name in NAMES:
        path = root / name
        written[name] = Checkpoint(path, json.loads((path / "config.json").read_text()))
    return written


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    return _write_checkpoints(tmp_path_factory.mktemp("hostile"))


# --- planning one config within a budget ---------------------------------------------------

GPU_80 = DeviceMemory("what-if", "H100", 80 * GiB, 80 * GiB, False)
DEVICES = (GPU_80,
           DeviceMemory("what-if", "small", 1 * GiB, 1 * GiB, False),  # refusals, remedies
           DeviceMemory("cpu", "host", 16 * GiB, 12 * GiB, False),
           DeviceMemory("what-if", "GB10", 128 * GiB, 120 * GiB, True))
FLAGS = ({}, {"memory_limit_bytes": 2 * GiB}, {"gpu_memory_utilization": 0.5},
         {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"enable_lora": True},
         {"max_model_len": 64}, {"kv_cache_dtype": "fp8"}, {"quantization": "fp8"},
         {"max_num_seqs": 4, "enforce_eager": True}, {"dtype": "float16"})


def plan_checkpoint(checkpoint: Checkpoint, device: DeviceMemory = GPU_80,
                    **flags: Any) -> tuple[Plan | BadInput, Budget]:
    """What ``kvledger plan`` does with the checkpoint as it now is: read it, plan it,
    print the plan as text and as JSON. BadInput is returned; anything else raised."""
    with Budget(HARD_STOP_S, ALARM_REPEAT_S) as spent:
        try:
            shape, weights = read_checkpoint(str(checkpoint.path))
            plan = make_plan(EngineConfig(model=str(checkpoint.path), **flags), device=device,
                             shape=shape, weights=weights)
            render_report(plan)
            json.dumps(plan.to_json())
        except BadInput as exc:
            return exc, spent
    return plan, spent


def _byte_figures(plan: Plan) -> dict[str, Any]:
    """Every byte, block, token and sequence count of ``plan`` (its stages' and remedies'
    too), by name."""
    kv = plan.kv
    figures = {"limit_bytes": plan.limit_bytes, "required_bytes": plan.required_bytes,
               "short_by_bytes": plan.short_by_bytes, "margin_bytes": plan.margin_bytes,
               "kv.num_blocks": kv.num_blocks, "kv.required_blocks": kv.required_blocks,
               "kv.bytes_per_block": kv.bytes_per_block, "kv.bytes_per_token": kv.bytes_per_token,
               "kv.bytes_per_seq": kv.bytes_per_seq, "kv.blocks_per_seq": kv.blocks_per_seq,
               "kv.sequences": kv.sequences, "max_model_len": plan.max_model_len,
               "max_num_batched_tokens": plan.max_num_batched_tokens,
               "max_num_seqs": plan.max_num_seqs, "weights.total_bytes": plan.weights.total_bytes}
    figures |= {f"classes.{name}": size for name, size in plan.classes.items()}
    for stage in plan.stages:
        figures |= {f"stage{stage.stage}.required_bytes": stage.required_bytes,
                    f"stage{stage.stage}.limit_bytes": stage.limit_bytes}
    figures |= {f"remedy {r.flag}.kv_bytes": r.kv_bytes for r in plan.remedies}
    return figures


def assert_refused_or_planned(result: Plan | BadInput, spent: Budget) -> None:
    """BadInput in one readable line, or a plan of non-negative integer bytes that adds up;
    either within the time and memory limits."""
    assert spent.seconds < TIME_LIMIT_S, f"took {spent.seconds:.2f} s"
    assert spent.peak_bytes < MEMORY_LIMIT_BYTES, f"peak {spent.peak_bytes / MiB:.0f} MiB"
    if isinstance(result, BadInput):
        message = str(result)
        assert message and "\n" not in message, f"refusal not one line: {message[:200]!r}"
        assert len(message) <= MESSAGE_LIMIT_CHARS, f"refusal of {len(message)} chars"
        return
    for name, value in _byte_figures(result).items():
        assert type(value) is int and value >= 0, f"{name} = {value!r}"
    assert result.required_bytes == sum(result.classes.values())
    if result.fits:
        assert result.required_bytes <= result.limit_bytes
        assert result.max_model_len >= 1 and result.kv.blocks_per_seq >= 1


def check(checkpoint: Checkpoint, config: dict[str, Any] | str,
          device: DeviceMemory = GPU_80, **flags: Any) -> Plan | BadInput:
    """``config`` written in ``checkpoint``, planned, and held to the contract."""
    checkpoint.write(config)
    result, spent = plan_checkpoint(checkpoint, device, **flags)
    assert_refused_or_planned(result, spent)
    return result


# --- sanity: the unmutated configs plan, so the fuzz cannot pass by refusing everything -----

@pytest.mark.parametrize("name", NAMES)
def test_configs_as_transformers_writes_them_plan_and_fit(checkpoints, name) -> None:
    """Each real config plans within the contract and fits an 80 GiB card, by the engine's
    rule for the architectures kvledger's engine runs and by vLLM's for the others: the
    fuzz starts from configs that plan, so it cannot pass by refusing everything."""
    checkpoint = checkpoints[name]
    plan = check(checkpoint, checkpoint.config)
    assert isinstance(plan, Plan) and plan.fits
    served = (*ENGINE_MODELS, GEMMA3_MULTIMODAL)  # Gemma 3's language model, as text
    assert plan.kv.rule == (ENGINE_RULE if name in served else VLLM_RULE)


@pytest.mark.parametrize("name", ["gemma2", "gptoss"])
def test_hybrid_model_over_pipeline_stages_fits_and_prints(checkpoints, name) -> None:
    """A sliding+full model over two stages (a sliding layer on one, a full one on the
    other), no cap: each stage's pool holds the workload, so a 2-layer model fits an
    80 GiB card, and the report prints. Today ``staged`` cuts every stage's pool to the
    fewest blocks any stage needs (the full stage's), the sliding stage is a block a
    sequence short ("does not fit", short by 0 bytes), and ``render_report`` raises
    TypeError in ``_explicit_pool`` (no --kv-cache-memory-bytes was given)."""
    checkpoint = checkpoints[name]
    plan = check(checkpoint, checkpoint.config, pipeline_parallel_size=2)
    assert isinstance(plan, Plan) and plan.fits


# --- the fuzz ------------------------------------------------------------------------------

DELETE = object()  # a mutation that removes the key
TOP_KEYS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "max_position_embeddings", "torch_dtype", "dtype", "tie_word_embeddings", "rms_norm_eps",
    "rope_theta", "rope_parameters", "rope_scaling", "hidden_act", "attention_bias",
    "mlp_bias", "quantization_config", "layer_types", "sliding_window", "use_sliding_window",
    "max_window_layers", "sliding_window_pattern", "_sliding_window_pattern", "num_experts",
    "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "kv_lora_rank", "q_lora_rank",
    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
    "n_shared_experts", "first_k_dense_replace", "scoring_func", "topk_method", "n_group",
    "topk_group", "routed_scaling_factor", "shared_expert_intermediate_size", "text_config")
ROPE_KEYS = ("rope_type", "type", "rope_theta", "factor", "low_freq_factor",
             "high_freq_factor", "original_max_position_embeddings", "full_attention",
             "sliding_attention")
QUANT_KEYS = ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format",
              "lm_head", "version", "zero_point", "format", "config_groups", "kv_cache_scheme",
              "weight_block_size", "activation_scheme", "fmt", "w_bit", "q_group_size")
CONTAINERS = {"": TOP_KEYS, "text_config": TOP_KEYS, "rope_parameters": ROPE_KEYS,
              "rope_scaling": ROPE_KEYS, "quantization_config": QUANT_KEYS}

# Huge numbers that fail fast if they fail (none between 2**31 and 2**39: a tuple of that
# many layers is gigabytes, allocated in one C call no alarm can stop).
HUGE_INTS = (4096, 10**5, 2**40, 10**18, 2**63 - 1, 2**63, 2**64, -(2**63), 10**400)
WORDS = ("", "auto", "bfloat16", "float16", "float32", "float64", "int8", "fp8",
         "float8_e4m3fn", "full_attention", "sliding_attention", "chunked_attention",
         "default", "llama3", "linear", "yarn", "dynamic", "static", "gptq", "awq",
         "compressed-tensors", "float-quantized", "pack-quantized", "mxfp4", "bitsandbytes",
         "silu", "gelu", "e4m3", "gemm", "LlamaForCausalLM", "Qwen3MoeForCausalLM",
         "MixtralForCausalLM", "DeepseekV3ForCausalLM", "Gemma2ForCausalLM",
         "Gemma3ForConditionalGeneration", "FooForCausalLM", "llama", "qwen3_moe",
         "gemma3_text", "NaN", "1e999")
STRUCTURED = (
    ["LlamaForCausalLM"], ["Gemma2ForCausalLM", "LlamaForCausalLM"], [["LlamaForCausalLM"]],
    [None], [{"a": 1}], [5, "Qwen2ForCausalLM"],
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 4.0}, {"type": "linear", "factor": 2.0},
    {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    {"quant_method": "fp8"}, {"quant_method": "fp8", "weight_block_size": [128, 128]},
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
    {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
    {"quant_method": "compressed-tensors", "format": "float-quantized",
     "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                         "strategy": "tensor"}}}},
    {"quant_method": "compressed-tensors", "format": "pack-quantized",
     "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                         "strategy": "group", "group_size": 32}}}},
    {"quant_method": "mxfp4"}, {"quant_method": None}, {},
    ["sliding_attention", "full_attention"], ["full_attention"] * 3,
    ["chunked_attention", "full_attention"], ["sliding_attention"] * 4096,
)
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2, 9), st.sampled_from(HUGE_INTS),
                     st.floats(), st.sampled_from(WORDS), st.text(max_size=8))
_values = st.one_of(
    st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(ROPE_KEYS + QUANT_KEYS) | st.text(max_size=4), inner, max_size=4),
        max_leaves=8),
    st.sampled_from(STRUCTURED))


@st.composite
def mutations(draw) -> tuple[str, str, Any]:
    """(container, key, value or DELETE): a key of config.json, or of the object nested
    under ``container``, replaced or deleted."""
    container = draw(st.sampled_from(sorted(CONTAINERS)))
    key = draw(st.sampled_from(CONTAINERS[container]))
    return container, key, draw(st.just(DELETE) | _values)


def mutate(config: dict[str, Any], container: str, key: str, value: Any) -> None:
    target = config
    if container:
        if not isinstance(config.get(container), dict):
            config[container] = {}
        target = config[container]
    if value is DELETE:
        target.pop(key, None)
    else:  # a copy: a later change nested in it must not change STRUCTURED's
        target[key] = copy.deepcopy(value)


def nested(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as a multimodal checkpoint lays it out: the text model's fields under
    ``text_config``, the architecture (and the keys kept with it) at the top."""
    return {"architectures": config.get("architectures"), "model_type": "wrapper",
            "text_config": {k: v for k, v in config.items() if k != "architectures"}}


@FUZZ_SETTINGS
@given(name=st.sampled_from(NAMES), wrap=st.booleans(),
       changes=st.lists(mutations(), min_size=1, max_size=4),
       device=st.sampled_from(DEVICES), flags=st.sampled_from(FLAGS))
def test_hostile_config_is_refused_or_planned(checkpoints, name, wrap, changes, device,
                                              flags) -> None:
    """Any real config with up to four keys (top-level or nested: text_config, RoPE,
    quantization) replaced by hostile values or deleted, optionally nested as a multimodal
    config, under any flag set and device: BadInput in one line, or a sane plan that
    prints, within the time and memory limits."""
    checkpoint = checkpoints[name]
    config = copy.deepcopy(checkpoint.config)
    if wrap and "text_config" not in config:
        config = nested(config)
    for change in changes:
        mutate(config, *change)
    check(checkpoint, config, device, **flags)


_NUMBER_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "rms_norm_eps", "sliding_window", "kv_lora_rank", "qk_rope_head_dim",
                "num_experts", "num_local_experts", "num_experts_per_tok")
_TOKENS = ("NaN", "Infinity", "-Infinity", "1e999", "-0", "0.0", "1E400", "-1", "1.5",
           "9" * 40, "1" + "0" * 1000, "true", "null", '"32"', "[]", "{}")


@FUZZ_SETTINGS
@given(name=st.sampled_from(NAMES), key=st.sampled_from(_NUMBER_KEYS),
       token=st.sampled_from(_TOKENS), flags=st.sampled_from(FLAGS))
def test_hostile_number_text_is_refused_or_planned(checkpoints, name, key, token,
                                                   flags) -> None:
    """A number of config.json written as any JSON token Python's parser takes (NaN and
    Infinity raw, overflowing exponents, a thousand digits, strings, containers): refused
    in one line or planned, within the limits."""
    checkpoint = checkpoints[name]
    config = copy.deepcopy(checkpoint.config)
    target = config.get("text_config", config)
    target[key] = "@@"
    check(checkpoint, json.dumps(config).replace('"@@"', token), GPU_80, **flags)


# --- what the fuzz found: each a plain test that fails until it is fixed -------------------

def _set(**changes: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def apply(config: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(config)
        for key, value in changes.items():
            mutate(out, "", key, value)
        return out
    return apply


def _in_text_config(**changes: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def apply(config: dict[str, Any]) -> dict[str, Any]:
        out = nested(config) if "text_config" not in config else copy.deepcopy(config)
        out["text_config"].update(changes)
        return out
    return apply


FINDINGS = [
    # TypeError: unhashable model_type, in hf_config.text_config (CONFIG_DEFAULTS.get).
    pytest.param("llama", _set(model_type=[]), id="model_type-list"),
    pytest.param(GEMMA3_MULTIMODAL, _in_text_config(model_type={"a": 1}),
                 id="text_config-model_type-dict"),
    # TypeError: a nested text_config's architectures, in ModelConfig.from_dict (the top
    # level's passed pick_architecture).
    pytest.param("llama", _in_text_config(architectures=5), id="text_config-architectures-int"),
    pytest.param("llama", _in_text_config(architectures=[{"a": 1}]),
                 id="text_config-architectures-dict"),
    pytest.param("llama", _in_text_config(architectures=[5]), id="text_config-architectures-5"),
    # ValueError / TypeError: dict() of a RoPE field that is not an object, in from_dict.
    pytest.param("llama", _set(rope_parameters="yarn"), id="rope_parameters-string"),
    pytest.param("qwen2", _set(rope_parameters=5), id="rope_parameters-int"),
    pytest.param("mistral", _set(rope_parameters=DELETE, rope_scaling=[1]),
                 id="rope_scaling-list"),
    # OverflowError: float() of an integer past float range, in _positive_float.
    pytest.param("llama", _set(rope_parameters={"rope_type": "default", "rope_theta": 10**400}),
                 id="rope_theta-1e400-int"),
    pytest.param("qwen3", _set(rms_norm_eps=10**400), id="rms_norm_eps-1e400-int"),
    # OverflowError / MemoryError: a tuple of num_hidden_layers, in hf_config._layer_types.
    pytest.param("llama", _set(num_hidden_layers=2**63), id="num_hidden_layers-2**63"),
    pytest.param("deepseekv3", _set(num_hidden_layers=10**18), id="num_hidden_layers-1e18"),
    # Work and memory that grow with a number: every layer's and expert's tensor names
    # (loadable.tensor_names), every layer's LayerKV; a remedy's binary search over a
    # context of thousands of digits; mlp_only_layers scanned once per layer.
    pytest.param("llama", _set(num_hidden_layers=10**6), id="num_hidden_layers-1e6-slow"),
    pytest.param("mixtral", _set(num_local_experts=10**6), id="num_local_experts-1e6-slow"),
    pytest.param("qwen3moe", _set(num_experts=10**6), id="num_experts-1e6-slow"),
    pytest.param("gemma2", _set(max_position_embeddings=10**4299, num_hidden_layers=128,
                                layer_types=DELETE), id="max_position_embeddings-4300-digits-slow"),
    pytest.param("qwen3moe", _set(num_hidden_layers=2000, mlp_only_layers=list(range(-50000, 0))),
                 id="mlp_only_layers-quadratic"),
    # A plan that cannot be printed: format_size's float division overflows (the text
    # report), int -> str past 4,300 digits (the JSON).
    pytest.param("llama", _set(vocab_size=10**4299), id="vocab_size-4300-digits-unprintable"),
    pytest.param("gemma2", _set(hidden_size=10**400, intermediate_size=10**400),
                 id="hidden_size-1e400-unprintable"),
    # config.json is read whole, however large (the hub's reads stop at 1 MiB), and a
    # refusal repeats the whole value it refuses.
    pytest.param("llama", _set(junk=[{}] * 2_000_000), id="config-8MB-of-objects-read-whole"),
    pytest.param("gemma2", _set(layer_types=["sliding_attention"] * 100_000),
                 id="layer_types-100k-repeated-in-refusal"),
]


@pytest.mark.parametrize(("name", "hostile"), FINDINGS)
def test_found_config_is_refused_or_planned(checkpoints, name, hostile) -> None:
    """Each config the fuzz (or reading the code) found that breaks the contract today:
    it must end in BadInput or a sane plan, within the limits, like any other."""
    checkpoint = checkpoints[name]
    check(checkpoint, hostile(checkpoint.config))


def test_layers_beyond_the_checkpoint_are_refused(checkpoints) -> None:
    """A config that declares more decoder layers than the checkpoint stores: the engine
    refuses it at load ("missing" tensors), so the plan (pre-flight) must refuse it too
    rather than say it fits (``loadable_config`` checks unexpected tensors, not missing
    ones); and the layers' count then costs nothing past the tensors read."""
    checkpoint = checkpoints["llama"]
    result = check(checkpoint, _set(num_hidden_layers=64)(checkpoint.config))
    assert isinstance(result, BadInput), "planned 64 layers of a 2-layer checkpoint"


def test_fused_experts_header_of_a_million_experts_is_refused_quickly(checkpoints,
                                                                      tmp_path) -> None:
    """The same threat through a safetensors header: transformers 5's fused experts
    (``mlp.experts.gate_up_proj`` ``[experts, 2 * inter, hidden]``) claiming a million
    experts where config.json has four. Today ``loadable.loaded_names`` names every expert
    the shape claims (two million names a layer) before refusing; it must refuse (the
    loader could not split it into the config's experts) without that work."""
    base = checkpoints["qwen3moe"]
    base.write(base.config)  # as written: an earlier test may have left another
    weights = read_weights(base.path)
    tensors = {t.name: (t.dtype, list(t.shape)) for t in weights.tensors
               if ".experts." not in t.name}
    for layer in range(base.config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts."
        tensors[prefix + "gate_up_proj"] = ("BF16", [10**6, 32, 32])
        tensors[prefix + "down_proj"] = ("BF16", [10**6, 32, 16])
    write_header_only(tmp_path, base.config, tensors)
    check(Checkpoint(tmp_path, base.config), base.config)


def test_qwen3_moe_saved_by_transformers_5_has_its_experts(checkpoints) -> None:
    """transformers 5 writes Qwen3-MoE's expert count as ``num_local_experts``
    (``num_experts`` is an alias): read as written, not as Qwen3MoeConfig's default 128,
    which the engine would build and then refuse at load for the experts it lacks."""
    checkpoint = checkpoints["qwen3moe"]
    assert "num_experts" not in checkpoint.config
    moe = ModelConfig.from_dict(checkpoint.config).moe
    assert moe is not None and moe.num_experts == checkpoint.config["num_local_experts"]


# --- kvledger plan end to end: exit 2, one error line, no traceback ------------------------

CLI_CASES = [
    pytest.param("llama", _set(architectures=["FooForCausalLM"]), id="unknown-architecture"),
    pytest.param("qwen2", _set(hidden_size=float("nan")), id="hidden_size-NaN"),
    pytest.param("llama", _in_text_config(architectures=5), id="text_config-architectures-int"),
    pytest.param("llama", _set(rope_parameters="yarn"), id="rope_parameters-string"),
    pytest.param("qwen3", _set(rms_norm_eps=10**400), id="rms_norm_eps-1e400-int"),
    pytest.param("llama", _set(num_hidden_layers=2**63), id="num_hidden_layers-2**63"),
    pytest.param("llama", _set(vocab_size=10**4299), id="vocab_size-4300-digits"),
]


@pytest.mark.parametrize(("name", "hostile"), CLI_CASES)
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_kvledger_plan_refuses_a_hostile_config_in_one_line(checkpoints, capsys, name, hostile,
                                                            as_json) -> None:
    """``kvledger plan --model DIR`` on a hostile config.json exits 2 with one ``error:``
    line on stderr and nothing on stdout, never a traceback."""
    checkpoint = checkpoints[name]
    checkpoint.write(hostile(checkpoint.config))
    argv = ["plan", "--model", str(checkpoint.path), "--device-memory", "24GiB"]
    try:
        with Budget(HARD_STOP_S, ALARM_REPEAT_S):
            rc = main([*argv, "--json"] if as_json else argv)
    except Exception as exc:
        pytest.fail(f"kvledger plan raised {type(exc).__name__}: {str(exc)[:200]}")
    captured = capsys.readouterr()
    assert rc == 2, f"exit {rc}: {captured.err[:200]!r}"
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
