"""Weights from safetensors headers (single, sharded, every dtype) and the model shape."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from budget_checkpoints import write_checkpoint, write_config, write_raw_safetensors
from safetensors import safe_open
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file, save_file, save_model

from kvledger.engine import json_stream
from kvledger.engine.checkpoint.contents import (
    DTYPE_BITS,
    read_model_shape,
    read_safetensors_header,
    read_weights,
)
from kvledger.engine.errors import BadInput


def loaded_bytes(model_dir) -> int:
    """Bytes of every tensor once loaded with safetensors, each name once."""
    seen: dict[str, int] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(f)).items():
            seen.setdefault(name, tensor.nbytes)
    return sum(seen.values())


def test_single_file_predicts_loaded_bytes(tmp_path) -> None:
    tensors = write_checkpoint(tmp_path)
    info = read_weights(tmp_path)
    assert info.total_bytes == sum(t.nbytes for t in tensors.values()) == loaded_bytes(tmp_path)
    assert info.num_tensors == len(tensors)
    assert info.dtype == "BF16"
    assert info.files == (str(tmp_path / "model.safetensors"),)


def test_sharded_checkpoint_predicts_loaded_bytes(tmp_path) -> None:
    tensors = write_checkpoint(tmp_path, shards=3, dtype=torch.float16)
    info = read_weights(tmp_path)
    assert len(info.files) == 3
    assert info.total_bytes == loaded_bytes(tmp_path) == sum(t.nbytes for t in tensors.values())
    assert info.dtype == "F16"


def test_tied_embeddings_saved_by_safetensors_are_counted_once(tmp_path) -> None:
    write_config(tmp_path, tie_word_embeddings=True)
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(256, 64)
    model.lm_head = torch.nn.Linear(64, 256, bias=False)
    model.lm_head.weight = model.embed_tokens.weight  # one storage, two names
    save_model(model, str(tmp_path / "model.safetensors"))
    info = read_weights(tmp_path)
    unique = {t.data_ptr(): t.nbytes for t in model.state_dict().values()}
    assert info.total_bytes == sum(unique.values()) == loaded_bytes(tmp_path) == 256 * 64 * 4


def test_tied_lm_head_stored_beside_the_embedding_is_not_counted(tmp_path) -> None:
    tensors = write_checkpoint(tmp_path, tie_word_embeddings=False)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    info = read_weights(tmp_path)
    assert info.total_bytes == loaded_bytes(tmp_path) - tensors["lm_head.weight"].nbytes
    assert any("lm_head" in s for s in info.skipped)


def test_a_name_in_two_shards_is_counted_once(tmp_path) -> None:
    tensors = write_checkpoint(tmp_path, shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    extra_name = "model.norm.weight"
    other = next(s for s in set(index["weight_map"].values()) if s != index["weight_map"][extra_name])
    stored = load_file(str(tmp_path / other))
    save_file({**stored, extra_name: tensors[extra_name]}, str(tmp_path / other))
    info = read_weights(tmp_path)
    assert info.total_bytes == sum(t.nbytes for t in tensors.values())
    assert info.num_tensors == len(tensors)
    assert any(extra_name in s for s in info.skipped)


def test_every_torch_loadable_dtype(tmp_path) -> None:
    write_config(tmp_path)
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn,
              torch.int16, torch.uint16, torch.float16, torch.bfloat16, torch.int32, torch.uint32,
              torch.float32, torch.float64, torch.int64, torch.uint64]
    tensors = {f"t{i}": torch.zeros(3, 5 + i, dtype=d) for i, d in enumerate(dtypes)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    info = read_weights(tmp_path)
    assert info.total_bytes == loaded_bytes(tmp_path) == sum(t.nbytes for t in tensors.values())
    assert info.num_tensors == len(dtypes)


def test_numpy_written_checkpoint_and_complex(tmp_path) -> None:
    write_config(tmp_path)
    arrays = {"a": np.ones((7, 3), np.float64), "b": np.ones(11, np.complex64),
              "c": np.ones((2, 2), np.uint64)}
    save_numpy(arrays, str(tmp_path / "model.safetensors"))
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        loaded = sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118
    assert read_weights(tmp_path).total_bytes == loaded == sum(a.nbytes for a in arrays.values())


@pytest.mark.parametrize("dtype", sorted(DTYPE_BITS))
def test_every_safetensors_dtype_matches_safe_open(tmp_path, dtype: str) -> None:
    """Each dtype safetensors knows, sub-byte ones included: our bytes == its data region,
    and safetensors itself accepts the header."""
    shape = [4, 6]
    nbytes = 24 * DTYPE_BITS[dtype] // 8
    header = {"x": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}
    path = tmp_path / "model.safetensors"
    write_raw_safetensors(path, header, bytes(nbytes))
    with safe_open(str(path), "np") as f:
        assert list(f.keys()) == ["x"]
    (tensor,) = read_safetensors_header(path)
    assert (tensor.dtype, tensor.shape, tensor.nbytes) == (dtype, (4, 6), nbytes)


def test_model_shape_defaults(tmp_path) -> None:
    write_config(tmp_path, num_key_value_heads=None, head_dim=None)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["num_key_value_heads"], config["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = read_model_shape(tmp_path)
    assert shape.num_kv_heads == shape.num_attention_heads == 4
    assert shape.head_dim == 64 // 4
    assert shape.num_layers == 2 and shape.torch_dtype == "bfloat16"


def test_model_shape_explicit_head_dim_and_text_config(tmp_path) -> None:
    inner = {"hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 32, "num_hidden_layers": 3, "vocab_size": 100,
             "max_position_embeddings": 64, "intermediate_size": 200}
    tmp_path.joinpath("config.json").write_text(json.dumps(
        {"architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "float16",
         "text_config": inner}))
    shape = read_model_shape(tmp_path)
    assert (shape.head_dim, shape.num_kv_heads, shape.num_layers) == (32, 1, 3)
    assert shape.architecture == "Gemma3ForConditionalGeneration"
    assert shape.torch_dtype == "float16"


# --- bad input: one clear BadInput each ---------------------------------------------------

def _one_file(tmp_path, header_bytes: bytes, data: bytes = b"") -> None:
    write_config(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header_bytes)) + header_bytes + data)


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: (write_config(p), (p / "model.safetensors").write_bytes(b"\x01\x02")),
     "truncated"),
    (lambda p: _one_file(p, b"xxxx"), "not valid JSON"),
    (lambda p: (write_config(p), (p / "model.safetensors").write_bytes(
        (10**15).to_bytes(8, "little") + b"{}")), "header length"),
    (lambda p: _one_file(p, json.dumps({"w": {"dtype": "F16", "shape": [4],
                                             "data_offsets": [0, 8]}}).encode(), b"\0" * 4),
     "past the end"),
    (lambda p: _one_file(p, json.dumps({"w": {"dtype": "Q4", "shape": [4],
                                             "data_offsets": [0, 2]}}).encode(), b"\0" * 2),
     "unknown dtype"),
    (lambda p: _one_file(p, json.dumps({"w": {"dtype": "F16", "shape": [4],
                                             "data_offsets": [0, 6]}}).encode(), b"\0" * 6),
     "needs 8 bytes"),
    (lambda p: _one_file(p, json.dumps({"w": {"dtype": "F16", "shape": [-1],
                                             "data_offsets": [0, 2]}}).encode(), b"\0" * 2),
     "bad shape"),
    (lambda p: _one_file(p, json.dumps([1, 2]).encode()), "not a JSON object"),
    (lambda p: _one_file(p, b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},'
                            b' "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}',
                         b"\0\0"), "appears twice"),
    (lambda p: _one_file(p, json.dumps({"w": {"dtype": "U8", "shape": [2],
                                             "data_offsets": [0, 2]}}).encode(), b"\0" * 5),
     "bytes after the last tensor"),
    (lambda p: write_config(p), "no *.safetensors"),
    # Hostile headers: nested past the parser's recursion, a dimension of 400 digits.
    (lambda p: _one_file(p, b'{"w": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
     "JSON nested too deeply"),
    (lambda p: _one_file(p, b"[" * 200_000 + b"]" * 200_000), "not a JSON object"),
    (lambda p: _one_file(p, json.dumps({"w": {"dtype": "F32", "shape": [10**400],
                                             "data_offsets": [0, 4]}}).encode(), b"\0" * 4),
     r"F32\[100\.\.\.\(401 digits\)\] needs 400\.\.\.\(401 digits\) bytes"),
])
@pytest.mark.parametrize("whole", [True, False], ids=["parsed-whole", "member-by-member"])
def test_corrupt_checkpoints_are_bad_input(tmp_path, make, message: str, whole: bool,
                                           monkeypatch) -> None:
    """Each refused alike whether its header is parsed at once (a header of up to 1 MiB)
    or read member by member (a larger one)."""
    if not whole:
        monkeypatch.setattr(json_stream, "WHOLE_MAX_CHARS", 0)
    make(tmp_path)
    with pytest.raises(BadInput, match=message.replace("*", r"\*")):
        read_weights(tmp_path)


def test_index_naming_a_missing_shard(tmp_path) -> None:
    write_checkpoint(tmp_path, shards=2)
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(BadInput, match="which is missing"):
        read_weights(tmp_path)


def test_index_mapping_a_tensor_to_the_wrong_shard(tmp_path) -> None:
    write_checkpoint(tmp_path, shards=2)
    path = tmp_path / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    path.write_text(json.dumps(index))
    with pytest.raises(BadInput, match="does not contain it"):
        read_weights(tmp_path)


def test_index_escaping_the_model_dir(tmp_path) -> None:
    write_config(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../evil.safetensors"}}))
    with pytest.raises(BadInput, match="outside the model directory"):
        read_weights(tmp_path)


@pytest.mark.parametrize("shard", ["../evil.safetensors", "/etc/evil.safetensors",
                                   "a\\..\\evil.safetensors", "q" * 300 + ".safetensors",
                                   "sub/" + "\u00e9" * 128 + ".safetensors"])
def test_an_index_naming_a_shard_no_folder_holds_is_refused_by_every_reader(tmp_path,
                                                                          shard) -> None:
    """The planner, the loader's file list and the hub's listing refuse alike a shard the
    index names outside the folder or by a name no file system holds (a part of 300
    characters, or 256 bytes of UTF-8, raised OSError from stat: a traceback)."""
    from kvledger.engine.checkpoint.files import checkpoint_files

    write_config(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": shard}}))
    refused = "outside the model directory|longer than 255 bytes"
    with pytest.raises(BadInput, match=refused):
        read_weights(tmp_path)
    with pytest.raises(BadInput, match=refused):
        checkpoint_files(tmp_path)


def test_a_shard_path_longer_than_a_path_may_be_is_missing_not_a_traceback(tmp_path) -> None:
    """Twenty parts of 240 characters each: every part a file system holds, the whole more
    than a path may be (4,096 bytes). stat's ENAMETOOLONG was an OSError traceback in plan,
    preflight and the loader; the shard is missing, as a file that is not there."""
    from kvledger.engine.checkpoint.model_config import ModelConfig
    from kvledger.engine.model.loader import load_model

    write_checkpoint(tmp_path, shards=2)
    index = tmp_path / "model.safetensors.index.json"
    shards = json.loads(index.read_text())
    name, _ = next(iter(shards["weight_map"].items()))
    shards["weight_map"][name] = "/".join(["q" * 240] * 20) + ".safetensors"
    index.write_text(json.dumps(shards))
    with pytest.raises(BadInput, match=r"names shard 'q+\.\.\. \(\d+ chars\), which is missing"):
        read_weights(tmp_path)
    with pytest.raises(BadInput, match="listed in the index but missing"):
        load_model(tmp_path, ModelConfig.from_dir(tmp_path), torch.float32, torch.device("cpu"))


LLAMA = {"architectures": ["LlamaForCausalLM"]}


@pytest.mark.parametrize(("config", "message"), [
    (None, r"no config\.json \(expected a Hugging Face checkpoint directory\)"),
    ("{not json", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (json.dumps({"hidden_size": 64}), r"unsupported architecture \(none given\) for planning"),
    (json.dumps({**LLAMA, "hidden_size": 64}), "no 'num_attention_heads'"),
    (json.dumps({**LLAMA, "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 0,
                 "vocab_size": 10, "max_position_embeddings": 8}), "num_hidden_layers"),
    (json.dumps({**LLAMA, "hidden_size": 65, "num_attention_heads": 4, "num_hidden_layers": 1,
                 "vocab_size": 10, "max_position_embeddings": 8}), "not divisible"),
])
def test_bad_config_is_bad_input(tmp_path, config, message: str) -> None:
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    with pytest.raises(BadInput, match=message):
        read_model_shape(tmp_path)


def test_missing_model_dir_is_bad_input(tmp_path) -> None:
    with pytest.raises(BadInput, match="does not exist"):
        read_model_shape(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(BadInput, match="not a directory"):
        read_weights(tmp_path / "file")


def test_unreadable_model_dir_is_bad_input(tmp_path, monkeypatch) -> None:
    # chmod cannot lock out root (these tests may run as root), so deny the access check.
    write_checkpoint(tmp_path)
    monkeypatch.setattr("kvledger.engine.checkpoint.contents.os.access", lambda *a, **k: False)
    with pytest.raises(BadInput, match="is not readable"):
        read_weights(tmp_path)


def test_unreadable_shard_is_bad_input(tmp_path) -> None:
    write_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").mkdir()  # a directory where a file should be
    with pytest.raises(BadInput, match="cannot read"):
        read_weights(tmp_path)


# --- read as transformers reads it, as the engine does ------------------------------------

def test_a_null_head_dim_is_hidden_size_over_heads(tmp_path) -> None:
    """transformers writes ``"head_dim": null`` into Mixtral's (and others') config.json and
    reads it as hidden_size / num_attention_heads; so does the engine."""
    write_config(tmp_path, architectures=["MixtralForCausalLM"], head_dim=None,
                 num_local_experts=4, num_experts_per_tok=2)
    shape = read_model_shape(tmp_path)
    assert shape.head_dim == 64 // 4 == shape.kv_layout().layers[0].head_size


@pytest.mark.parametrize(("layers", "window_layers", "sliding"), [
    (30, None, [28, 29]),  # transformers' Qwen2Config: max_window_layers 28 when left out
    (4, None, []),
    (4, 1, [1, 2, 3]),
    (4, 0, [0, 1, 2, 3]),
])
def test_qwen2_max_window_layers_defaults_to_transformers_28(tmp_path, layers, window_layers,
                                                             sliding) -> None:
    extra = {} if window_layers is None else {"max_window_layers": window_layers}
    write_config(tmp_path, architectures=["Qwen2ForCausalLM"], num_hidden_layers=layers,
                 use_sliding_window=True, sliding_window=32, **extra)
    kinds = read_model_shape(tmp_path).kv_layout().layers
    assert [i for i, la in enumerate(kinds) if la.attention == "sliding"] == sliding
    assert {la.sliding_window for la in kinds if la.attention == "sliding"} <= {32}
