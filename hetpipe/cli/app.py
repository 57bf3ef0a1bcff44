"""The `hetpipe` console script.

Subcommands: ``models``, ``inspect``, ``plan``, ``check``, ``profile``, ``run``, ``demo``, ``show``,
``simulate``, ``compare``, ``init-weights``, ``calibrate``.
Every `HetpipeError` becomes one ``error: ...`` line on stderr and exit code 2;
``check`` exits 1 when a plan violates its own tables.

Example:
    $ hetpipe inspect gpt2-small --cluster examples/clusters/homelab.yaml --batch 4 --seq 1024
    $ hetpipe plan gpt2-small --cluster examples/clusters/homelab.yaml -o plan.json
    $ hetpipe check plan.json
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.console import Console

from hetpipe.cli.calibrate_cmd import add_calibrate_parser, cmd_calibrate
from hetpipe.cli.checks import OneLineParser, check_args, path_arg
from hetpipe.cli.model_cmds import (
    add_model_args, add_profile_parser, cmd_check, cmd_inspect, cmd_models, cmd_plan, cmd_profile,
)
from hetpipe.cli.plan_views import add_show_parser, cmd_compare, cmd_show, cmd_simulate
from hetpipe.cli.run_cmds import add_run_parser, cmd_demo, cmd_run
from hetpipe.cli.weights import add_init_weights_parser, cmd_init_weights
from hetpipe.errors import HetpipeError

log = logging.getLogger("hetpipe.cli.app")


#: ``hetpipe plan --time-limit``'s help (`partitioner/solvers/time_budget.py`).
TIME_LIMIT_HELP = ("the solver's budget in seconds (a hard deadline), or auto (default: 10 s, and 60 s more only where "
                   "that answer is over 2%% from its proven bound and the search used its time)")


def _add_plan_parser(sub: Any) -> None:
    """``hetpipe plan``'s options."""
    p = sub.add_parser("plan", help="partition a model across a cluster and write plan.json")
    add_model_args(p)
    p.add_argument("-o", "--output", type=path_arg, default=Path("plan.json"))
    p.add_argument("--global-batch", type=int, default=None, help="samples per iteration (multiple of --batch)")
    p.add_argument("--solver", default="auto", help="auto | cpsat | dp")
    p.add_argument("--time-limit", default="auto", help=TIME_LIMIT_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recompute", default="auto",
                   help="activation recomputation per stage: auto (default: only the units it must to fit, cheapest per "
                        "byte first, and/or the selective level: norm/GELU outputs) | none | all | selective (the level alone)")
    p.add_argument("--offload", default="never",
                   help="optimizer-state offload per stage: never (default) | auto (a stage keeps its optimizer "
                        "state in host memory where that lowers T, paying the PCIe copies and the host step) | all")
    p.add_argument("--schedule", dest="plan_schedule", default="1f1b",
                   help="pipeline schedule: 1f1b (default) | zb-1f1b | zb-h1 (zero-bubble: backward split) | "
                        "interleaved:V (V chunks per card) | auto (the fastest for this plan)")
    p.add_argument("--tensor-parallel", default="off",
                   help="off (default) | auto (a stage may run on a group of up to 4 cards of one node, or of two "
                        "nodes where their link lowers T, each layer split unevenly by speed and memory)")
    p.add_argument("--replicas", default="1",
                   help="1 (one pipeline, default) | auto (the planner picks one pipeline or several data-parallel "
                        "replicas, each with its own batch share) | N (exactly N pipeline replicas)")
    p.add_argument("--sharding", default="never",
                   help="with --replicas: optimizer-state sharding across replicas (ZeRO-1, shards by free memory): "
                        "never (default) | auto (where it makes the plan fit or faster) | all")
    p.add_argument("--sync", default="auto",
                   help="with --replicas: how replicas sync gradients: auto (default: the faster) | synchronous "
                        "(every step) | diloco (H local steps, then an outer step)")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="hetpipe", description="Heterogeneous pipeline partitioning for PyTorch training")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("models", help="list built-in models")
    p = sub.add_parser("inspect", help="per-unit costs of a model and what each card can hold")
    add_model_args(p)
    _add_plan_parser(sub)
    p = sub.add_parser("check", help="recompute a plan's objective and memory from its own tables")
    p.add_argument("plan", type=Path)
    p.add_argument("--model", default=None, help="also verify the plan was made for this model, tables included")
    p.add_argument("--cluster", type=Path, default=None, help="with --model: also re-derive every unit time on it")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    add_profile_parser(sub)
    p = sub.add_parser("demo", help="plan the bundled GPT on the emulated home lab, compare baselines, train a few steps")
    p.add_argument("--out", type=path_arg, default=Path("hetpipe-demo"), help="where plan.json, run.json, gantt.png go")
    p.add_argument("--steps", type=int, default=4, help="training steps to run (default 4)")
    p.add_argument("--fast", action="store_true", help="plan and compare only; do not launch the training run")
    add_show_parser(sub)
    p = sub.add_parser("simulate", help="simulate a plan's schedule: iteration, bubble, busy/idle per device")
    p.add_argument("plan", type=Path)
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per iteration (default: the plan's)")
    p.add_argument("--schedule", default=None, help="1f1b | gpipe | zb-1f1b | zb-h1 (default: the plan's)")
    p.add_argument("--gantt", type=path_arg, default=None, help="write a Gantt PNG")
    p.add_argument("--trace", type=path_arg, default=None, help="write a Chrome/Perfetto trace JSON")
    p = sub.add_parser("compare", help="a plan vs the baselines, analytic and simulated")
    p.add_argument("plan", type=Path)
    p.add_argument("--baselines", nargs="?", const="all", default="all",
                   help="comma-separated baselines (uniform, parameters, time-homogeneous); default all")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per iteration (default: the plan's)")
    p.add_argument("--schedule", default=None, help="1f1b | gpipe | zb-1f1b | zb-h1 (default: the plan's)")
    add_run_parser(sub)
    add_init_weights_parser(sub)
    add_calibrate_parser(sub)
    return parser


COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {
    "models": cmd_models,
    "inspect": cmd_inspect,
    "plan": cmd_plan,
    "check": cmd_check,
    "profile": cmd_profile,
    "run": cmd_run,
    "demo": cmd_demo,
    "show": cmd_show,
    "simulate": cmd_simulate,
    "compare": cmd_compare,
    "init-weights": cmd_init_weights,
    "calibrate": cmd_calibrate,
}


def main(argv: Sequence[str] | None = None) -> int:
    console = Console(width=160 if not sys.stdout.isatty() else None)
    try:
        args = _parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        check_args(args)  # flags in range and outputs writable before any long work (cli/checks.py)
        return COMMANDS[args.command](args, console)
    except HetpipeError as err:
        Console(stderr=True, soft_wrap=True).print(f"error: {err}", markup=False, highlight=False)
        return 2
    except KeyboardInterrupt:
        Console(stderr=True, soft_wrap=True).print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
