"""Time to ready (planner/ready_time.py): the read predicted from a timed read of the
weights' own files, the phases measured."""

from __future__ import annotations

import time

from kvledger.engine.planner.ready_time import PHASES, TimeToReady, measure_read, predict


def test_a_timed_read_of_the_largest_file_predicts_the_whole(tmp_path):
    small, big = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    small.write_bytes(b"x" * 1000)
    big.write_bytes(b"y" * (40 << 20))
    speed = measure_read([small, big], sample_bytes=16 << 20)
    assert speed.bytes == 16 << 20 and speed.seconds > 0  # from the big one's middle on
    ready = predict([small, big, tmp_path / "missing.safetensors"])
    assert ready.weight_file_bytes == 1000 + (40 << 20)
    assert ready.predicted["read"] == ready.weight_file_bytes / ready.read_speed.bytes_per_s
    assert [ready.predicted[p] for p in PHASES[1:]] == [None] * (len(PHASES) - 1)
    assert predict([]).predicted["read"] is None and measure_read([]) is None


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
