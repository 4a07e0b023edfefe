"""--safetensors-load-strategy (checkpoint/read_ahead.py): vLLM's rule for reading a
checkpoint's files ahead, the read ahead itself, and the loader taking the same tensors
whichever way the files are read."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.checkpoint.read_ahead import (
    ReadAhead,
    WeightReading,
    filesystem_type,
    prefetches,
    read_whole,
)
from kvledger.engine.core.rank_messages import RankSpec
from kvledger.engine.errors import BadInput
from kvledger.engine.model import loader
from kvledger.engine.settings.config import EngineConfig

GIB = 2**30


@pytest.fixture
def mounts(tmp_path):
    table = tmp_path / "mounts"
    table.write_text("overlay / overlay rw 0 0\n"
                     "server:/export /data nfs4 rw,relatime 0 0\n"
                     "/dev/nvme0n1 /data/local ext4 rw 0 0\n"
                     "lustre@tcp:/fs /mnt/my\\040models lustre rw 0 0\n")
    return table


@pytest.fixture
def shards(tmp_path):
    """Three files of different sizes, as a sharded checkpoint's."""
    folder = tmp_path / "shards"
    folder.mkdir()
    files = []
    for i, size in enumerate((3 << 20, 1 << 20, (5 << 20) + 7)):
        path = folder / f"model-{i:05d}.safetensors"
        path.write_bytes(bytes([i + 1]) * size)
        files.append(path)
    return files


def test_the_filesystem_is_the_longest_mount_point_holding_the_path(mounts):
    assert filesystem_type("/data/model/a.safetensors", mounts) == "nfs4"
    assert filesystem_type("/data/local/model", mounts) == "ext4"
    assert filesystem_type("/datastore/x", mounts) == "overlay"  # not below /data
    assert filesystem_type("/mnt/my models/x", mounts) == "lustre"  # an escaped space
    assert filesystem_type("/x", mounts.parent / "absent") == ""


def test_vllms_rule_prefetches_a_network_or_fuse_filesystem_when_the_files_fit(
        shards, mounts, monkeypatch, caplog):
    monkeypatch.setattr("kvledger.engine.checkpoint.read_ahead.filesystem_type",
                        lambda path, _mounts: {"nfs": "nfs4", "local": "ext4",
                                               "bucket": "fuse.gcsfuse",
                                               "container": "fuse.fuse-overlayfs"}[where])
    size = sum(f.stat().st_size for f in shards)
    default, asked = WeightReading(), WeightReading("prefetch")
    caplog.set_level(logging.INFO, "kvledger.engine")
    where = "nfs"
    assert prefetches(default, shards, available_bytes=GIB)
    assert "prefetching them (a network or FUSE filesystem" in caplog.text
    assert not prefetches(default, shards, available_bytes=size)  # 90% of it is too little
    assert "more than fits in memory" in caplog.text
    where = "local"
    assert not prefetches(default, shards, available_bytes=GIB)
    assert "not a network or FUSE filesystem" in caplog.text
    assert prefetches(asked, shards, available_bytes=GIB)
    caplog.clear()
    assert prefetches(asked, shards, available_bytes=size)  # asked: read ahead all the same
    assert "though they do not fit in 90% of it" in caplog.text
    where = "bucket"  # a bucket mounted through FUSE: as a network filesystem
    assert prefetches(default, shards, available_bytes=GIB)
    where = "container"  # a rootless container's own files, FUSE but local
    assert not prefetches(default, shards, available_bytes=GIB)
    where = "nfs"
    assert not prefetches(WeightReading("lazy"), shards, available_bytes=GIB)
    assert not prefetches(WeightReading("eager"), shards, available_bytes=GIB)
    assert not prefetches(asked, [], available_bytes=GIB)


def test_read_whole_reads_every_byte_in_blocks(shards, monkeypatch):
    assert read_whole(shards[2], block_bytes=1 << 20) == (5 << 20) + 7
    import errno
    import os

    def unsupported(*_args):  # a filesystem sendfile cannot read from
        raise OSError(errno.EINVAL, "sendfile")

    monkeypatch.setattr(os, "sendfile", unsupported)
    assert read_whole(shards[2], block_bytes=64 << 30) == (5 << 20) + 7  # pread, 16 MiB a go


def test_the_read_ahead_reads_every_file_and_ranks_share_them(shards, caplog):
    caplog.set_level(logging.INFO, "kvledger.engine")
    whole = ReadAhead(shards, WeightReading("prefetch", threads=8, block_bytes=1 << 20)).start()
    whole.join(timeout=30)
    assert whole.bytes_read == sum(f.stat().st_size for f in shards) and not whole.failed
    assert "prefetching 3 checkpoint files into the page cache in the background (3 threads" \
        in caplog.text  # no more threads than files
    assert "prefetched 3 checkpoint files (0.01 GiB)" in caplog.text
    parts = [ReadAhead(shards, WeightReading("prefetch", share=(i, 2))) for i in range(2)]
    assert [p.files for p in parts] == [[shards[0], shards[2]], [shards[1]]]


def test_a_file_the_read_ahead_cannot_read_is_a_warning(shards, caplog):
    shards[1].unlink()  # gone between the listing and the read
    ahead = ReadAhead(shards, WeightReading("prefetch", threads=3)).start()
    ahead.join(timeout=30)
    assert ahead.failed == [shards[1]]
    assert ahead.bytes_read == shards[0].stat().st_size + shards[2].stat().st_size
    assert "the loader reads it itself" in caplog.text


def test_a_ranks_share_is_its_place_on_its_own_machine():
    spec = RankSpec(model_dir="/m", world=4, device="cuda", dtype="bfloat16", max_model_len=8,
                    block_size=16, master_port=1, timeout_s=1.0, nodes=2,
                    weight_reading=WeightReading("prefetch", threads=3))
    assert [spec.reading(rank).share for rank in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert spec.reading(3) == WeightReading("prefetch", 3, 16 << 20, share=(1, 2))
    from kvledger.engine.core.rank_messages import Start
    from kvledger.engine.core.wire import decode, encode

    assert decode(encode(Start(spec))).spec == spec  # as machine 0 sends it to the others


@pytest.fixture
def sharded_tiny(tmp_path, sharded_tiny_llama_dir):
    """A copy of the two-shard tiny-llama (a test may remove a shard)."""
    import shutil

    return Path(shutil.copytree(sharded_tiny_llama_dir, tmp_path / "sharded"))


@pytest.mark.parametrize("strategy", ["lazy", "eager", "prefetch"])
def test_every_strategy_loads_the_same_tensors(sharded_tiny, strategy, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "kvledger.engine")
    wholes = []
    monkeypatch.setattr(loader, "read_whole",
                        lambda path, block: wholes.append(path.name) or path.stat().st_size)
    config = ModelConfig.from_dir(sharded_tiny)
    cpu = torch.device("cpu")
    plain = loader.load_model(sharded_tiny, config, torch.float32, cpu).state_dict()
    read = loader.load_model(sharded_tiny, config, torch.float32, cpu,
                             reading=WeightReading(strategy, threads=2)).state_dict()
    assert plain.keys() == read.keys() and all(torch.equal(plain[k], read[k]) for k in plain)
    # eager reads each file whole before taking its tensors; prefetch reads them all ahead
    assert wholes == (["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
                      if strategy == "eager" else [])
    assert ("prefetched 2 checkpoint files" in caplog.text) == (strategy == "prefetch")


def test_eager_still_names_a_missing_shard(sharded_tiny):
    (sharded_tiny / "model-00002-of-00002.safetensors").unlink()
    config = ModelConfig.from_dir(sharded_tiny)
    with pytest.raises(BadInput, match="listed in the index but missing"):
        loader.load_model(sharded_tiny, config, torch.float32, torch.device("cpu"),
                          reading=WeightReading("eager"))


def test_the_flags_are_vllms_and_torchao_is_refused_by_name(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), safetensors_load_strategy="prefetch",
                          safetensors_prefetch_num_threads=4,
                          safetensors_prefetch_block_size=1 << 20)
    assert config.weight_reading == WeightReading("prefetch", 4, 1 << 20)
    assert EngineConfig(model=str(tiny_llama_dir)).weight_reading == WeightReading()
    for bad, said in (({"safetensors_load_strategy": "torchao"}, "torchao's tensor subclasses"),
                      ({"safetensors_prefetch_num_threads": 0}, "num-threads")):
        with pytest.raises(BadInput, match=said):
            EngineConfig(model=str(tiny_llama_dir), **bad)
    result = subprocess.run([sys.executable, "-m", "kvledger.engine.cli", "plan",
                             str(tiny_llama_dir), "--safetensors-load-strategy", "torchao"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --safetensors-load-strategy torchao: kvledger does not read torchao's "
        "tensor subclasses; lazy, eager or prefetch"]


def test_the_engine_reads_the_checkpoint_as_its_flag_says(tiny_llama_dir, caplog):
    """The flag reaches the engine's load (startup.py's Weights, read again on waking from
    sleep level 2), and the engine answers the same as without it."""
    from kvledger.engine.llm import LLM
    from kvledger.engine.sampling.params import SamplingParams

    caplog.set_level(logging.INFO, "kvledger.engine")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ahead = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64,
                safetensors_load_strategy="prefetch", safetensors_prefetch_num_threads=2)
    assert ahead.engine.runner.weights.reading == WeightReading("prefetch", 2)
    assert "prefetched 1 checkpoint files" in caplog.text
    plain = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64)
    prompt = [[1, 5, 9, 2]]
    assert (ahead.generate(prompt, greedy)[0].outputs[0].token_ids
            == plain.generate(prompt, greedy)[0].outputs[0].token_ids)
