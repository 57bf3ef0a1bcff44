"""``hetpipe run --netns``: two plan nodes as network namespaces over a tc-shaped link, else ``--emulate``."""

from __future__ import annotations

import argparse
from typing import Any

from hetpipe.errors import ConfigError

#: `hetpipe run` options the namespace path does not carry (it runs seeded weights on synthetic data).
_UNSUPPORTED = ("data", "loss", "weights", "save_weights", "checkpoint_dir", "resume", "inject", "schedule")


def netns_or_emulate(args: argparse.Namespace, console: Any) -> bool:
    """Run ``args`` on network namespaces and print the report (True), or say why not and set
    ``args.emulate`` so the caller runs the in-process emulation instead (False)."""
    from hetpipe.plan.schema import Plan
    from hetpipe.runtime.faults.netns import netns_support, run_on_netns, shaped_link
    from hetpipe.runtime.run import summary_tables

    given = [f"--{name.replace('_', '-')}" for name in _UNSUPPORTED if getattr(args, name, None)]
    if given or args.emulate:
        raise ConfigError(f"--netns runs seeded weights on synthetic data with real, shaped links; drop "
                          f"{', '.join(given or ['--emulate'])} (or drop --netns)")
    reason = netns_support()
    if not reason:
        try:
            shaped_link(Plan.load(args.plan))
        except ConfigError as err:
            reason = str(err).split(";")[0]
    if reason:
        console.print(f"note: not on network namespaces ({reason}): running with --emulate's in-process link delays")
        args.emulate = True
        return False
    report = run_on_netns(args.plan, model=args.model, steps=args.steps, run_dir=args.run_dir or "hetpipe-netns-run",
                          timeout_s=args.timeout or 60.0, seq=args.seq, seed=args.seed)
    for table in summary_tables(report):
        console.print(table)
    for note in report.notes:
        console.print(f"note: {note}")
    if args.report:
        report.save(args.report)
        console.print(f"wrote {args.report}")
    return True
