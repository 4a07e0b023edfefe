"""The plan's start, predicted before it: the weights' read from a short timed read of the
checkpoint the plan was made from, as the engine will read it (``ready_time``;
``--safetensors-load-strategy``), for ``kvledger plan``, the pod's pre-flight and
``kvledger run``; the engine times its own start."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvledger.engine.checkpoint.contents import ModelSource
from kvledger.engine.checkpoint.files import checkpoint_files
from kvledger.engine.planner.device import host_available_bytes, host_threads
from kvledger.engine.planner.ready_time import predict
from kvledger.engine.planner.record import Plan


def with_predicted_start(plan: Plan) -> Plan:
    """``plan`` with its start's read predicted from a short timed read of the checkpoint
    it was made from (the weights' volume, as the engine will read it); unchanged for a
    hub model's header mirror, whose weights are holes."""
    source = plan.source or ModelSource(plan.config.model)
    folder = Path(source.path)
    if source.headers_only or not folder.is_dir():
        return plan
    faults = host_threads() if plan.device.kind == "cpu" else 1  # as the engine's torch
    return dataclasses.replace(plan, time_to_ready=predict(
        checkpoint_files(folder), plan.config.weight_reading, host_available_bytes(), faults))
