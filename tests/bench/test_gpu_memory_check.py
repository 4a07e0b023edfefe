"""bench/gpu_memory_check.py's verdict on made-up figures (the script itself needs CUDA):
each measured class against the pre-load plan, the allocator peak against both plans, and
a failure whenever anything exceeds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("gpu_memory_check",
                                                  ROOT / "bench" / "gpu_memory_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    try:
        spec.loader.exec_module(module)  # importable without CUDA: torch comes in main()
    finally:
        del sys.modules[spec.name]
    return module


PRELOAD = {"weights": 1000, "activations": 500, "kv_cache": 4000, "cuda_graphs": 0,
           "context": 2000}
# The engine's measured plan: its own measured weights, activations and context.
MEASURED_PLAN = {**PRELOAD, "weights": 990, "activations": 450, "context": 1500}
MEASURED = {"weights": 990, "activations": 450, "kv_cache": 4000, "context": 1500}


def _all(check, measured=MEASURED, peak=5400, measured_plan=MEASURED_PLAN):
    return (check.compare_classes(PRELOAD, measured)
            + check.compare_peak(PRELOAD, measured_plan, peak))


def test_within_both_plans_passes_and_names_every_comparison(check) -> None:
    comparisons = _all(check)
    assert [(c.what, c.plan) for c in comparisons] == [
        ("weights", "pre-load"), ("activations", "pre-load"), ("kv_cache", "pre-load"),
        ("context", "pre-load"), ("peak", "pre-load"), ("peak", "measured")]
    assert all(c.within for c in comparisons)
    peak_preload, peak_measured = comparisons[-2:]
    assert peak_preload.planned_bytes == 1000 + 500 + 4000  # no context, no CUDA graphs
    assert peak_measured.planned_bytes == 990 + 450 + 4000
    assert check.verdict(comparisons) == "within plan: yes"
    table = check.format_comparisons(comparisons)
    assert len(table) == 1 + len(comparisons)
    assert all(line.endswith("yes") for line in table[1:])


@pytest.mark.parametrize("name", ["weights", "activations", "kv_cache", "context"])
def test_a_class_over_the_preload_plan_by_one_byte_fails(check, name) -> None:
    comparisons = _all(check, measured={**MEASURED, name: PRELOAD[name] + 1})
    assert [c.what for c in comparisons if not c.within] == [name]
    assert check.verdict(comparisons) == (
        f"within plan: NO: {name} over the pre-load plan by 1 bytes")
    assert check.format_comparisons(comparisons)[1 + check.MEASURED_CLASSES.index(name)].endswith(
        "NO")


def test_a_class_exactly_at_the_plan_is_within(check) -> None:
    at_plan = {name: PRELOAD[name] for name in check.MEASURED_CLASSES}
    assert all(c.within for c in check.compare_classes(PRELOAD, at_plan))


def test_peak_over_the_preload_plan_fails_even_when_the_measured_plan_holds_it(check) -> None:
    # The engine re-planned with bigger measured activations: the corrected plan holds the
    # peak, but the plan made before loading (what `kvledger plan` decided) did not.
    bigger = {**MEASURED_PLAN, "activations": 900}
    comparisons = _all(check, measured={**MEASURED, "activations": 900}, peak=5800,
                       measured_plan=bigger)
    assert [(c.what, c.plan) for c in comparisons if not c.within] == [
        ("activations", "pre-load"), ("peak", "pre-load")]
    assert "peak over the pre-load plan by 300 bytes" in check.verdict(comparisons)


def test_peak_over_the_measured_plan_alone_fails(check) -> None:
    comparisons = _all(check, peak=5450)  # within 5500 (pre-load), over 5440 (measured)
    assert [(c.what, c.plan) for c in comparisons if not c.within] == [("peak", "measured")]
    assert check.verdict(comparisons) == (
        "within plan: NO: peak over the measured plan by 10 bytes")


def test_what_the_allocator_holds_beyond_the_tensors_must_fit_in_the_margin(check) -> None:
    # 512-byte rounding and an unsplit segment remainder: held, but no tensor asked for it.
    within = check.compare_allocator(margin_bytes=4096, requested_peak=5400, reserved_peak=9000)
    assert (within.what, within.plan, within.measured_bytes, within.within) == (
        "allocator", "margin", 3600, True)
    over = check.compare_allocator(margin_bytes=4096, requested_peak=5400, reserved_peak=9497)
    assert not over.within
    assert check.verdict([*_all(check), over]) == (
        "within plan: NO: allocator over the plan's safety margin by 1 bytes")
