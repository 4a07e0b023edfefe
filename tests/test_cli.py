"""The ``kvledger`` dispatcher: usage, unknown commands, and a light import path."""

from __future__ import annotations

import subprocess
import sys

from kvledger.engine.cli import SUBCOMMANDS, main


def test_usage_lists_every_command(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


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
