"""``kvledger plan`` and ``kvledger preflight`` end to end, on checkpoints written here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from budget_checkpoints import write_checkpoint

from kvledger.engine.cli import main
from kvledger.engine.planner.plan_line import (
    PLAN_LINE_PREFIX,
    TERMINATION_LOG_MAX_BYTES,
    read_plan_line,
    truncate_utf8,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_checkpoint(path, shards=2)
    return str(path)


def test_plan_fits_exit_0_report_on_stdout(model, capsys) -> None:
    assert main(["plan", "--model", model, "--device-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fits: engine requires ")
    for label in ("weights", "activations", "KV cache", "cuda graphs", "cuda context"):
        assert f"\n  {label} " in out


def test_plan_refusal_exit_3_full_report(model, capsys) -> None:
    rc = main(["plan", "--model", model, "--device-memory", "2GiB", "--memory-limit", "1.2GiB",
               "--max-num-seqs", "64"])
    assert rc == 3
    err = capsys.readouterr().err
    assert err.startswith("error: engine requires ")
    assert "to fit within 1.2 GiB, try one of:" in err
    assert "--enforce-eager" in err
    assert "limit: --memory-limit 1.2 GiB" in err


def test_plan_json_only_json_on_stdout(model, capsys) -> None:
    rc = main(["plan", "--model", model, "--device-memory", "2GiB", "--memory-limit", "1.2GiB",
               "--json"])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert rc == 3 and doc["fits"] is False and captured.err == ""
    assert doc["limit_bytes"] == int(1.2 * 2**30) and doc["limit_source"] == "--memory-limit"
    assert doc["remedies"] and doc["remedies"][0]["flag"] == "--enforce-eager"
    assert main(["plan", "--model", model, "--device-memory", "24GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True


def test_preflight_writes_plan_and_termination_log(model, tmp_path, capsys) -> None:
    plan_out = tmp_path / "deep" / "dir" / "plan.json"
    log = tmp_path / "termination-log"
    rc = main(["preflight", "--model", model, "--device-memory", "2GiB", "--memory-limit",
               "1GiB", "--plan-out", str(plan_out), "--termination-log", str(log)])
    assert rc == 3
    doc = json.loads(plan_out.read_text())
    assert doc["fits"] is False and doc["short_by_bytes"] > 0
    message = log.read_text()
    assert message.startswith("error: engine requires ")
    assert message == capsys.readouterr().err  # the log has the plan line too
    report, figures = read_plan_line(message)
    assert message == report + message.splitlines(keepends=True)[-1]  # the line is last
    assert figures == _figures(doc)
    assert main(["preflight", "--model", model, "--device-memory", "24GiB", "--plan-out",
                 str(plan_out), "--termination-log", str(log)]) == 0
    plan_doc = json.loads(plan_out.read_text())
    assert plan_doc["fits"] is True
    message = log.read_text()
    assert message == capsys.readouterr().out
    *report, line = message.splitlines()
    assert report[0].startswith("fits: ") and "  KV pool: " in message
    # The operator reads exact bytes for status.plan from the plan line.
    assert line.startswith(PLAN_LINE_PREFIX)
    assert json.loads(line.removeprefix(PLAN_LINE_PREFIX)) == _figures(plan_doc)


def _figures(plan_doc: dict) -> dict:
    """The plan JSON less its free text: what the plan line carries."""
    figures = {k: v for k, v in plan_doc.items() if k not in ("remedies", "warnings")}
    figures["kv"] = {k: v for k, v in plan_doc["kv"].items() if k not in ("groups", "note")}
    return figures


def test_preflight_unwritable_termination_log_warns_and_keeps_exit_code(model, tmp_path,
                                                                       capsys) -> None:
    bad = tmp_path / "missing-dir" / "log"
    assert main(["preflight", "--model", model, "--device-memory", "24GiB",
                 "--termination-log", str(bad)]) == 0
    assert "warning: cannot write the termination log" in capsys.readouterr().err
    assert main(["preflight", "--model", model, "--device-memory", "1GiB",
                 "--termination-log", str(bad)]) == 3


def test_termination_log_is_at_most_4096_bytes(model, tmp_path, capsys) -> None:
    log, plan_out = tmp_path / "log", tmp_path / "plan.json"
    rc = main(["preflight", "--model", model, "--device-memory", "1GiB",
               "--gpu-memory-utilization", "0.5", "--unified-memory", "--termination-log",
               str(log), "--plan-out", str(plan_out)])
    assert rc == 3
    data = log.read_bytes()
    assert len(data) <= TERMINATION_LOG_MAX_BYTES
    assert data.decode("utf-8").startswith("error: engine requires ")
    assert read_plan_line(data.decode())[1] == _figures(json.loads(plan_out.read_text()))


def test_a_long_report_is_cut_to_leave_the_plan_line_whole_and_last(model) -> None:
    from kvledger.engine.commands.preflight import termination_message
    from kvledger.engine.planner.plan import make_plan
    from kvledger.engine.planner.plan_line import plan_figures
    from kvledger.engine.planner.report import render_report
    from kvledger.engine.settings.config import EngineConfig

    plan = make_plan(EngineConfig(model=model, device_memory_bytes=2**30,
                                  memory_limit_bytes=2**20))
    report = render_report(plan) + "".join(f"warning: {'w' * 70} {i}\n" for i in range(80))
    message = termination_message(plan, report)
    assert len(message.encode("utf-8")) <= TERMINATION_LOG_MAX_BYTES
    cut, figures = read_plan_line(message)
    assert cut.startswith(report.splitlines()[0]) and cut.endswith("... (truncated)\n")
    assert figures == plan_figures(plan) and figures["fits"] is False
    assert message.splitlines()[-1].startswith(PLAN_LINE_PREFIX)
    assert len(message.encode("utf-8")) > TERMINATION_LOG_MAX_BYTES - 100  # no room wasted


@pytest.mark.parametrize("char", ["a", "é", "模", "🦙"])
def test_truncation_keeps_whole_lines_and_characters(char: str) -> None:
    report = "error: headline\n" + "".join(f"  line {i} {char * 40}\n" for i in range(400))
    cut = truncate_utf8(report)
    data = cut.encode("utf-8")
    assert len(data) <= TERMINATION_LOG_MAX_BYTES < len(report.encode("utf-8"))
    assert cut.startswith("error: headline\n") and cut.endswith("(truncated)\n")
    assert all(line in report for line in cut.splitlines()[:-1])
    one_long_line = char * 5000
    cut = truncate_utf8(one_long_line)
    assert len(cut.encode("utf-8")) <= TERMINATION_LOG_MAX_BYTES
    assert cut.splitlines()[0] == char * len(cut.splitlines()[0])
    assert truncate_utf8("short\n") == "short\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "/no/such/dir"], "does not exist"),
    # A spec's model.path of 5,000 characters: stat's ENAMETOOLONG was an OSError traceback.
    (["--model", "m" * 5000], "(5002 chars): File name too long"),
    (["--model", "{model}", "--memory-limit", "forty"], "bad size 'forty'"),
    (["--model", "{model}", "--device-memory", "1XB"], "bad size"),
    (["--model", "{model}", "--gpu-memory-utilization", "0"], "(0, 1]"),
    (["--model", "{model}", "--gpu-memory-utilization", "1.5"], "(0, 1]"),
    (["--model", "{model}", "--max-model-len", "0"], "positive count of tokens"),
    (["--model", "{model}", "--max-num-seqs", "-3"], "positive integer"),
    (["--model", "{model}", "--block-size", "0"], "positive integer"),
    (["--model", "{model}", "--max-model-len", "100000"], "max_position_embeddings"),
    (["--model", "{model}", "--device-free", "1GiB"], "--device-free needs --device-memory"),
    ([], "--model"),
])
def test_bad_input_one_line_exit_2(model, capsys, argv, message) -> None:
    argv = [a.replace("{model}", model) for a in argv]
    for command in ("plan", "preflight"):
        assert main([command, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert message in err and "Traceback" not in err


def test_preflight_refuses_a_checkpoint_the_engine_cannot_run(tmp_path, capsys) -> None:
    write_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["--model", str(tmp_path), "--device-memory", "24GiB"]
    # Never planned as if it were a Llama: plan and preflight refuse it by name.
    for command in ("plan", "preflight"):
        assert main([command, *argv, "--json"] if command == "plan" else
                    [command, *argv, "--plan-out", str(tmp_path / "plan.json")]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("error: unsupported architecture GPT2LMHeadModel for "
                                       "planning; kvledger plans: ")
        assert captured.err.count("\n") == 1 and captured.out == ""
        assert "LlamaForCausalLM" in captured.err and "GptOssForCausalLM" in captured.err
    assert not (tmp_path / "plan.json").exists()


def test_bad_checkpoint_through_a_subprocess(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{garbled")
    proc = subprocess.run([sys.executable, "-m", "kvledger.engine.cli", "plan", "--model",
                           str(tmp_path), "--device-memory", "8GiB"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: config.json ") and proc.stderr.count("\n") == 1
    assert proc.stdout == ""


def test_refusal_through_a_subprocess(model) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvledger.engine.cli", "plan", "--model", model,
                           "--device-memory", "1GiB"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert proc.stderr.startswith("error: engine requires ")


def test_planner_does_not_load_torch() -> None:
    code = ("import sys, kvledger.engine.planner.plan, kvledger.engine.commands.plan, "
            "kvledger.engine.commands.preflight, kvledger.engine.planner.report; "
            "assert 'torch' not in sys.modules, 'torch'; "
            "assert 'aiohttp' not in sys.modules, 'aiohttp'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_plan_command_does_not_load_torch(model) -> None:
    code = ("import sys; from kvledger.engine.cli import main; "
            f"rc = main(['plan', '--model', {model!r}, '--device-memory', '8GiB']); "
            "assert 'torch' not in sys.modules; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_preflight_default_termination_log_is_not_created(model, capsys, monkeypatch,
                                                         tmp_path) -> None:
    from kvledger.engine.commands import preflight as cli_preflight

    default = tmp_path / "termination-log"
    monkeypatch.setattr(cli_preflight, "DEFAULT_TERMINATION_LOG", str(default))
    assert main(["preflight", "--model", model, "--device-memory", "24GiB"]) == 0
    assert not default.exists()
    assert "does not exist (not in a pod?)" in capsys.readouterr().err
    default.write_text("")  # as the kubelet mounts it
    assert main(["preflight", "--model", model, "--device-memory", "1GiB"]) == 3
    assert default.read_text().startswith("error: engine requires ")
