"""A launch line plans as it serves: every vLLM flag ``serve`` implements is taken by ``plan``
and ``preflight`` (seven were refused as "not supported"), a value vLLM's argparse refuses
is refused (``--uvicorn-log-level nonsense`` was accepted), and the vLLM flags kvledger can
honour are honoured: ``--log-level DEBUG``, ``--shutdown-timeout``, ``--max-log-len``,
``--revision``."""

from __future__ import annotations

import pytest

from kvledger.engine.cli import build_parser, main
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config_flags import config_from_args
from kvledger.engine.settings.declare import values_from_args
from kvledger.engine.settings.launch_line import vllm_argv
from kvledger.engine.settings.serve_config import ServeConfig
from kvledger.engine.settings.vllm_flags import verdicts

SERVE_ONLY = ["--allowed-origins", '["*"]', "--allowed-methods", '["GET"]', "--allowed-headers",
              '["x-a"]', "--allow-credentials", "--chat-template-content-format", "openai",
              "--response-role", "bot", "--headless", "--host", "::", "--port", "9000",
              "--root-path", "/llama", "--shutdown-timeout", "5", "--log-level", "DEBUG",
              "--uvicorn-log-level", "warning", "--max-log-len", "100"]


@pytest.mark.parametrize("command", ["plan", "preflight"])
def test_every_flag_serve_implements_or_accepts_is_taken(command) -> None:
    serve, other = verdicts(build_parser("serve")), verdicts(build_parser(command))
    refused = [flag for flag, verdict in serve.items()
               if verdict != "refused" and other[flag] == "refused"]
    assert refused == []


@pytest.mark.parametrize("command", ["plan", "preflight"])
def test_serves_flags_plan_as_they_serve(capsys, tiny_llama_dir, tmp_path, command) -> None:
    extra = ["--plan-out", str(tmp_path / "plan.json"),
             "--termination-log", str(tmp_path / "log")] if command == "preflight" else []
    assert main([command, str(tiny_llama_dir), "--device", "cpu", *SERVE_ONLY, *extra]) == 0, \
        capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--uvicorn-log-level", "nonsense"], "argument --uvicorn-log-level: invalid choice: "
     "'nonsense'"),
    (["--uvicorn-log-level", "WARNING"], "argument --uvicorn-log-level: invalid choice"),
    (["--log-level", "NOTSET"], "argument --log-level: invalid choice: 'NOTSET'"),
    (["--chat-template-content-format", "xml"], "argument --chat-template-content-format: "
     "invalid choice: 'xml'"),
    (["--allowed-origins", "*"], "argument --allowed-origins: expected a JSON list of strings"),
    (["--max-log-len", "long"], "argument --max-log-len: expected a whole number"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout: expected seconds >= 0"),
    (["--port", "http"], "argument --port: invalid int value: 'http'"),
    (["--default-chat-template-kwargs", "[]"], "argument --default-chat-template-kwargs: "
     "expected a JSON object"),
    (["--stream-interval", "0"], "argument --stream-interval: expected a positive integer"),
    (["--h11-max-header-count", "many"], "argument --h11-max-header-count: invalid int "
     "value: 'many'"),
    (["--h11-max-incomplete-event-size", "4MB"], "argument --h11-max-incomplete-event-size: "
     "invalid int value: '4MB'"),
])
@pytest.mark.parametrize("command", ["plan", "serve"])
def test_a_value_vllm_refuses_is_one_line(capsys, tiny_llama_dir, command, argv,
                                          message) -> None:
    assert main([command, str(tiny_llama_dir), "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-logprobs", "-1"], "--max-logprobs -1: kvledger reports at most 20 logprobs"),
    (["--max-logprobs", "21"], "--max-logprobs 21: kvledger reports at most 20 logprobs"),
    (["--tokenizer", "Org/tokenizer-on-the-hub"], "reads a tokenizer from a folder"),
])
@pytest.mark.parametrize("command", ["plan", "preflight", "serve"])
def test_a_value_serve_refuses_is_refused_by_the_preflight_too(capsys, tiny_llama_dir, tmp_path,
                                                                command, argv, message) -> None:
    """vLLM takes these, kvledger's serve does not: a pre-flight that passed them would
    leave the pod's engine to exit 2 after the plan said it may start."""
    extra = ["--plan-out", str(tmp_path / "plan.json"),
             "--termination-log", str(tmp_path / "log")] if command == "preflight" else []
    assert main([command, str(tiny_llama_dir), "--device", "cpu", *argv, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(("given", "level"), [
    ("DEBUG", "debug"), ("CRITICAL", "critical"), ("Warning", "warning"), ("info", "info")])
def test_log_level_takes_vllms_spellings(given, level) -> None:
    args = build_parser("serve").parse_args(["/m", "--log-level", given])
    assert ServeConfig(**values_from_args(args, ServeConfig)).log_level == level


def test_shutdown_timeout_is_the_shutdown_grace() -> None:
    parser = build_parser("serve")
    for argv, grace in ((["--shutdown-timeout", "5"], 5), (["--shutdown-timeout", "0"], 0),
                        ([], 30)):
        args = parser.parse_args(["/m", *argv])
        assert ServeConfig(**values_from_args(args, ServeConfig)).shutdown_grace_s == grace


def _model(*argv: str):
    parser = build_parser("plan")
    return config_from_args(parser.parse_args(vllm_argv(list(argv), parser)))


def test_revision_is_the_hub_models_revision(tmp_path) -> None:
    config = _model("org/name", "--revision", "v1.2")
    assert (config.model, config.served_model_name) == ("hf://org/name@v1.2", "org/name")
    assert _model("--model", "hf://org/name", "--revision", "abc").model == "hf://org/name@abc"
    assert _model("hf://org/name@v1", "--revision", "v1").model == "hf://org/name@v1"
    assert _model("hf://org/name", "--revision", "None").model == "hf://org/name"
    with pytest.raises(BadInput, match=r"^--revision v2 and the model's own revision "
                                       r"\(hf://org/name@v1\) differ: give one$"):
        _model("hf://org/name@v1", "--revision", "v2")
    with pytest.raises(BadInput, match=rf"^--revision v1: the model {tmp_path} is a local "
                                       "folder, which has no revisions"):
        _model(str(tmp_path), "--revision", "v1")
    with pytest.raises(BadInput, match="bad hub model"):
        _model("org/name", "--revision", "a..b")


def test_help_says_why_a_serve_flag_changes_no_plan() -> None:
    text = " ".join(build_parser("plan").format_help().split())
    assert ("--allowed-origins VALUE vLLM's; accepted, changes nothing: `kvledger serve`'s "
            "CORS origins; the plan does not depend on it") in text
    assert "--max-log-len VALUE vLLM's; accepted, changes nothing: kvledger never logs" in text
