"""``hetpipe calibrate run.json --cluster lab.yaml -o lab-calibrated.yaml``: measured feedback into a cluster file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hetpipe.cli.checks import path_arg
from hetpipe.runtime.faults.straggler import DEFAULT_STEPS


def add_calibrate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``hetpipe calibrate`` to the CLI's subparsers."""
    p = subparsers.add_parser("calibrate", help="turn a run report's measured times into a calibrated cluster file")
    p.add_argument("report", type=Path, help="run.json from `hetpipe run --report` (--emulate, or on the plan's GPUs)")
    p.add_argument("--cluster", type=Path, required=True, help="the cluster file the run's plan was made from")
    p.add_argument("-o", "--output", type=path_arg, required=True, help="where to write the calibrated cluster file")
    p.add_argument("--window", type=int, default=DEFAULT_STEPS,
                   help=f"medians over the run's last N measured steps (default {DEFAULT_STEPS})")
    return p


def cmd_calibrate(args: argparse.Namespace, console: Any) -> int:
    """Write the calibrated cluster file and print what changed."""
    from hetpipe.runtime.faults.feedback import calibrate_from_report

    cal = calibrate_from_report(args.report, args.cluster, output=args.output, window_steps=args.window)
    console.print(f"medians over steps {cal.steps[0]}-{cal.steps[-1]} of {args.report}:")
    for line in cal.lines():
        console.print(f"  {line}", markup=False, highlight=False)
    console.print(f"wrote {args.output}; plan on it with `hetpipe plan MODEL --cluster {args.output}`")
    return 0
