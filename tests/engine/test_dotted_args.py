"""vLLM's dotted arguments (``--flag.key value``, ``--flag.key=value``, ``-cc.key=value``,
``--flag.key+ a,b``) are a JSON flag given key by key, as vLLM 0.32's
FlexibleArgumentParser reads them (engine/settings/dotted_args.py); they were argparse's
"unrecognized arguments"."""

from __future__ import annotations

import json
import re

import pytest

from kvledger.engine.cli import build_parser, main
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config_flags import config_from_args
from kvledger.engine.settings.declare import values_from_args
from kvledger.engine.settings.dotted_args import merge_dotted
from kvledger.engine.settings.launch_line import dashed, vllm_argv
from kvledger.engine.settings.serve_config import ServeConfig


@pytest.mark.parametrize(("argv", "merged"), [
    (["--x.a", "1"], {"a": 1}),
    (["--x.a=true", "--x.b", "text"], {"a": True, "b": "text"}),
    (["--x.a.b", "null", "--x.a.c=[1]"], {"a": {"b": None, "c": [1]}}),
    (["--x.l+", "a,b", "--x.l+=c"], {"l": ["a", "b", "c"]}),
    (["--x.n", "80g", "--x.k", "2K"], {"n": 80 * 10**9, "k": 2048}),  # vLLM's counts
    (["--x.a_b", "0.5"], {"a_b": 0.5}),
])
def test_a_flags_keys_merge_into_one_object_at_the_end(argv, merged) -> None:
    assert merge_dotted(["/m", *argv, "--seed", "1"]) == ["/m", "--seed", "1", "--x",
                                                          json.dumps(merged)]


def test_each_flag_spelling_is_its_own_and_other_arguments_stay() -> None:
    argv = ["-cc.mode=0", "--compilation-config.mode", "1", "--api-key=a.b", "--priority",
            "-0.5", "--chat-template", "./t.jinja"]
    assert merge_dotted(argv) == ["--api-key=a.b", "--priority", "-0.5", "--chat-template",
                                  "./t.jinja", "-cc", '{"mode": 0}', "--compilation-config",
                                  '{"mode": 1}']
    with pytest.raises(BadInput, match=r"^--x\.a needs a value$"):
        merge_dotted(["--x.a"])


def test_a_dotted_key_keeps_its_underscores() -> None:
    assert dashed(["--kv_events_config.enable_kv_cache_events=true", "--max_num_seqs=2"]) == [
        "--kv-events-config.enable_kv_cache_events=true", "--max-num-seqs=2"]
    assert dashed(["-O.cudagraph_mode=NONE"]) == ["--compilation-config.cudagraph_mode=NONE"]


@pytest.mark.parametrize("command", ["plan", "preflight", "serve"])
def test_every_json_flag_takes_its_keys_one_by_one(command, tmp_path) -> None:
    parser = build_parser(command)
    line = ["/m", "--kv-events-config.enable_kv_cache_events", "true",
            "--kv_events_config.topic=kv", "--override-generation-config.temperature", "0.5",
            "--default-chat-template-kwargs.enable_thinking", "false",
            "--compilation-config.cudagraph_mode", "NONE"]
    args = parser.parse_args(vllm_argv(line, parser))
    config = config_from_args(args)
    assert config.kv_events_config.enable_kv_cache_events is True
    assert config.kv_events_config.topic == "kv"
    assert config.override_generation_config == {"temperature": 0.5}
    assert config.enforce_eager is True
    if command == "serve":
        serving = ServeConfig(**values_from_args(args, ServeConfig))
        assert serving.default_chat_template_kwargs == {"enable_thinking": False}


def test_a_config_files_dotted_key_keeps_its_underscores(tmp_path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("kv_events_config.enable_kv_cache_events: 'true'\n")
    parser = build_parser("plan")
    args = parser.parse_args(vllm_argv(["/m", "--config", str(config)], parser))
    assert config_from_args(args).kv_events_config.enable_kv_cache_events is True


def test_a_refused_flags_keys_are_refused_as_the_flag_is(capsys, tiny_llama_dir) -> None:
    lines = []
    for argv in (["--speculative-config.method", "ngram"],
                 ["--speculative-config", '{"method": "ngram"}']):
        assert main(["plan", str(tiny_llama_dir), "--device", "cpu", *argv]) == 2
        lines.append(capsys.readouterr().err)
    assert lines[0] == lines[1]
    assert re.fullmatch(r'error: --speculative-config \{"method": "ngram"\}: kvledger does '
                        r"not support speculative decoding\n", lines[0])
