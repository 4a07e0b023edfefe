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


def test_a_sparse_file_is_not_timed(tmp_path):
    """A header mirror's shards (and a benchmark's sparse checkpoint) are holes: reading
    them times nothing, so no prediction is made from them."""
    sparse = tmp_path / "model.safetensors"
    with open(sparse, "wb") as f:
        f.write(b"h" * 4096)
        f.truncate(64 << 20)
    assert measure_read([sparse]) is None
    assert predict([sparse]).predicted["read"] is None


def test_plan_predicts_the_read_and_the_operator_shows_it(tmp_path, capsys):
    """``kvledger plan`` (and the pod's pre-flight, whose plan line the operator copies into
    ``status.plan``) predicts the start's read from a timed read of the checkpoint; a run
    that is refused shows no prediction in its report (it never starts)."""
    import json

    from kvledger.engine import cli
    from kvledger.engine.model.builtin import write_model
    from kvledger.engine.planner.report import read_plan_line
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
