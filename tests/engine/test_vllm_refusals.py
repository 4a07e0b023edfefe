"""Every vLLM flag kvledger refuses says why, never the bare "kvledger does not support
vLLM's --X"; the flags that change nothing here are accepted with their values checked as
vLLM's argparse checks them, and an on/off flag's ``--no-`` form, vLLM's default, is
accepted where its ``--X`` is refused."""

from __future__ import annotations

import pytest

from kvledger.engine.cli import build_parser, main
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config_flags import config_from_args
from kvledger.engine.settings.launch_line import vllm_argv
from kvledger.engine.settings.vllm_flags import VLLM_SERVE_FLAGS, _VllmFlag
from kvledger.engine.settings.vllm_noops import NOOPS
from kvledger.engine.settings.vllm_refusals import REFUSALS
from kvledger.engine.settings.vllm_rules import _RULES


def _parse(*argv: str):
    parser = build_parser("plan")
    return config_from_args(parser.parse_args(vllm_argv(["/m", *argv], parser)))


@pytest.mark.parametrize("command", ["plan", "serve"])
def test_every_refused_flag_says_why(command) -> None:
    parser = build_parser(command)
    bare = []
    for action in {id(a): a for a in parser._actions if isinstance(a, _VllmFlag)}.values():
        for flag in action.option_strings:
            rule = action.rule
            if rule is not None and not rule.refused_always:
                continue
            with pytest.raises(BadInput) as refused:
                parser.parse_args(["/m", flag])
            if str(refused.value) == f"{flag}: kvledger does not support vLLM's {flag}":
                bare.append(flag)
    assert bare == []


def test_each_flag_has_one_rule_and_each_rule_a_why() -> None:
    spelled = {flag for action in VLLM_SERVE_FLAGS for flag in action.split()}
    tables = (_RULES, NOOPS, REFUSALS)
    for i, table in enumerate(tables):
        assert set(table) <= spelled
        for other in tables[i + 1:]:
            assert not set(table) & set(other)
    for flag, rule in {**_RULES, **NOOPS, **REFUSALS}.items():
        assert rule.why or rule.unsupported, flag
        assert not rule.accepts or (rule.why and rule.unsupported), flag


@pytest.mark.parametrize("argv", [
    ['{"image": 0, "video": 0}'], ['{"image": {"count": 0, "width": 512}}'],
    [".image", "0"]])
def test_every_modality_at_zero_is_text_only(argv) -> None:
    flag = "--limit-mm-per-prompt" + (argv[0] if argv[0].startswith(".") else "")
    assert _parse(flag, *argv[-1:]).model == "/m"


@pytest.mark.parametrize("value", ['{"image": 2}', "{}", '{"image": 0, "audio": 1}',
                                   '{"image": false}'])
def test_any_other_modality_limit_is_refused(value) -> None:
    with pytest.raises(BadInput, match=r"^--limit-mm-per-prompt .*: kvledger does not "
                                       r"support multimodal inputs: it serves text"):
        _parse("--limit-mm-per-prompt", value)


@pytest.mark.parametrize(("argv", "said"), [
    (["--mm-processor-cache-type", "disk"], "invalid choice: 'disk'"),
    (["--renderer-num-workers", "many"], "invalid int value: 'many'"),
    (["--media-io-kwargs", "[1]"], "expected a JSON object"),
    (["--limit-mm-per-prompt", "{"], "expected a JSON object"),
    (["--max-parallel-loading-workers", "2.5"], "expected a whole number"),
    (["--ubatch-size", "2"], "does not support splitting a step into micro-batches"),
])
def test_a_no_ops_bad_value_is_one_line_exit_2(capsys, argv, said) -> None:
    assert main(["plan", "/m", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


@pytest.mark.parametrize(("on", "why"), [
    ("--enable-prompt-embeds", "prompt embeddings as input"),
    ("--disable-sliding-window", "turning a model's sliding window off"),
    ("--enable-log-outputs", "logging answers: kvledger never logs"),
    ("--numa-bind", "binding ranks to NUMA nodes: run kvledger under numactl"),
])
def test_an_off_form_is_accepted_where_the_on_form_is_refused(on, why) -> None:
    with pytest.raises(BadInput, match=f"^{on}: kvledger does not support {why}"):
        _parse(on)
    assert _parse("--no-" + on[2:]).model == "/m"


def test_knobs_of_what_kvledger_lacks_or_of_vllms_internals_are_accepted() -> None:
    line = ("--async-scheduling --max-parallel-loading-workers 4 --code-revision main "
            "--skip-mm-profiling --mm-processor-cache-gb 0 --language-model-only "
            "--all2all-backend deepep_low_latency --mamba-cache-dtype float32 "
            "--num-scheduler-steps 8 --max-seq-len-to-capture 8192 --enable-reasoning "
            "--performance-mode balanced --ignore-patterns "
            "original/* --scheduler-reserve-full-isl --watermark 0")
    assert _parse(*line.split()).model == "/m"
    text = " ".join(build_parser("plan").format_help().split())
    assert ("--skip-mm-profiling vLLM's; accepted, changes nothing: kvledger takes text "
            "only") in text
    assert ("--max-parallel-loading-workers VALUE vLLM's; accepted, changes nothing: vLLM "
            "0.32 ignores it") in text
