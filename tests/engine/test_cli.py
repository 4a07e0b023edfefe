"""The ``kvledger`` dispatcher: usage, unknown commands, and a light import path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvledger.engine.cli import ENGINE_COMMANDS, commands, main


def test_usage_lists_every_command(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in commands():
        assert name in out


def test_the_operator_registers_its_commands_the_engine_names_none_of_its() -> None:
    """`run` and `operator` come from the operator's entry points (pyproject.toml); the
    engine's own list names only engine modules (the import contracts check its imports)."""
    assert {name: commands()[name] for name in ("run", "operator")} == {
        "run": "kvledger.operator.local_run", "operator": "kvledger.operator.main"}
    assert all(module.startswith("kvledger.engine.") for module in ENGINE_COMMANDS.values())


def test_no_command_is_bad_input(capsys) -> None:
    assert main([]) == 2


def test_unknown_command_is_one_line_error_exit_2(capsys) -> None:
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown command 'frobnicate'")
    assert "Traceback" not in err


def test_importing_the_engine_package_does_not_load_torch() -> None:
    code = "import sys, kvledger.engine, kvledger.engine.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_closed_stdout_pipe_is_no_traceback(tmp_path) -> None:
    """`kvledger plan --json | head -c1`: the reader is gone before we write."""
    model = tmp_path / "m"
    subprocess.run([sys.executable, "-m", "kvledger.engine.cli", "make-model", "tiny-llama",
                    str(model)], check=True, capture_output=True)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvledger.engine.cli", "plan", "--model", str(model),
             "--device-memory", "8GiB", "--json"],
            stdout=write_end, stderr=subprocess.PIPE, text=True, check=False)
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 1


@pytest.mark.parametrize(("argv", "flag"), [
    # The engine commands take the model as a positional too (`vllm serve MODEL`), so the
    # stray value is read as one and the error names the flag alone.
    (["plan", "--model", "/m", "--max-num-seq", "8"], "--max-num-seq"),
    (["preflight", "--model", "/m", "--plan", "p.json"], "--plan"),
    (["serve", "--model", "/m", "--shutdown", "1"], "--shutdown"),
    (["fetch", "--model", "hf://org/m", "--download", "/c"], "--download /c"),
    (["run", "service.yaml", "--preflight"], "--preflight"),
    (["make-model", "tiny-llama", "/m", "--forc"], "--forc"),
    (["operator", "--names", "x"], "--names x"),
])
def test_abbreviated_flags_are_one_line_errors(capsys, argv, flag) -> None:
    """argparse's prefix matching took --max-num-seq 8 as --max-num-seqs 8, silently."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"error: kvledger {argv[0]}: unrecognized arguments: {flag} "
                   f"(see kvledger {argv[0]} --help)\n")
