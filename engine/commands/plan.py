"""``kvledger plan FLAGS [--json]``: print the memory budget of a declared run.

Exit 0 when it fits, 3 when it does not (the full refusal report on stderr), 2 on bad
input. ``--json`` prints only the plan JSON on stdout. An hf:// model is planned from its
config.json and safetensors headers read over HTTP (``hub_headers``).
"""

from __future__ import annotations

import argparse
import json
import sys

from kvledger.engine.checkpoint.hub.headers import planning_source
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.planner.predicted_start import with_predicted_start
from kvledger.engine.planner.report import render_report
from kvledger.engine.settings.config_flags import add_engine_flags, config_from_args
from kvledger.engine.settings.vllm_flags import add_vllm_flags

HELP = "print the memory budget of a declared run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser)
    parser.add_argument("--json", action="store_true", help="print only the plan JSON on stdout")
    add_vllm_flags(parser)


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    with planning_source(config.model, config.download_dir,
                         hub_timeout_s=config.hub_timeout_s) as source:
        plan = with_predicted_start(make_plan(config, source=source))
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(render_report(plan), end="", file=sys.stdout if plan.fits else sys.stderr)
    return plan.exit_code
