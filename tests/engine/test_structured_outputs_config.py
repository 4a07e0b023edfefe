"""``--structured-outputs-config`` launch lines (engine/settings/structured_outputs_config.py):
vLLM 0.32's JSON and dotted forms plan and serve; vLLM's validator, an unknown key and a
plugin exit 2 with one line, never a traceback."""

from __future__ import annotations

import re
import shlex

import pytest

from kvledger.engine.cli import build_parser, main
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.declare import values_from_args
from kvledger.engine.settings.launch_line import vllm_argv
from kvledger.engine.settings.serve_config import ServeConfig
from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig
from kvledger.engine.settings.vllm_flags import verdicts

FLAG = "--structured-outputs-config"
# (the line after `vllm serve MODEL`, the config serve reads from it)
LINES = [
    (f"{FLAG} '{{\"backend\": \"xgrammar\"}}'", {"backend": "xgrammar"}),
    (f"{FLAG} '{{\"backend\":\"guidance\",\"disable_any_whitespace\":true}}'",
     {"backend": "guidance", "disable_any_whitespace": True}),
    (f"{FLAG}.backend guidance", {"backend": "guidance"}),
    (f"{FLAG}.backend=guidance {FLAG}.disable_additional_properties true",
     {"backend": "guidance", "disable_additional_properties": True}),
    (f"{FLAG} '{{\"enable_in_reasoning\": true}}' --reasoning-parser qwen3",
     {"enable_in_reasoning": True}),
    (f"{FLAG} '{{\"backend\": \"outlines\", \"enable_in_reasoning\": \"yes\"}}'",
     {"backend": "outlines", "enable_in_reasoning": True}),  # pydantic's lax booleans
    (f"{FLAG} '{{\"backend\": \"lm-format-enforcer\"}}'", {"backend": "lm-format-enforcer"}),
    ("--structured_outputs_config.backend auto", {}),
]
REFUSED = [
    (f"{FLAG} '{{\"disable_any_whitespace\": true}}'", "disable_any_whitespace is only "
     "supported for xgrammar and guidance backends (backend is auto)"),
    (f"{FLAG} '{{\"backend\": \"xgrammar\", \"disable_additional_properties\": true}}'",
     "disable_additional_properties is only supported for the guidance backend"),
    (f"{FLAG}.whitespace false", "vLLM 0.32's structured outputs config has no key "
     "'whitespace'"),
    (f"{FLAG} '{{\"reasoning_parser_plugin\": \"/plugins/mine.py\"}}'",
     "reasoning_parser_plugin /plugins/mine.py: kvledger does not support loading a "
     "reasoning parser from a file"),
    (f"{FLAG} '{{\"reasoning_parser\": \"granite\"}}'", "reasoning_parser granite: "
     "kvledger does not support that reasoning parser: it finds the reasoning by phrases"),
    (f"{FLAG}.backend xgrammar2", "backend must be one of auto, xgrammar, guidance, "
     "outlines, lm-format-enforcer, got 'xgrammar2'"),
    (f"{FLAG} '{{\"enable_in_reasoning\": 2}}'", "enable_in_reasoning must be true or "
     "false, got 2"),
    (f"{FLAG} '[\"guidance\"]'", "expected a JSON object"),
    (f"{FLAG} '{{\"backend\": '", "expected a JSON object of vLLM's structured outputs"),
]


def _argv(model, line: str) -> list[str]:
    return [str(model), *shlex.split(line), "--device", "cpu", "--device-memory", "24GiB"]


def _serving(model, line: str) -> ServeConfig:
    parser = build_parser("serve")
    args = parser.parse_args(vllm_argv(_argv(model, line), parser))
    return ServeConfig(**values_from_args(args, ServeConfig))


@pytest.mark.parametrize(("line", "expected"), LINES, ids=[line for line, _ in LINES])
def test_each_form_plans_and_serve_reads_it_as_vllm_does(capsys, tiny_llama_dir, line,
                                                         expected) -> None:
    assert main(["plan", *_argv(tiny_llama_dir, line)]) == 0, capsys.readouterr().err
    assert _serving(tiny_llama_dir, line).structured_outputs_config == \
        StructuredOutputsConfig(**expected)


@pytest.mark.parametrize(("line", "message"), REFUSED, ids=[line for line, _ in REFUSED])
@pytest.mark.parametrize("command", ["plan", "serve"])
def test_a_value_vllm_refuses_exits_2_with_one_line(capsys, tiny_llama_dir, command, line,
                                                    message) -> None:
    assert main([command, *_argv(tiny_llama_dir, line)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.match(f"error: {re.escape(FLAG)}[ :].*{re.escape(message)}", err), err


def test_reasoning_parser_in_the_config_is_the_flags_and_the_flag_wins(tiny_llama_dir):
    """vLLM's ``create_structured_outputs_config``: ``--reasoning-parser`` overrides the
    config's ``reasoning_parser``; alone, the config's is the parser."""
    config = f"{FLAG} '{{\"reasoning_parser\": \"deepseek_r1\"}}'"
    assert _serving(tiny_llama_dir, config).reasoning_parser == "deepseek_r1"
    assert _serving(tiny_llama_dir, f"{config} --reasoning-parser qwen3").reasoning_parser \
        == "qwen3"
    assert _serving(tiny_llama_dir, f"{FLAG}.reasoning_parser qwen3").reasoning_parser == \
        "qwen3"


def test_the_flag_is_serves_own_and_a_checked_no_op_for_the_plan() -> None:
    assert verdicts(build_parser("serve"))[FLAG] == "implemented"
    assert verdicts(build_parser("plan"))[FLAG] == "no-op"
    with pytest.raises(BadInput, match="has no key 'x'"):
        build_parser("preflight").parse_args(["/m", FLAG, '{"x": 1}'])


def test_the_config_renders_back_to_the_flag_that_gives_it() -> None:
    config = StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True,
                                     enable_in_reasoning=True)
    flags = ServeConfig(structured_outputs_config=config).to_flags()
    assert flags == [FLAG, '{"backend":"guidance","disable_any_whitespace":true,'
                           '"enable_in_reasoning":true}']
    assert StructuredOutputsConfig.parse(flags[1]) == config
    assert StructuredOutputsConfig().to_json() == "{}"
