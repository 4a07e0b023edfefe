"""vLLM launch lines port as they are: each is planned (exit 0) or refused by name (exit 2,
one line naming the flag), never argparse's ``unrecognized arguments`` (issue 23).

The corpus is ``vllm serve`` lines from vLLM's docs and recipes, the hub model id
replaced by a checkpoint the tests write (no network) and ``--device cpu`` added so the
plan runs on this machine; context lengths are cut to the small model's 1024 and
tensor-parallel sizes to its 4 attention heads.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from kvledger.engine.cli import build_parser, main
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config_flags import config_from_args
from kvledger.engine.settings.launch_line import vllm_argv
from kvledger.engine.settings.vllm_flags import VLLM_SERVE_FLAGS

ACCEPTED = None
# (where the line comes from, the line after `vllm serve`, the flag it is refused by or None)
LAUNCH_LINES = [
    ("quickstart", "{model}", ACCEPTED),
    ("quickstart: OpenAI-compatible server",
     "{model} --dtype auto --api-key token-abc123", ACCEPTED),
    ("serve --model form", "--model {model} --trust-remote-code", ACCEPTED),
    ("engine args", "{model} --host 0.0.0.0 --port 8000 --max-num-seqs 256 "
     "--uvicorn-log-level warning", ACCEPTED),
    ("optimization: chunked prefill",
     "{model} --enable-chunked-prefill --max-num-batched-tokens 2048", ACCEPTED),
    ("memory: max-model-len",
     "{model} --gpu-memory-utilization 0.9 --max-model-len 1024", ACCEPTED),
    ("human-readable counts", "{model} --max-model-len 1K --max-num-batched-tokens 2k",
     ACCEPTED),
    ("older recipes", "{model} --swap-space 16 --disable-log-requests", ACCEPTED),
    ("prefix caching", "{model} --enable-prefix-caching --disable-log-stats", ACCEPTED),
    ("served model name", "{model} --served-model-name llama --enforce-eager --seed 0 "
     "--block-size 16", ACCEPTED),
    ("distributed serving, one GPU",
     "{model} --tensor-parallel-size 1 --pipeline-parallel-size 1 -dp 1", ACCEPTED),
    ("recipes: trust remote code", "{model} --trust-remote-code --max-model-len 1024 "
     "--dtype bfloat16 --disable-uvicorn-access-log", ACCEPTED),
    ("distributed serving", "{model} --tensor-parallel-size 4", ACCEPTED),
    ("distributed serving: pipeline (planned per stage)",
     "{model} --pipeline-parallel-size 2", ACCEPTED),
    ("distributed serving: multi-node (planned per stage; serve runs the machines)",
     "{model} --tensor-parallel-size 2 --pipeline-parallel-size 2 --nnodes 2 --node-rank 0 "
     "--master-addr 10.0.0.1 --master-port 29500", ACCEPTED),
    ("DeepSeek-V3 recipe", "{model} -tp 2 --trust-remote-code", ACCEPTED),
    ("data parallel deployment", "{model} --data-parallel-size 2", "--data-parallel-size"),
    ("Qwen3 MoE recipe", "{model} -pp 2 --enable-expert-parallel", "--enable-expert-parallel"),
    ("quantization: AWQ", "{model} --quantization awq", "--quantization"),
    ("quantization: FP8", "{model} --quantization fp8 --max-model-len 1024", ACCEPTED),
    ("LoRA adapters", "{model} --enable-lora --lora-modules sql-lora=/adapters/sql "
     "--max-loras 2 --max-lora-rank 32 --max-cpu-loras 4 --lora-dtype auto", ACCEPTED),
    ("LoRA adapters: fully sharded", "{model} --enable-lora --fully-sharded-loras",
     ACCEPTED),
    ("tool calling", "{model} --enable-auto-tool-choice --tool-call-parser llama3_json",
     ACCEPTED),
    ("Qwen2.5 tool calling", "{model} --enable-auto-tool-choice --tool-call-parser hermes",
     ACCEPTED),
    ("Mistral tool calling", "{model} --enable-auto-tool-choice --tool-call-parser mistral",
     ACCEPTED),
    ("Qwen3-Coder tool calling", "{model} --enable-auto-tool-choice --tool-call-parser "
     "qwen3_coder", ACCEPTED),
    ("Llama 4 tool calling", "{model} --enable-auto-tool-choice --tool-call-parser "
     "llama4_pythonic", ACCEPTED),
    ("DeepSeek-V3 tool calling", "{model} --enable-auto-tool-choice --tool-call-parser "
     "deepseek_v3", ACCEPTED),
    ("DeepSeek-V3.1 tool calling", "{model} --enable-auto-tool-choice --tool-call-parser "
     "deepseek_v31", ACCEPTED),
    ("Kimi K2 tool calling", "{model} --enable-auto-tool-choice --tool-call-parser "
     "kimi_k2", ACCEPTED),
    ("GLM-4.5 tool calling", "{model} --enable-auto-tool-choice --tool-call-parser glm45", ACCEPTED),
    ("GLM-4.7 tool calling", "{model} --enable-auto-tool-choice --tool-call-parser glm47", ACCEPTED),
    ("Seed-OSS tool calling", "{model} --enable-auto-tool-choice --tool-call-parser seed_oss",
     ACCEPTED),
    ("MiniMax-M2 tool calling", "{model} --enable-auto-tool-choice --tool-call-parser "
     "minimax_m2", ACCEPTED),
    ("Step-3 tool calling", "{model} --enable-auto-tool-choice --tool-call-parser step3", ACCEPTED),
    ("xLAM tool calling", "{model} --enable-auto-tool-choice --tool-call-parser xlam", ACCEPTED),
    ("Jamba tool calling", "{model} --enable-auto-tool-choice --tool-call-parser jamba", ACCEPTED),
    ("Hunyuan-A13B tool calling", "{model} --enable-auto-tool-choice --tool-call-parser "
     "hunyuan_a13b", ACCEPTED),
    ("InternLM2 tool calling", "{model} --enable-auto-tool-choice --tool-call-parser internlm",
     ACCEPTED),
    ("LongCat tool calling", "{model} --enable-auto-tool-choice --tool-call-parser longcat",
     ACCEPTED),
    ("OLMo 3 tool calling", "{model} --enable-auto-tool-choice --tool-call-parser olmo3", ACCEPTED),
    ("LFM2 tool calling", "{model} --enable-auto-tool-choice --tool-call-parser lfm2", ACCEPTED),
    ("Poolside tool calling", "{model} --enable-auto-tool-choice --tool-call-parser "
     "poolside_v1", ACCEPTED),
    ("K2 Horizon tool calling", "{model} --enable-auto-tool-choice --tool-call-parser "
     "k2_horizon", ACCEPTED),
    ("Granite 4 tool calling", "{model} --enable-auto-tool-choice --tool-call-parser granite4",
     ACCEPTED),
    ("Granite 20B FC tool calling", "{model} --enable-auto-tool-choice --tool-call-parser "
     "granite-20b-fc", ACCEPTED),
    ("Phi-4-mini tool calling", "{model} --enable-auto-tool-choice --tool-call-parser "
     "phi4_mini_json", ACCEPTED),
    ("Granite 3 tool calling", "{model} --enable-auto-tool-choice --tool-call-parser granite",
     ACCEPTED),
    ("tool calling: another parser", "{model} --tool-call-parser openai",
     "--tool-call-parser"),
    ("reasoning outputs", "{model} --reasoning-parser deepseek_r1", ACCEPTED),
    ("Qwen3 reasoning", "{model} --reasoning-parser qwen3", ACCEPTED),
    ("GLM-4.5 reasoning", "{model} --reasoning-parser glm45 --tool-call-parser hermes",
     ACCEPTED),
    ("Magistral reasoning", "{model} --reasoning-parser mistral", ACCEPTED),
    ("gpt-oss reasoning", "{model} --reasoning-parser openai_gptoss", "--reasoning-parser"),
    ("reasoning outputs: another parser", "{model} --reasoning-parser granite",
     "--reasoning-parser"),
    ("multimodal inputs", "{model} --limit-mm-per-prompt '{{\"image\": 2}}'",
     "--limit-mm-per-prompt"),
    ("Mistral", "{model} --tokenizer-mode mistral --config-format mistral "
     "--load-format mistral", "--tokenizer-mode"),
    ("speculative decoding", "{model} --speculative-config "
     "'{{\"method\": \"ngram\", \"num_speculative_tokens\": 5}}'", "--speculative-config"),
    ("gpt-oss recipe", "{model} --async-scheduling", ACCEPTED),
    ("CPU offload", "{model} --cpu-offload-gb 10", "--cpu-offload-gb"),
    ("sleep mode", "{model} --enable-sleep-mode", ACCEPTED),
    ("Gemma 2", "{model} --disable-sliding-window", "--disable-sliding-window"),
    ("optimization level", "{model} -O3", ACCEPTED),
    ("optimization level, spaced", "{model} -O 2 --compilation-config '{{\"level\": 3}}'",
     ACCEPTED),
    ("compilation level, older vLLM", "{model} -O.level=3 -O=1", ACCEPTED),
    ("JSON flags key by key", "{model} -O0 -cc.cudagraph_mode=NONE "
     "--kv-events-config.enable_kv_cache_events true --override-generation-config.top_p 0.9",
     ACCEPTED),
    ("speculative decoding, key by key", "{model} --speculative-config.method ngram "
     "--speculative-config.num_speculative_tokens 5", "--speculative-config"),
    ("CORS, roles and shutdown", "{model} --allowed-origins '[\"*\"]' --allow-credentials "
     "--response-role assistant --chat-template-content-format string --shutdown-timeout 10 "
     "--log-level DEBUG --max-log-len 100", ACCEPTED),
    ("request logging and token details", "{model} --enable-log-requests --max-logprobs 5 "
     "--return-tokens-as-token-ids --enable-prompt-tokens-details", ACCEPTED),
    ("what the API answers", "{model} --enable-force-include-usage "
     "--enable-request-id-headers --exclude-tools-when-tool-choice-none "
     "--enable-server-load-tracking --enable-tokenizer-info-endpoint "
     "--disable-access-log-for-endpoints /health,/metrics --h11-max-header-count 200 "
     "--h11-max-incomplete-event-size 1048576 --stream-interval 4", ACCEPTED),
    ("what the API answers, turned off", "{model} --no-enable-force-include-usage "
     "--no-enable-request-id-headers --no-exclude-tools-when-tool-choice-none "
     "--no-enable-server-load-tracking --no-enable-tokenizer-info-endpoint", ACCEPTED),
    ("a separate tokenizer", "{model} --tokenizer {model}", ACCEPTED),
    ("fp8 KV scales", "{model} --kv-cache-dtype fp8 --calculate-kv-scales",
     "--calculate-kv-scales"),
    ("config overrides", "{model} --hf-overrides '{{\"rope_scaling\": null}}'",
     "--hf-overrides"),
]


def _argv(line: str, model) -> list[str]:
    # A what-if device: a cap such as --gpu-memory-utilization 0.9 must not depend on how
    # much of this machine's memory happens to be free (above free, a cap is refused).
    return [*shlex.split(line.format(model=model)), "--device", "cpu", "--device-memory", "24GiB"]


@pytest.mark.parametrize(("source", "line", "refused_by"), LAUNCH_LINES,
                         ids=[source for source, _, _ in LAUNCH_LINES])
def test_launch_line_plans_or_is_refused_by_name(capsys, tiny_llama_dir, source, line,
                                                 refused_by) -> None:
    code = main(["plan", *_argv(line, tiny_llama_dir)])
    err = capsys.readouterr().err
    assert "unrecognized arguments" not in err and "Traceback" not in err
    if refused_by is None:
        assert code == 0, err
    else:
        assert code == 2
        assert err.count("\n") == 1 and re.match(f"error: {re.escape(refused_by)}[ :]", err)
        assert "kvledger does not support" in err


@pytest.mark.parametrize("command", ["preflight", "serve"])
@pytest.mark.parametrize(("source", "line", "refused_by"), LAUNCH_LINES,
                         ids=[source for source, _, _ in LAUNCH_LINES])
def test_preflight_and_serve_read_the_line_as_plan_does(tiny_llama_dir, command, source,
                                                        line, refused_by) -> None:
    parser = build_parser(command)
    if refused_by is None:
        config = config_from_args(parser.parse_args(vllm_argv(_argv(line, tiny_llama_dir), parser)))
        assert config.model == str(tiny_llama_dir)
    else:
        with pytest.raises(BadInput, match=f"^{re.escape(refused_by)}[ :].*kvledger does not support"):
            parser.parse_args(vllm_argv(_argv(line, tiny_llama_dir), parser))


@pytest.mark.parametrize("command", ["plan", "preflight", "serve"])
def test_every_vllm_serve_flag_is_ruled(command) -> None:
    """A flag vLLM adds later is refused as unsupported once listed; none is unrecognized."""
    known = build_parser(command)._option_string_actions
    missing = [flag for action in VLLM_SERVE_FLAGS for flag in action.split()
               if flag not in known]
    assert missing == []


@pytest.mark.parametrize(("flag", "name"), [
    ("--data-parallel-size", "data parallelism"), ("-dp", "data parallelism")])
def test_a_parallel_size_of_one_is_accepted_and_more_refused_by_name(flag, name) -> None:
    parser = build_parser("plan")
    assert config_from_args(parser.parse_args(["/m", flag, "1"])).model == "/m"
    with pytest.raises(BadInput, match=f"^{flag} 2: kvledger does not support {name} yet"):
        parser.parse_args(["/m", flag, "2"])


def test_the_positional_model_is_the_model_flag() -> None:
    parser = build_parser("serve")
    assert config_from_args(parser.parse_args(["/m", "--port", "9000"])).model == "/m"
    assert config_from_args(parser.parse_args(["/m", "--model", "/m"])).model == "/m"
    with pytest.raises(BadInput, match="the model is given twice, '/m' and --model '/n'"):
        config_from_args(parser.parse_args(["/m", "--model", "/n"]))
    with pytest.raises(BadInput, match="--model is required"):
        config_from_args(parser.parse_args([]))


def test_vllm_aliases_of_kvledger_flags() -> None:
    parser = build_parser("plan")
    config = config_from_args(parser.parse_args(
        ["/m", "--device-memory-utilization", "0.5", "--no-enforce-eager"]))
    assert config.gpu_memory_utilization == 0.5 and config.enforce_eager is False
    assert config_from_args(parser.parse_args(["/m", "--enforce-eager"])).enforce_eager


def test_every_flag_has_a_help_line() -> None:
    for command in ("plan", "preflight", "serve", "fetch"):
        parser = build_parser(command)
        silent = [a.option_strings for a in parser._actions
                  if a.option_strings and not a.help]
        assert silent == [], command
    text = " ".join(build_parser("serve").format_help().split())
    assert "--config VALUE vLLM's: a YAML file of flags, read as vLLM reads it" in text


def test_help_says_why_a_no_op_changes_nothing() -> None:
    text = " ".join(build_parser("plan").format_help().split())
    assert "--trust-remote-code vLLM's; accepted, changes nothing: kvledger runs its own code" in text
    assert "--enable-chunked-prefill vLLM's; accepted, changes nothing" in text
    assert "[--speculative-config" not in text  # refused flags are not offered


def test_a_flag_that_is_not_vllms_stays_a_one_line_error(capsys) -> None:
    assert main(["plan", "/m", "--frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--frobnicate" in err


def test_version_prints_the_distribution_version(capsys) -> None:
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"kvledger {version('kvledger')}\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["--tool-call-parser", "openai"], "error: --tool-call-parser openai: kvledger does not "
     "support that tool-call parser (only deepseek_v3, deepseek_v31, glm45, glm47, granite, "
     "granite-20b-fc, granite4, hermes, hunyuan_a13b, internlm, jamba, k2_horizon, kimi_k2, "
     "lfm2, llama3_json, llama4_json, llama4_pythonic, longcat, minimax_m2, mistral, olmo3, "
     "phi4_mini_json, poolside_v1, pythonic, qwen3_coder, qwen3_json, qwen3_xml, seed_oss, "
     "step3 or xlam): gpt-oss's calls are Harmony channel messages, which kvledger does not "
     "parse"),
    (["--enable-auto-tool-choice"], "error: --enable-auto-tool-choice requires "
     "--tool-call-parser"),
])
def test_serve_refuses_tool_flags_it_cannot_honour(capsys, tiny_llama_dir, argv,
                                                   message) -> None:
    assert main(["serve", str(tiny_llama_dir), *argv, "--device", "cpu"]) == 2
    assert capsys.readouterr().err == message + "\n"


def test_underscored_flags_and_a_config_file_read_as_vllm_reads_them(tiny_llama_dir, tmp_path,
                                                                     capsys):
    """``--max_model_len`` is ``--max-model-len``; ``--config FILE.yaml`` holds flags the
    command line overrides (vLLM's FlexibleArgumentParser)."""
    config = tmp_path / "serve.yaml"
    config.write_text("max_model_len: 64\nmax-num-seqs: 3\nenforce-eager: true\n"
                      "enable-prefix-caching: false\nblock_size: 8\n")
    line = [str(tiny_llama_dir), "--device", "cpu", "--config", str(config),
            "--max_num_seqs=2", "--json"]
    assert main(["plan", *line]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["max_model_len"], plan["max_num_seqs"], plan["kv"]["block_size"]) == (64, 2, 8)
    for text, error in (("- a list\n", "expected a mapping"), ("a: [\n", "not valid YAML"),
                        ("[" * 100_000, "nested too deeply")):
        config.write_text(text)
        assert main(["plan", *line]) == 2
        assert error in capsys.readouterr().err
    config.write_bytes(b"max-model-len: 256\n# caf\xe9\n")  # Latin-1: was a traceback
    assert main(["plan", *line]) == 2
    assert capsys.readouterr().err.startswith("error: --config")
    assert main(["plan", str(tiny_llama_dir), "--config", str(tmp_path / "none.yaml")]) == 2
    assert "No such file" in capsys.readouterr().err
    assert main(["plan", str(tiny_llama_dir), "--config", str(tmp_path / "x.json")]) == 2
    assert "a config file is YAML" in capsys.readouterr().err


def test_the_shares_the_docs_give_are_the_parsers() -> None:
    """README's and docs/coming-from-vllm.md's counts of vLLM's flags (and reasoning
    parsers) are what serve does."""
    from collections import Counter
    from pathlib import Path

    from kvledger.engine.settings.reasoning_parsers import (
        REASONING_PARSERS,
        REFUSED_REASONING_PARSERS,
    )
    from kvledger.engine.settings.tool_parsers import REFUSED_TOOL_PARSERS, TOOL_PARSERS
    from kvledger.engine.settings.vllm_flags import verdicts

    counts = Counter(verdicts(build_parser("serve")).values())
    root = Path(__file__).resolve().parents[2]
    readme = " ".join((root / "README.md").read_text().split())
    page = " ".join((root / "docs" / "coming-from-vllm.md").read_text().split())
    total = sum(counts.values())
    assert (f"of vLLM 0.32's {total} serve flags, {counts['implemented']} implemented, "
            f"{counts['no-op']} no-ops and {counts['refused']} refused") in readme
    assert (f"Of vLLM 0.32's {total} `vllm serve` flags, {counts['implemented']} are "
            f"implemented, {counts['no-op']} are accepted") in page
    assert f"and {counts['refused']} are refused by name" in page
    served, refused = len(REASONING_PARSERS), len(REFUSED_REASONING_PARSERS)
    assert (f"of its {served + refused} `--reasoning-parser` names, {served} served and "
            f"{refused} refused") in readme
    tools, no_tools = len(TOOL_PARSERS), len(REFUSED_TOOL_PARSERS)
    assert (f"of its {tools + no_tools} `--tool-call-parser` names, {tools} served and "
            f"{no_tools} refused") in readme
    assert f"Its other {no_tools} names" in page
    assert f"Its other {refused} names" in page
