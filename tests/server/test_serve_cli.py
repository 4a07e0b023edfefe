"""``kvledger serve`` flag and start-up errors: one line, a distinct exit code, no traceback."""

from __future__ import annotations

import socket

import pytest

from kvledger.engine.cli import main


@pytest.mark.parametrize("flags", [
    ["--max-queue-wait", "-1"],
    ["--shutdown-grace", "soon"],
    ["--max-body-bytes", "lots"],
    ["--max-body-bytes", "0"],
])
def test_bad_server_flags_exit_2(tmp_path, capsys, flags):
    assert main(["serve", "--model", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and flags[0] in err


def test_bad_port_and_missing_checkpoint_exit_2(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path), "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    code = main(["serve", "--model", str(tmp_path / "nothing"), "--device", "cpu",
                 "--host", "127.0.0.1", "--port", "0", "--log-level", "error"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_port_in_use_exits_1(tiny_llama_dir, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--model", str(tiny_llama_dir), "--device", "cpu",
                     "--host", "127.0.0.1", "--port", str(port), "--log-level", "error"])
    assert code == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["a" * 64 + ".example", "[" * 300, "x\ny"])
def test_a_host_no_resolver_can_spell_exits_1_in_one_line(tmp_path, capsys, host):
    """A --host whose label IDNA cannot encode (over 63 characters) raised UnicodeError, a
    traceback; one with a newline split the error over two lines."""
    code = main(["serve", "--model", str(tmp_path / "nothing"), "--device", "cpu",
                 "--host", host, "--port", "0", "--log-level", "error"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: cannot listen on ") and err.count("\n") == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize(("method", "quantization_config", "message"), [
    ("hqq", True, "error: checkpoint is quantized with 'hqq' (quantization_config.quant_method); "),
    ("gguf", True, "error: checkpoint is quantized with 'gguf' "),
    ("gptq", {"quant_method": "gptq", "bits": 8, "group_size": 128},
     "error: checkpoint's 4-bit quantization has gptq bits 8; kvledger's engine serves 4-bit "),
    ("bitsandbytes", True, "error: checkpoint is quantized with 'bitsandbytes' "),
    ("fp8", False, "error: checkpoint has tensors kvledger's engine does not load for "
                   "LlamaForCausalLM: 'model.layers.0.mlp.down_proj.input_scale', "),
])
def test_a_quantized_checkpoint_is_refused_before_loading(tmp_path, capsys, monkeypatch, method,
                                                          quantization_config, message):
    """The crash loop of a quantized checkpoint (the loader's `checkpoint does not match
    LlamaForCausalLM: unexpected [...input_scale...]`, or weights cast as values): refused
    by name, exit 2, before a tensor is read."""
    from budget_checkpoints import write_quantized

    from kvledger.engine.checkpoint.model_config import SERVED_WEIGHTS
    from kvledger.engine.model.loader import Weights

    def no_loading(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(Weights, "load", no_loading)
    write_quantized(tmp_path, method, quantization_config=quantization_config)
    code = main(["serve", "--model", str(tmp_path), "--device", "cpu", "--host", "127.0.0.1",
                 "--port", "0", "--log-level", "error"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err
    from kvledger.engine.checkpoint.int4_format import SERVED_4BIT

    assert err.endswith(f"; {SERVED_4BIT if method == 'gptq' else SERVED_WEIGHTS}\n")
