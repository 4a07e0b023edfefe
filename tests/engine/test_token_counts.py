"""``--max-model-len 32k`` as vLLM 0.32 reads it (``human_readable_int``): a lowercase
suffix decimal, an uppercase one binary and whole, on every command that takes the flag
(``plan``, ``preflight``, ``serve``, a ``--config`` file) through one parser; and
``--max-num-batched-tokens``, which vLLM reads the same way."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from _server_helpers import free_port, reap, wait_for_serve

from kvledger.engine import LLM
from kvledger.engine.cli import main
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.vllm_numbers import human_readable_int

# vLLM's own examples (its docstring), and the rest of its grammar.
VLLM_READS = [("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("2M", 2 * 2**20),
              ("1m", 10**6), ("1g", 10**9), ("1G", 2**30), ("1T", 2**40), (" 32k ", 32000),
              ("4096", 4096)]


@pytest.mark.parametrize(("text", "count"), VLLM_READS)
def test_counts_read_as_vllm_reads_them(text, count) -> None:
    assert human_readable_int(text) == count


@pytest.mark.parametrize(("given", "tokens"), [("1k", 1000), ("1K", 1024), ("0.5k", 500),
                                               ("512", 512)])
def test_plan_and_preflight_take_a_human_readable_context(given, tokens, tiny_llama_dir,
                                                          capsys, tmp_path) -> None:
    flags = ["--model", str(tiny_llama_dir), "--device", "cpu", "--max-model-len", given,
             "--max-num-batched-tokens", "2K"]
    assert main(["plan", *flags, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["max_model_len"], plan["max_num_batched_tokens"]) == (tokens, 2048)
    out = tmp_path / "plan.json"
    assert main(["preflight", *flags, "--plan-out", str(out)]) == 0
    assert json.loads(out.read_text())["max_model_len"] == tokens
    capsys.readouterr()  # the pre-flight's report
    config = tmp_path / "vllm.yaml"  # vLLM's --config file, as the launch line carries it
    config.write_text(f"max-model-len: {given}\nmax_num_batched_tokens: 2K\n")
    assert main(["plan", "--model", str(tiny_llama_dir), "--device", "cpu", "--config",
                 str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_model_len"] == tokens


@pytest.mark.parametrize(("given", "message"), [
    ("1.5K", "'1.5K': a binary suffix such as K takes whole numbers; did you mean 1.5k?"),
    ("auto", "'auto' (vLLM's longest context that fits) is not supported: leave the flag "
             "out for the model's own context, or give a count"),
    ("-1", "'-1' (vLLM's longest context that fits) is not supported"),
    ("32kb", "expected a count of tokens, e.g. 32768, 32k (32,000), 32K (32,768) or 25.6k; "
             "got '32kb'"),
    ("0k", "expected a positive count of tokens, got '0k'"),
])
def test_what_vllm_refuses_is_one_line_naming_the_form(given, message, tiny_llama_dir,
                                                       capsys) -> None:
    assert main(["plan", str(tiny_llama_dir), "--max-model-len", given]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-model-len" in err and message in err, err


def test_the_python_api_takes_a_count_as_vllms_does(tiny_llama_dir) -> None:
    """vLLM's ``LLM(max_model_len=...)`` takes an int (its ModelConfig refuses "32k"):
    the string forms are the command line's."""
    with pytest.raises(BadInput, match="--max-model-len must be a positive integer, got '1k'"):
        LLM(str(tiny_llama_dir), device="cpu", max_model_len="1k")


def test_serve_runs_with_a_human_readable_context(tiny_llama_dir) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvledger.engine.cli", "serve",
                             str(tiny_llama_dir), "--device", "cpu", "--max-model-len", "0.5k",
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_serve(proc, port)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            assert json.load(r)["data"][0]["max_model_len"] == 500
    finally:
        reap(proc)
