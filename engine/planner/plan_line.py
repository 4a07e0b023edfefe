"""The pre-flight's message to the operator: its termination message (and log) ends with
one machine-readable line, ``kvledger-plan: {figures}``, after the report a person reads;
the operator takes the plan's figures from that line alone, never from the words
(``operator/controller/status.py``), and the whole message fits what the kubelet keeps."""

from __future__ import annotations

import json

from kvledger.engine.planner.record import Plan

TERMINATION_LOG_MAX_BYTES = 4096  # the kubelet keeps at most this much of the message
# The pre-flight's machine-readable line: the plan's figures as JSON after this prefix, last
# in its termination message and its log (commands/preflight.py); the operator reads it.
PLAN_LINE_PREFIX = "kvledger-plan: "
# What the line leaves out of the plan JSON: free text the report above it holds, so that
# the line stays about 1 KiB (a hub uri is its longest part) and the report has the rest.
_FREE_TEXT, _KV_FREE_TEXT = ("remedies", "warnings"), ("groups", "note")


def plan_figures(plan: Plan) -> dict:
    """The plan JSON less its free text (remedies, warnings, the KV layout's groups and
    note): its figures, bytes as integers, under the plan JSON's own keys."""
    figures = {k: v for k, v in plan.to_json().items() if k not in _FREE_TEXT}
    figures["kv"] = {k: v for k, v in figures["kv"].items() if k not in _KV_FREE_TEXT}
    return figures


def plan_line(plan: Plan) -> str:
    """``kvledger-plan: {figures}``, one line of compact JSON."""
    return (PLAN_LINE_PREFIX
            + json.dumps(plan_figures(plan), separators=(",", ":"), sort_keys=True) + "\n")


def read_plan_line(message: str) -> tuple[str, dict | None]:
    """(the message without its plan lines, the figures of the last one or None): what a
    reader of a pre-flight's termination message or log gets, whoever wrote it."""
    kept, figures = [], None
    for line in message.splitlines(keepends=True):
        if not line.startswith(PLAN_LINE_PREFIX):
            kept.append(line)
            continue
        try:
            parsed = json.loads(line[len(PLAN_LINE_PREFIX):])
        except ValueError:
            continue
        if isinstance(parsed, dict) and isinstance(parsed.get("fits"), bool):
            figures = parsed
    return "".join(kept), figures


def truncate_utf8(text: str, max_bytes: int = TERMINATION_LOG_MAX_BYTES) -> str:
    """At most ``max_bytes`` of UTF-8: whole lines from the top, never half a character."""
    if len(text.encode("utf-8")) <= max_bytes:
        return text
    marker = "... (truncated)\n"
    budget = max_bytes - len(marker.encode("utf-8"))
    kept: list[str] = []
    used = 0
    for line in text.splitlines(keepends=True):
        size = len(line.encode("utf-8"))
        if used + size > budget:
            break
        kept.append(line)
        used += size
    if not kept:  # a first line longer than the budget: cut it at a character boundary
        head = text.encode("utf-8")[:budget - 1].decode("utf-8", errors="ignore")
        kept = [head.rstrip("\n") + "\n"]
    return "".join(kept) + marker
