"""``kvledger preflight FLAGS [--plan-out P] [--termination-log P]``: the init container.

It plans like ``kvledger plan`` (same report, same exit codes), writes the plan JSON to
``--plan-out`` and a message of at most 4096 bytes to ``--termination-log``, where the
kubelet picks it up for the pod's status: the report, then the plan's figures on one line
(``kvledger-plan: {...}``, read by the operator), which the log gets after the report too.
A termination log that cannot be written is a warning on stderr; the exit code stays the
plan's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvledger.engine.checkpoint.hub.headers import planning_source
from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.adapters import check_adapters
from kvledger.engine.planner.plan import Plan, make_plan
from kvledger.engine.planner.plan_line import TERMINATION_LOG_MAX_BYTES, plan_line, truncate_utf8
from kvledger.engine.planner.predicted_start import with_predicted_start
from kvledger.engine.planner.report import render_report
from kvledger.engine.settings.config_flags import add_engine_flags, config_from_args
from kvledger.engine.settings.vllm_flags import add_vllm_flags

HELP = "the init container: plan, write the plan JSON and a termination report"

DEFAULT_TERMINATION_LOG = "/dev/termination-log"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser)
    parser.add_argument("--plan-out", default=None, metavar="PATH",
                        help="write the plan JSON here (parent folders are created)")
    parser.add_argument("--termination-log", default=None, metavar="PATH",
                        help="write the report and the plan's figures, at most 4096 bytes, "
                             "here (default "
                             f"{DEFAULT_TERMINATION_LOG}, when the kubelet has mounted it)")
    # `kvledger run` turns it off: its pre-flight prints to a person, not to a pod's log.
    parser.set_defaults(log_plan_line=True)
    add_vllm_flags(parser)


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    with planning_source(config.model, config.download_dir,
                         hub_timeout_s=config.hub_timeout_s) as source:
        plan = with_predicted_start(make_plan(config, source=source))
        check_adapters(config, plan.shape)  # each local adapter, as the engine will read it
        # The engine container refuses a checkpoint it cannot run (architecture, activation,
        # RoPE type) at once; refuse it here too, so the pod says so instead of crash-looping.
        ModelConfig.from_dir(source.path)
    report = render_report(plan)
    # The log has the plan line too: the kubelet shows the log's tail when the termination
    # log is empty (FallbackToLogsOnError), and a podman pod has no termination log at all.
    logged = report + plan_line(plan) if getattr(args, "log_plan_line", True) else report
    print(logged, end="", file=sys.stdout if plan.fits else sys.stderr)
    if args.plan_out:
        out = Path(args.plan_out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(plan.to_json(), indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise BadInput(f"cannot write --plan-out {out}: {exc.strerror or exc}") from None
    _write_termination_log(args.termination_log, termination_message(plan, report))
    return plan.exit_code


def termination_message(plan: Plan, report: str) -> str:
    """What the kubelet hands the operator, at most 4096 bytes: the report, cut at a line
    to leave room, then the plan line (the plan's figures, exact bytes, for the operator).

    The report comes first because its first line is the headline a person reads first
    (``kubectl describe``, the condition and the event the operator makes of it), and the
    plan line last because a log's tail is what the kubelet keeps when it falls back to
    the log. The line is about 1 KiB; were it ever over half the limit, the report alone
    is written (the operator then says the figures are missing).
    """
    line = plan_line(plan)
    room = TERMINATION_LOG_MAX_BYTES - len(line.encode("utf-8"))
    if room < TERMINATION_LOG_MAX_BYTES // 2:
        return truncate_utf8(report)
    return truncate_utf8(report, room) + line


def _write_termination_log(path: str | None, message: str) -> None:
    """Write the message; a failure is only a warning.

    The default path is written only when it exists: in a pod the kubelet mounts it, and
    outside one we must not create files under /dev.
    """
    if path is None:
        path = DEFAULT_TERMINATION_LOG
        if not Path(path).exists():
            print(f"warning: {path} does not exist (not in a pod?): the report is not written "
                  "there", file=sys.stderr)
            return
    try:
        with open(path, "w", encoding="utf-8") as log:
            log.write(message)
    except OSError as exc:
        print(f"warning: cannot write the termination log {path}: {exc.strerror or exc}",
              file=sys.stderr)
