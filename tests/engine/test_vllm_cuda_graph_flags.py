"""vLLM's ``-O0`` and compilation config say whether decode steps are CUDA graphs, as
vLLM 0.32 reads them (engine/settings/compilation_config.py): ``-O0`` and
``cudagraph_mode`` NONE are ``--enforce-eager``, the config's capture sizes are the flags
of those names, and a bad level or config is one ``error:`` line, exit 2. They were
accepted as no-ops while kvledger captured graphs anyway."""

from __future__ import annotations

import json
import shlex

import pytest

from kvledger.engine.cli import build_parser, main

GPU = ["--device", "cuda", "--device-memory", "80GiB"]  # a what-if card: graphs are planned


def _plan(capsys, model, line: str) -> dict:
    assert main(["plan", str(model), *GPU, *shlex.split(line), "--json"]) == 0, \
        capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("line", [
    "-O0", "-O 0", "-O=0", "--optimization-level 0", "--optimization_level=0",
    "--compilation-config '{\"cudagraph_mode\": \"NONE\"}'", "-cc '{\"cudagraph_mode\": 0}'",
    "-cc.cudagraph_mode=none", "--compilation-config.cudagraph_mode NONE",
    "--compilation_config.cudagraph_mode=NONE", "-O.cudagraph_mode=NONE",
    "-O3 -cc.cudagraph_mode=NONE",  # a mode given wins over the level's
])
def test_o0_and_cudagraph_mode_none_capture_no_graphs(capsys, tiny_llama_dir, line) -> None:
    plan = _plan(capsys, tiny_llama_dir, line)
    assert plan["classes"]["cuda_graphs"] == 0
    assert main(["plan", str(tiny_llama_dir), *GPU, *shlex.split(line)]) == 0
    assert "cuda graphs       0.0 GiB" in capsys.readouterr().out


@pytest.mark.parametrize("line", [
    "-O1", "-O2", "-O3", "-cc.cudagraph_mode=FULL_DECODE_ONLY",
    "--compilation-config '{\"level\": 3, \"mode\": \"NONE\", \"pass_config\": {}}'",
    "-O0 -cc.cudagraph_mode=PIECEWISE",  # as in vLLM: the mode given wins over -O0's
])
def test_other_levels_and_modes_capture_as_kvledger_does(capsys, tiny_llama_dir, line) -> None:
    assert _plan(capsys, tiny_llama_dir, line)["classes"]["cuda_graphs"] == \
        _plan(capsys, tiny_llama_dir, "")["classes"]["cuda_graphs"] > 0


@pytest.mark.parametrize(("config", "flags"), [
    ("-cc.cudagraph_capture_sizes+ 1,2", "--cudagraph-capture-sizes 1 2"),
    ("--compilation-config '{\"cudagraph_capture_sizes\": [1, 2, 4]}'",
     "--cudagraph-capture-sizes 1 2 4"),
    ("-cc.max_cudagraph_capture_size=8", "--max-cudagraph-capture-size 8"),
])
def test_the_configs_capture_sizes_are_the_flags(capsys, tiny_llama_dir, config, flags) -> None:
    by_config = _plan(capsys, tiny_llama_dir, config)["classes"]["cuda_graphs"]
    assert by_config == _plan(capsys, tiny_llama_dir, flags)["classes"]["cuda_graphs"]
    assert by_config != _plan(capsys, tiny_llama_dir, "")["classes"]["cuda_graphs"]


@pytest.mark.parametrize(("line", "message"), [
    ("-O 7", "error: --optimization-level 7: vLLM's optimization levels are 0, 1, 2 and 3"),
    ("-O7", "error: --optimization-level 7: "),
    ("-Odecode", "error: --optimization-level decode: "),
    ("--compilation-config notjson", "error: --compilation-config notjson: expected a JSON "
     "object of vLLM's compilation config"),
    ("-cc '[1]'", "error: --compilation-config [1]: expected a JSON object"),
    ("-cc.cudagraph_mode=SOMETIMES", "error: --compilation-config: cudagraph_mode must be one "
     "of NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE, got 'SOMETIMES'"),
    ("-cc.cudagraph_mod=NONE", "error: --compilation-config: vLLM 0.32's compilation config "
     "has no key 'cudagraph_mod'"),
    ("-cc.cudagraph_capture_sizes+ 1,x", "error: --compilation-config: "
     "cudagraph_capture_sizes must be positive integers, got 'x'"),
    ("-cc.max_cudagraph_capture_size=8 --max-cudagraph-capture-size 4",
     "error: --max-cudagraph-capture-size and --compilation-config's "
     "max_cudagraph_capture_size are mutually exclusive"),
    ("-cc.cudagraph_capture_sizes+ 1 --cudagraph-capture-sizes 2",
     "error: --cudagraph-capture-sizes and --compilation-config's cudagraph_capture_sizes"),
])
def test_a_bad_level_or_config_is_one_line(capsys, tiny_llama_dir, line, message) -> None:
    for command in ("plan", "serve"):
        assert main([command, str(tiny_llama_dir), *GPU, *shlex.split(line)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1, err


def test_help_says_what_they_do() -> None:
    text = " ".join(build_parser("serve").format_help().split())
    assert "kvledger runs eagerly" not in text
    assert "--optimization-level VALUE vLLM's: -O0 captures no CUDA graphs, as" in text
    assert "cudagraph_mode NONE is --enforce-" in text
