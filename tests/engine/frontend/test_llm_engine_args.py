"""``LLM(model, **engine_args)`` with vLLM 0.32's engine-argument names, as offline scripts
pass them: each reads as ``kvledger serve`` reads its flag (settings/llm_args.py). An
implemented name builds the config the flag builds, a no-op name builds the config of no
flag at all, a refused name is BadInput with the flag's own line, and a flag of the HTTP
server's is BadInput saying it is ``kvledger serve``'s."""

from __future__ import annotations

import pytest

from kvledger.engine import LLM, SamplingParams
from kvledger.engine.cli import build_parser, main
from kvledger.engine.errors import BadInput, EngineSleeping
from kvledger.engine.settings.config_flags import config_from_args
from kvledger.engine.settings.launch_line import flag_arguments, vllm_argv

BASE = {"device": "cpu", "max_model_len": 128}
BASE_FLAGS = ["--device", "cpu", "--max-model-len", "128"]

# name, value, the `kvledger serve` flags it is.
WORKS = [
    ("max_num_batched_tokens", 256, ["--max-num-batched-tokens", "256"]),
    ("max_num_seqs", 4, ["--max-num-seqs", "4"]),
    ("enforce_eager", True, ["--enforce-eager"]),
    ("enable_prefix_caching", False, ["--no-enable-prefix-caching"]),
    ("seed", 7, ["--seed", "7"]),
    ("dtype", "float32", ["--dtype", "float32"]),
    ("kv_cache_memory_bytes", 2**20, ["--kv-cache-memory-bytes", "1048576"]),
    ("num_gpu_blocks_override", 16, ["--num-gpu-blocks-override", "16"]),
    ("served_model_name", "m", ["--served-model-name", "m"]),
    ("scheduling_policy", "priority", ["--scheduling-policy", "priority"]),
    ("enable_lora", True, ["--enable-lora"]),
    ("override_generation_config", {"temperature": 0.5},
     ["--override-generation-config", '{"temperature": 0.5}']),
    ("kv_events_config", {"enable_kv_cache_events": False},
     ["--kv-events-config", '{"enable_kv_cache_events": false}']),
    ("compilation_config", {"cudagraph_mode": "NONE"},
     ["--compilation-config", '{"cudagraph_mode": "NONE"}']),  # read: --enforce-eager
    ("optimization_level", 0, ["-O0"]),                         # read: --enforce-eager
    ("memory_limit_bytes", 2**30, ["--memory-limit", "1073741824"]),  # kvledger's field name
]
# name, value: accepted, and the config is the one no flag gives.
NO_OPS = [
    ("trust_remote_code", True), ("trust_remote_code", False), ("disable_log_stats", True),
    ("tokenizer_mode", "auto"), ("swap_space", 4), ("enable_chunked_prefill", True),
    ("compilation_config", 0), ("compilation_config", 3), ("load_format", "auto"),
    ("runner", "generate"), ("convert", "auto"), ("disable_custom_all_reduce", True),
    ("cpu_offload_gb", 0), ("data_parallel_size", 1), ("distributed_executor_backend", "mp"),
    ("model_impl", "auto"), ("use_tqdm_on_load", False), ("allowed_local_media_path", ""),
    ("compilation_config", {"mode": 3, "backend": "inductor"}), ("quantization", None),
    ("enable_expert_parallel", False), ("limit_mm_per_prompt", {"image": 0}),
    ("enable_prompt_embeds", False), ("async_scheduling", True),
]
# name, value, what the one line says.
REFUSED = [
    ("hf_overrides", {"rope_theta": 1.0}, "overriding config.json's fields"),
    ("kv_transfer_config", {"kv_connector": "X"}, "moving KV caches between instances"),
    ("data_parallel_size", 2, "data parallelism"),
    ("distributed_executor_backend", "ray", "ray executor"),
    ("speculative_config", {"method": "ngram"}, "speculative decoding"),
    ("enable_expert_parallel", True, "expert parallelism"),
    ("limit_mm_per_prompt", {"image": 1}, "multimodal inputs"),
    ("enable_chunked_prefill", False, "turning chunked prefill off"),
    ("load_format", "pt", "vLLM's other weight formats"),
    ("tokenizer_mode", "mistral", "vLLM's other tokenizer modes"),
    ("logits_processors", ["pkg.Proc"], "logits processors of your own"),
    ("compilation_config", {"no_such_key": 1}, "has no key"),
    ("skip_tokenizer_init", True, "serving without a tokenizer"),
]
SERVE_ONLY = [("api_key", "k"), ("port", 8000), ("host", "0.0.0.0"), ("nnodes", 2),
              ("reasoning_parser", "deepseek_r1"), ("max_logprobs", 5),
              ("enable_log_requests", True), ("api_keys", ["k"])]


def _serve_config(model: str, flags: list[str]):
    """The engine config `kvledger serve MODEL FLAGS` runs."""
    parser = build_parser("serve")
    return config_from_args(parser.parse_args(vllm_argv([model, *flags], parser)))


@pytest.mark.parametrize(("name", "value", "flags"), WORKS, ids=[r[0] for r in WORKS])
def test_an_implemented_name_does_what_its_flag_does(tiny_llama_dir, name, value, flags) -> None:
    llm = LLM(str(tiny_llama_dir), **BASE, **{name: value})
    expected = _serve_config(str(tiny_llama_dir), [*BASE_FLAGS, *flags])
    assert llm.engine.config == expected
    assert expected != _serve_config(str(tiny_llama_dir), BASE_FLAGS)  # it changed something


@pytest.mark.parametrize(("name", "value"), NO_OPS, ids=[f"{n}={v}" for n, v in NO_OPS])
def test_a_no_op_name_is_accepted_and_changes_nothing(tiny_llama_dir, name, value) -> None:
    llm = LLM(str(tiny_llama_dir), **BASE, **{name: value})
    assert llm.engine.config == _serve_config(str(tiny_llama_dir), BASE_FLAGS)


@pytest.mark.parametrize(("name", "value", "why"), REFUSED, ids=[f"{n}={v}" for n, v, _ in REFUSED])
def test_a_refused_name_is_the_flags_one_line(tiny_llama_dir, capsys, name, value, why) -> None:
    with pytest.raises(BadInput, match=why) as caught:
        LLM(str(tiny_llama_dir), **BASE, **{name: value})
    message = str(caught.value)
    assert "\n" not in message and message.startswith("LLM: ")
    # The same line `kvledger plan` ends in for the flag: one owner of the rule.
    parser = build_parser("plan")
    assert main(["plan", str(tiny_llama_dir),
                 *flag_arguments("--" + name.replace("_", "-"), value, parser)]) == 2
    assert capsys.readouterr().err == f"error: {message.removeprefix('LLM: ')}\n"


@pytest.mark.parametrize(("name", "value"), SERVE_ONLY, ids=[n for n, _ in SERVE_ONLY])
def test_a_flag_of_the_server_belongs_to_kvledger_serve(tiny_llama_dir, name, value) -> None:
    with pytest.raises(BadInput, match="a flag of `kvledger serve`") as caught:
        LLM(str(tiny_llama_dir), **BASE, **{name: value})
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", ["task", "no_such_argument", "max_num_partial_prefills"])
def test_a_name_that_is_no_engine_argument_is_refused_by_name(tiny_llama_dir, name) -> None:
    with pytest.raises(BadInput, match=f"unknown engine argument '{name}'"):
        LLM(str(tiny_llama_dir), **BASE, **{name: 1})


def test_a_token_is_never_echoed(tiny_llama_dir) -> None:
    with pytest.raises(BadInput, match=r"set \$HF_TOKEN") as caught:
        LLM(str(tiny_llama_dir), **BASE, hf_token="hf_secret_value")
    assert "hf_secret_value" not in str(caught.value)


def test_a_vllm_offline_script_runs(tiny_llama_dir) -> None:
    """The arguments vLLM's offline examples pass, at once; greedy output as without them."""
    script = {"trust_remote_code": True, "disable_log_stats": True, "tokenizer_mode": "auto",
              "swap_space": 4, "enable_chunked_prefill": True, "compilation_config": 0,
              "load_format": "auto", "runner": "generate", "max_num_batched_tokens": 128,
              "seed": 0, "disable_custom_all_reduce": True,
              "enforce_eager": True, "hf_token": None, "revision": None, "tokenizer": None}
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = LLM(str(tiny_llama_dir), **BASE).generate("The river", greedy, use_tqdm=False)
    ported = LLM(str(tiny_llama_dir), **BASE, **script).generate("The river", greedy,
                                                                 use_tqdm=False)
    assert list(ported[0].token_ids) == list(plain[0].token_ids)


def test_chat_template_is_chats_default(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), **BASE, chat_template="{% for m in messages %}<<{{ "
              "m['content'] }}>>{% endfor %}")
    out = llm.chat([{"role": "user", "content": "hi"}],
                   SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert out[0].prompt == "<<hi>>"
    with pytest.raises(BadInput, match="--chat-template"):
        LLM(str(tiny_llama_dir), **BASE, chat_template="{% for %}")


def test_sleep_and_wake_up_offline(tiny_llama_dir) -> None:
    """vLLM's ``LLM.sleep``/``wake_up``/``reset_prefix_cache``, the server's sleep behind
    them: asleep, generate is refused; awake, it answers as before, at either level."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), **BASE, enable_sleep_mode=True)
    before = list(llm.generate("The river", greedy, use_tqdm=False)[0].token_ids)
    assert llm.reset_prefix_cache() is True
    for level in (1, 2):
        llm.sleep(level=level)
        with pytest.raises(EngineSleeping):
            llm.generate("The river", greedy, use_tqdm=False)
        assert llm.wake_up(tags=["weights"]) is False  # the KV pool is still asleep
        assert llm.wake_up() is True
        assert list(llm.generate("The river", greedy, use_tqdm=False)[0].token_ids) == before
    with pytest.raises(BadInput, match="sleep levels"):
        llm.sleep(level=3)
    with pytest.raises(BadInput, match="enable_sleep_mode=True"):
        LLM(str(tiny_llama_dir), **BASE).sleep()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"compilation_config": True}, "LLM: argument --compilation-config/-cc: expected 1 argument"),
    ({"compilation_config": 7}, "compilation modes are 0, 1, 2 and 3"),
    ({"max_model_len": "1k"}, "LLM: --max-model-len must be a positive integer, got '1k'"),
    ({"config": "flags.yaml"}, "pass its keys as keyword arguments"),
])
def test_a_bad_value_is_one_line(tiny_llama_dir, kwargs, message) -> None:
    with pytest.raises(BadInput) as caught:
        LLM(str(tiny_llama_dir), device="cpu", **kwargs)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert not str(caught.value).startswith("LLM: LLM")
