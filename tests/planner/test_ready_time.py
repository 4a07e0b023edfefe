"""Time to ready (planner/ready_time.py): the read predicted from a timed read of the
weights' own files (planner/read_speed.py), the phases measured."""

from __future__ import annotations

import threading
import time

import pytest

from kvledger.engine.checkpoint.read_ahead import WeightReading
from kvledger.engine.planner import read_speed, ready_time
from kvledger.engine.planner.read_speed import ReadSpeed, measure_read
from kvledger.engine.planner.ready_time import PHASES, TimeToReady, predict


def test_a_timed_read_of_the_largest_file_predicts_the_whole(tmp_path):
    small, big = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    small.write_bytes(b"x" * 1000)
    big.write_bytes(b"y" * (40 << 20))
    speed = measure_read([small, big], sample_bytes=16 << 20)
    assert speed.bytes == 16 << 20 and speed.seconds > 0  # from the big one's middle on
    ready = predict([small, big, tmp_path / "missing.safetensors"])
    assert ready.weight_file_bytes == 1000 + (40 << 20)
    # (the unsampled bytes and the sampled ones each at that speed: equal up to rounding)
    assert ready.predicted["read"] == pytest.approx(
        ready.weight_file_bytes / ready.read_speed.bytes_per_s, rel=1e-12)
    assert [ready.predicted[p] for p in PHASES[1:]] == [None] * (len(PHASES) - 1)
    assert predict([]).predicted["read"] is None and measure_read([]) is None


def test_the_mapped_read_faults_in_as_many_threads_as_the_loader(tmp_path, monkeypatch):
    """On the CPU the loader's first pass over a tensor splits it among torch's threads,
    whose page faults a disk serves side by side: the timed read faults so too, each
    thread over its own contiguous share of the sample, from the file's middle on."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(range(256)) * ((64 << 20) // 256))
    copies: list[tuple[int, int, int]] = []
    real = read_speed.ctypes.memmove

    def memmove(dst, src, count):
        copies.append((threading.current_thread().name, src, count))  # idents are reused
        return real(dst, src, count)

    monkeypatch.setattr(read_speed.ctypes, "memmove", memmove)
    speed = measure_read([path], sample_bytes=32 << 20, max_seconds=60, faults=2)
    assert speed.bytes == 32 << 20
    threads = {ident for ident, *_ in copies}
    assert len(threads) == 2
    starts = sorted(min(src for ident, src, _ in copies if ident == t) for t in threads)
    ends = sorted(max(src + n for ident, src, n in copies if ident == t) for t in threads)
    assert starts[1] - starts[0] == 16 << 20 == ends[0] - starts[0] == ends[1] - starts[1]
    copies.clear()
    assert measure_read([path], 32 << 20, max_seconds=60).bytes == 32 << 20  # one: the default
    assert len({ident for ident, *_ in copies}) == 1


def test_a_read_ahead_is_predicted_from_files_read_side_by_side(tmp_path, monkeypatch):
    """Where the loader will read the files ahead, several at once, the prediction times
    them so: the largest files, a share of the sample from each one's middle."""
    files = [tmp_path / f"model-{i}.safetensors" for i in range(3)]
    for path in files:
        path.write_bytes(b"z" * (24 << 20))
    speed = measure_read(files, sample_bytes=24 << 20, threads=3)
    assert speed.bytes == 24 << 20  # 8 MiB from each
    timed = []
    real = ready_time.measure_read
    monkeypatch.setattr(ready_time, "measure_read",
                        lambda found, threads=1, sample_bytes=None, faults=1: (
                            timed.append((threads, sample_bytes))
                            or real(found, sample_bytes=sample_bytes or 8 << 20,
                                    threads=threads, faults=faults)))
    ahead = predict(files, WeightReading("prefetch", threads=8))
    # read side by side, then the largest file's share again through a map, as the loader
    # takes the pages the read ahead has read: the slower of the two counts
    assert timed == [(8, None), (1, read_speed.SAMPLE_BYTES // 3)]
    slower = min(ahead.read_speed.bytes_per_s, ahead.mapped_speed.bytes_per_s)
    assert ahead.predicted["read"] == pytest.approx(ahead.weight_file_bytes / slower)
    assert ahead.to_json()["mapped_bytes_per_s"] == round(ahead.mapped_speed.bytes_per_s)
    timed.clear()
    assert predict(files, WeightReading("lazy")).mapped_speed is None
    predict(files, WeightReading("eager"))
    predict(files)  # a local disk: not read ahead unasked
    assert timed == [(1, None)] * 3


def test_phases_are_timed_and_reported_predicted_against_measured():
    ready = TimeToReady(10 << 20, None)
    with ready.phase("read"):
        time.sleep(0.02)
    with ready.phase("warmup"):
        pass
    with ready.phase("warmup"):  # a second warm-up replaces the first
        time.sleep(0.01)
    assert ready.measured["read"] >= 0.02 and ready.measured["warmup"] >= 0.01
    body = ready.to_json()
    assert body["predicted_s"]["read"] is None and body["read_bytes_per_s"] is None
    assert body["measured_total_s"] == round(sum(ready.measured.values()), 3)
    assert ready.describe().startswith("time to ready: read 0.0")


def test_a_sparse_file_is_not_timed(tmp_path):
    """A header mirror's shards (and a benchmark's sparse checkpoint) are holes: reading
    them times nothing, so no prediction is made from them."""
    sparse = tmp_path / "model.safetensors"
    with open(sparse, "wb") as f:
        f.write(b"h" * 4096)
        f.truncate(64 << 20)
    assert measure_read([sparse]) is None
    assert predict([sparse]).predicted["read"] is None


def test_a_file_whose_holes_cannot_be_told_is_timed(tmp_path, monkeypatch):
    """Where the filesystem cannot say where data lies (FUSE mounts of buckets report no
    blocks, some support no SEEK_DATA), the file counts as data and is timed."""
    import errno

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"w" * (24 << 20))

    def unsupported(fd, offset, whence):
        raise OSError(errno.EINVAL, "no SEEK_DATA here")

    monkeypatch.setattr(read_speed.os, "lseek", unsupported)
    assert measure_read([path]).bytes == 12 << 20  # from the middle to the end


def test_plan_predicts_the_read_and_the_operator_shows_it(tmp_path, capsys):
    """``kvledger plan`` (and the pod's pre-flight, whose plan line the operator copies into
    ``status.plan``) predicts the start's read from a timed read of the checkpoint; a run
    that is refused shows no prediction in its report (it never starts)."""
    import json

    from kvledger.engine import cli
    from kvledger.engine.model.builtin import write_model
    from kvledger.engine.planner.plan_line import read_plan_line
    from kvledger.operator.controller.status import plan_status

    model = write_model("tiny-llama", tmp_path / "m")
    args = ["plan", "--model", str(model), "--device", "cpu", "--memory-limit", "2GiB"]
    assert cli.main([*args, "--json"]) == 0
    ready = json.loads(capsys.readouterr().out)["time_to_ready"]
    files = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    assert ready["weight_file_bytes"] == files and ready["read_bytes_per_s"] > 0
    assert ready["predicted_s"]["read"] == round(files / ready["read_bytes_per_s"], 3)
    assert cli.main(args) == 0
    assert "time to ready: reading the weights ~" in capsys.readouterr().out
    assert cli.main([*args[:-1], "1MiB"]) == 3
    assert "time to ready" not in capsys.readouterr().err
    out = tmp_path / "plan.json"
    log = tmp_path / "termination-log"
    assert cli.main(["preflight", *args[1:], "--plan-out", str(out),
                     "--termination-log", str(log)]) == 0
    _, figures = read_plan_line(log.read_text())
    status = plan_status(figures)
    assert status["timeToReady"]["predictedS"]["read"] == figures["time_to_ready"][
        "predicted_s"]["read"]
    assert status["timeToReady"]["weightFileBytes"] == files


def _shape(**moe):
    from kvledger.engine.checkpoint.model_config import ModelConfig
    from kvledger.engine.checkpoint.moe_config import MoEConfig

    return ModelConfig(
        architecture="LlamaForCausalLM", num_layers=2, num_attention_heads=4, num_kv_heads=2,
        head_dim=8, hidden_size=32, intermediate_size=64, vocab_size=100,
        max_position_embeddings=64, torch_dtype="float32", rms_norm_eps=1e-5,
        rope_theta=1e4, rope_scaling=None, qkv_bias=False, o_bias=False, sliding_window=None,
        moe=MoEConfig(**moe) if moe else None)


def test_the_profiled_steps_arithmetic_is_counted_from_the_shape():
    from kvledger.engine.planner.ready_time import profile_flops

    # 2 layers: q 32x32, k and v 32x16 each, o 32x32, an MLP of 3 x 32x64; 2 per multiply-add.
    per_token = 2 * 2 * (32 * (32 + 2 * 16) + 32 * 32 + 3 * 32 * 64)
    # 20 tokens as prompts of 9 (max_model_len 10): 9, 9, 2; causal scores and sums.
    attention = 2 * 32 * 2 * (9 * 10 + 9 * 10 + 2 * 3)
    logits = 2 * 32 * 100 * (3 + 4)
    assert profile_flops(_shape(), 20, 10, mixed_step=False, max_num_seqs=4,
                         logit_rows=4) == per_token * 20 + attention + logits
    # Off the CPU the mixed step too: 3 decodes at the full context beside a chunk of 17.
    mixed = per_token * 20 + 2 * 2 * 32 * 2 * (3 + 17) * 9 + 2 * 32 * 100 * 4
    assert profile_flops(_shape(), 20, 10, mixed_step=True, max_num_seqs=4,
                         logit_rows=4) == per_token * 20 + attention + logits + mixed


def test_a_routed_mlp_counts_only_the_experts_a_token_meets():
    from kvledger.engine.planner.ready_time import profile_flops

    dense = profile_flops(_shape(), 16, 17, mixed_step=False, max_num_seqs=1, logit_rows=0)
    routed = profile_flops(_shape(num_experts=8, num_experts_per_tok=2, intermediate_size=64,
                                  normalize_topk=True, sparse_layers=(1,)),
                           16, 17, mixed_step=False, max_num_seqs=1, logit_rows=0)
    # Layer 1's MLP: 2 experts of 3 x 32x64 and the router's 32x8, in place of one dense.
    assert routed - dense == 2 * 16 * (2 * 3 * 32 * 64 + 32 * 8 - 3 * 32 * 64)


def test_the_profile_and_the_pool_are_predicted_from_timed_probes():
    ready = TimeToReady(0, None, profile_flops=4e9, matmul_flops_per_s=2e9, kv_bytes=1 << 30)
    assert ready.predicted["profile"] == 2.0 and ready.predicted["kv"] is None
    ready.place_speed = ReadSpeed(1 << 30, 0.5)
    assert ready.predicted["kv"] == 0.5
    assert ready.predicted["graphs"] is None and ready.predicted["warmup"] is None
    assert ready.to_json()["profile_flops"] == 4_000_000_000


def test_the_warm_up_and_the_capture_are_predicted_from_a_steps_cost():
    from kvledger.engine.planner.ready_time import WARMUP_STEPS, StepCost

    # 1 GiB of weights streamed at 4 GiB/s: 0.25 s a step; 10 layers at 2 ms, 5 ms a step.
    ready = TimeToReady(0, None, weight_bytes=1 << 30, num_layers=10,
                        stream_speed=ReadSpeed(4 << 30, 1.0))
    assert ready.predicted["warmup"] is None  # no step's cost timed: not predicted
    ready.step_cost = StepCost(per_layer=0.002, per_step=0.005, new_shape=0.003)
    eager = 0.25 + 10 * 0.002 + 0.005
    assert WARMUP_STEPS == 4  # and two new shapes: the prompt's step, the decodes'
    assert ready.predicted["warmup"] == pytest.approx(4 * eager + 2 * 0.003)
    assert ready.predicted["graphs"] is None  # nothing captured
    # Captured: the prompt's step eager, the decodes replayed (no layer's dispatch), and
    # the capture two forwards (one run, one captured) of each size, LM head aside.
    ready.graph_sizes = 3
    assert ready.predicted["warmup"] == pytest.approx(eager + 3 * (0.25 + 0.005) + 0.003)
    assert ready.predicted["graphs"] == pytest.approx(2 * 3 * (0.25 + 10 * 0.002))
    body = ready.to_json()
    assert body["stream_bytes_per_s"] == 4 << 30
    assert body["step_cost_s"] == {"per_layer": 0.002, "per_step": 0.005, "new_shape": 0.003}


def test_the_timing_that_decides_packing_is_part_of_the_predicted_read():
    from kvledger.engine.model.cpu_linear import MEASURE_MIN_BYTES, SAMPLE_BYTES, measured_bytes

    assert measured_bytes(MEASURE_MIN_BYTES - 1) == 0  # packed unmeasured
    assert measured_bytes(1 << 40) == 2 * 3 * 3 * SAMPLE_BYTES  # dense and packed, 3 rows, 3x
    ready = TimeToReady(1 << 30, ReadSpeed(256 << 20, 0.25), weight_bytes=1 << 30,
                        place_speed=ReadSpeed(1 << 30, 0.5), pack_speed=ReadSpeed(1 << 30, 0.25))
    read = 0.75 + 0.125  # the files (the timed read's own bytes copied from the page cache)
    assert ready.predicted["read"] == pytest.approx(read + 0.5 + 0.25)  # placed, packed
    ready.stream_speed, ready.pack_timing_bytes = ReadSpeed(4 << 30, 1.0), 2 << 30
    assert ready.predicted["read"] == pytest.approx(read + 0.5 + 0.25 + 0.5)
    assert ready.to_json()["pack_timing_bytes"] == 2 << 30


def test_the_read_counts_a_copy_only_where_loading_copies():
    """On the CPU in the checkpoint's own dtype the loaded tensors are views of the files'
    maps: reading them is the first pass over them, no copy of its own. The timed read's
    bytes are in the page cache when the loader comes: copied out, not read again."""
    ready = TimeToReady(1 << 30, ReadSpeed(256 << 20, 0.5), weight_bytes=1 << 30,
                        place_speed=ReadSpeed(1 << 30, 0.25))
    assert ready.predicted["read"] == pytest.approx(1.5 + 0.0625 + 0.25)
    ready.copies_weights = False
    assert ready.predicted["read"] == pytest.approx(1.5 + 0.0625)
    assert ready.to_json()["copies_weights"] is False
