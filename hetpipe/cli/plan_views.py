"""``hetpipe show``, ``simulate``, ``compare``: read a plan, simulate it, set it beside the baselines."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from hetpipe.cli.checks import path_arg


def add_show_parser(subparsers: Any) -> None:
    """Add ``hetpipe show`` to the CLI's subparsers."""
    p = subparsers.add_parser("show", help="a plan's stages, memory per card, time per stage and speed-up over baselines")
    p.add_argument("plan", type=Path)
    p.add_argument("--gantt", type=path_arg, default=None, help="write the simulated iteration as a Gantt PNG")
    p.add_argument("--trace", type=path_arg, default=None, help="write the simulated iteration as a Chrome/Perfetto trace")
    p.add_argument("--run", type=Path, default=None,
                   help="a run report (run.json) of this plan: --gantt / --trace draw its measured step under the "
                        "predicted one")


def cmd_show(args: argparse.Namespace, console: Console) -> int:
    from hetpipe.cli.timeline import write_timelines
    from hetpipe.plan.analysis import simulate_plan
    from hetpipe.plan.schema import Plan
    from hetpipe.cli.tables import baseline_table, memory_table, plan_table, replica_table

    plan = Plan.load(args.plan)
    report = _run_report(plan, args.run) if getattr(args, "run", None) is not None else None  # before any table
    for table in (plan_table(plan), memory_table(plan), baseline_table(plan)):
        console.print(table)
    if plan.replicas:
        console.print(replica_table(plan))
        if plan.sync is not None:
            console.print(f"sync policy: {plan.sync.reason}")
    for lo in plan.left_out:
        console.print(f"left out {lo.device}: {lo.reason}")
    if report is not None:  # predicted beside measured (issue 17 item 5)
        from hetpipe.cli.demo import gantt_suptitle
        from hetpipe.cli.timeline import write_run_timelines

        written = write_run_timelines(plan, report, gantt=args.gantt, trace=args.trace, suptitle=gantt_suptitle(plan))
    elif args.gantt or args.trace:
        written = write_timelines(simulate_plan(plan), gantt=args.gantt, trace=args.trace)
    else:
        written = ()
    for path in written:
        console.print(f"wrote {path}")
    return 0


def _run_report(plan: Any, path: Path) -> Any:
    """``show --run``'s report, loaded and matched to `plan` (`ConfigError` otherwise) before anything is printed."""
    from hetpipe.cli.timeline import check_run_report
    from hetpipe.runtime.report import RunReport

    report = RunReport.load(path)
    check_run_report(plan, report)
    return report


def cmd_simulate(args: argparse.Namespace, console: Console) -> int:
    from hetpipe.cli.timeline import write_timelines
    from hetpipe.plan.analysis import divergence_reason, simulate_plan
    from hetpipe.plan.schema import Plan
    from hetpipe.cli.tables import simulation_table

    sim = simulate_plan(Plan.load(args.plan), microbatches=args.microbatches, schedule=args.schedule)
    console.print(simulation_table(sim))
    if reason := divergence_reason(sim):
        console.print(reason)
    for path in write_timelines(sim, gantt=args.gantt, trace=args.trace):
        console.print(f"wrote {path}")
    return 0


def cmd_compare(args: argparse.Namespace, console: Console) -> int:
    from hetpipe.plan.analysis import compare_plan
    from hetpipe.plan.schema import Plan
    from hetpipe.cli.tables import compare_table

    names = None if args.baselines == "all" else [n.strip() for n in args.baselines.split(",") if n.strip()]
    rows = compare_plan(Plan.load(args.plan), baselines=names, microbatches=args.microbatches,
                        schedule=args.schedule)
    console.print(compare_table(rows))
    for r in rows:
        if r.note:
            console.print(f"  {r.name}: {r.note}")
    return 0
