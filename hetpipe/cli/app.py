"""The `hetpipe` console script.

Subcommands: ``models``, ``inspect``, ``plan``, ``check``, ``profile``, ``run``, ``demo``, ``show``,
``simulate``, ``compare``.
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

from hetpipe.errors import ConfigError, HetpipeError

log = logging.getLogger("hetpipe.cli.app")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="built-in model name (see `hetpipe models`) or package.module:factory")
    p.add_argument("--cluster", required=True, type=Path, help="cluster file (YAML or JSON)")
    p.add_argument("--batch", type=int, default=None, help="micro-batch size (batch dimension of one micro-batch)")
    p.add_argument("--seq", type=int, default=None, help="sequence length for language models")
    p.add_argument("--optimizer", default="adam", help="sgd | momentum | adam | adamw (default adam)")
    p.add_argument("--precision", default="fp32", help="fp32 | bf16-mixed | fp16-mixed (default fp32)")
    p.add_argument("--granularity", default="block", help="block | node | N (merge to about N units)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetpipe", description="Heterogeneous pipeline partitioning for PyTorch training")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("models", help="list built-in models")
    p = sub.add_parser("inspect", help="per-unit costs of a model and what each card can hold")
    _model_args(p)
    p = sub.add_parser("plan", help="partition a model across a cluster and write plan.json")
    _model_args(p)
    p.add_argument("-o", "--output", type=Path, default=Path("plan.json"))
    p.add_argument("--global-batch", type=int, default=None, help="samples per iteration (multiple of --batch)")
    p.add_argument("--solver", default="auto", help="auto | cpsat | dp")
    p.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT time limit in seconds")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("check", help="recompute a plan's objective and memory from its own tables")
    p.add_argument("plan", type=Path)
    p.add_argument("--model", default=None, help="also verify the plan was made for this model")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p = sub.add_parser("profile", help="detect local GPUs (pynvml) and write a cluster file")
    p.add_argument("--calibrate", action="store_true", help="measure matmul FLOP/s and local link bandwidth")
    p.add_argument("-o", "--output", type=Path, default=None)
    p = sub.add_parser("demo", help="plan the bundled GPT on the emulated home lab, compare baselines, train a few steps")
    p.add_argument("--out", type=Path, default=Path("hetpipe-demo"), help="where plan.json, run.json, gantt.png go")
    p.add_argument("--steps", type=int, default=4, help="training steps to run (default 4)")
    p.add_argument("--fast", action="store_true", help="plan and compare only; do not launch the training run")
    p = sub.add_parser("show", help="a plan's stages, memory per card, time per stage and speed-up over baselines")
    p.add_argument("plan", type=Path)
    p.add_argument("--gantt", type=Path, default=None, help="write the simulated iteration as a Gantt PNG")
    p.add_argument("--trace", type=Path, default=None, help="write the simulated iteration as a Chrome/Perfetto trace")
    p = sub.add_parser("simulate", help="simulate a plan's schedule: iteration, bubble, busy/idle per device")
    p.add_argument("plan", type=Path)
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per iteration (default: the plan's)")
    p.add_argument("--schedule", default=None, help="1f1b | gpipe (default: the plan's)")
    p.add_argument("--gantt", type=Path, default=None, help="write a Gantt PNG")
    p.add_argument("--trace", type=Path, default=None, help="write a Chrome/Perfetto trace JSON")
    p = sub.add_parser("compare", help="a plan vs the baselines, analytic and simulated")
    p.add_argument("plan", type=Path)
    p.add_argument("--baselines", nargs="?", const="all", default="all",
                   help="comma-separated baselines (uniform, parameters, time-homogeneous); default all")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per iteration (default: the plan's)")
    p.add_argument("--schedule", default=None, help="1f1b | gpipe (default: the plan's)")
    from hetpipe.runtime.launch import add_run_parser  # no torch import: `hetpipe --help` stays fast

    add_run_parser(sub)
    from hetpipe.cli.weights import add_init_weights_parser

    add_init_weights_parser(sub)
    return parser


def load_model(spec: str, *, batch: int | None, seq: int | None) -> tuple[Any, Any, str]:
    """(model on meta, example inputs, display name) for a built-in name or ``pkg.mod:factory``."""
    from hetpipe import models

    if ":" not in spec:
        model, inputs = models.build(spec, device="meta", batch=batch, seq=seq)
        return model, inputs, spec
    resolved = models.resolve(spec, device="meta", batch=batch, seq=seq)
    if resolved.example_inputs is None:
        raise ConfigError(f"model factory {spec!r} returned no example inputs; return (module, example_inputs) "
                          "with one micro-batch so hetpipe can trace and cost it")
    return resolved.model, resolved.example_inputs, spec


def _capture(args: argparse.Namespace) -> Any:
    from hetpipe.plan.build import capture_builtin
    from hetpipe.partitioner.capture.capture import capture

    gran: str | int = int(args.granularity) if str(args.granularity).isdigit() else args.granularity
    if ":" not in args.model:  # built-in: its loss is known and costed
        return capture_builtin(args.model, batch=args.batch, seq=args.seq, optimizer=args.optimizer,
                               precision=args.precision, granularity=gran)
    model, inputs, name = load_model(args.model, batch=args.batch, seq=args.seq)
    return capture(model, inputs, name=name, granularity=gran, optimizer=args.optimizer, precision=args.precision)


def cmd_models(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from hetpipe import models

    table = Table(title="built-in models")
    for col in ("name", "task", "default batch", "default seq", "description"):
        table.add_column(col)
    for spec in models.list_models():
        table.add_row(spec.name, spec.task, str(spec.default_batch), str(spec.default_seq or "-"), spec.description)
    console.print(table)
    return 0


def cmd_inspect(args: argparse.Namespace, console: Console) -> int:
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.plan.build import unit_times
    from hetpipe.cli.tables import device_fit_table, unit_table

    cluster = load_cluster(args.cluster)
    with console.status(f"capturing {args.model} on the meta device"):
        graph = _capture(args)
    console.print(unit_table(graph, unit_times(graph, cluster)))
    console.print(device_fit_table(graph, cluster))
    if graph.tied:
        for t in graph.tied:
            console.print(f"tied parameter: {' = '.join(t.qualified_names)} (units {list(t.unit_indices)})")
    return 0


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.plan.build import partition_graph
    from hetpipe.cli.tables import baseline_table, plan_table

    cluster = load_cluster(args.cluster)
    with console.status(f"capturing {args.model} on the meta device"):
        graph = _capture(args)
    with console.status(f"solving: {graph.num_units} units on {len(cluster.devices)} devices "
                        f"(limit {args.time_limit:g} s)"):
        plan = partition_graph(graph, cluster, global_batch=args.global_batch, solver=args.solver,
                               time_limit_s=args.time_limit, seed=args.seed)
    plan.save(args.output)
    console.print(plan_table(plan))
    console.print(baseline_table(plan))
    for lo in plan.left_out:
        console.print(f"left out {lo.device}: {lo.reason}")
    console.print(f"wrote {args.output}")
    return 0


def cmd_check(args: argparse.Namespace, console: Console) -> int:
    from hetpipe.plan.schema import Plan, check_plan, verify_model

    plan = Plan.load(args.plan)
    if args.model:
        from hetpipe.partitioner.capture.capture import capture

        model, inputs, name = load_model(args.model, batch=args.batch or plan.training.micro_batch_size, seq=args.seq)
        verify_model(plan, capture(model, inputs, name=name, optimizer=plan.training.optimizer,
                                   precision=plan.training.precision))
    report = check_plan(plan)
    if report.ok:
        console.print(f"{args.plan}: ok; T = {report.iteration_s:.6g} s, every stage fits")
        return 0
    for v in report.violations:
        console.print(f"{args.plan}: {v}")
    return 1


def cmd_profile(args: argparse.Namespace, console: Console) -> int:
    from hetpipe.cost_models.profile import run_profile

    _, summary = run_profile(output=args.output, calibrate=args.calibrate)
    console.print(summary)
    return 0


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    """``hetpipe run plan.json --model M --steps N [--emulate] [--report run.json]`` (torchrun, one rank per stage)."""
    from hetpipe.runtime.launch import cmd_run as run_plan

    return run_plan(args, console)


def cmd_init_weights(args: argparse.Namespace, console: Console) -> int:
    """``hetpipe init-weights MODEL -o DIR [--seed N] [--init seeded|model]``."""
    from hetpipe.cli.weights import cmd_init_weights as write

    return write(args, console)


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from hetpipe.cli.demo import run_demo

    return run_demo(out=args.out, steps=args.steps, run=not args.fast, console=console)


def cmd_show(args: argparse.Namespace, console: Console) -> int:
    from hetpipe.plan.analysis import simulate_plan, write_timelines
    from hetpipe.plan.schema import Plan
    from hetpipe.cli.tables import baseline_table, memory_table, plan_table, replica_table

    plan = Plan.load(args.plan)
    for table in (plan_table(plan), memory_table(plan), baseline_table(plan)):
        console.print(table)
    if plan.replicas:
        console.print(replica_table(plan))
        if plan.sync is not None:
            console.print(f"sync policy: {plan.sync.reason}")
    for lo in plan.left_out:
        console.print(f"left out {lo.device}: {lo.reason}")
    if args.gantt or args.trace:
        for path in write_timelines(simulate_plan(plan), gantt=args.gantt, trace=args.trace):
            console.print(f"wrote {path}")
    return 0


def cmd_simulate(args: argparse.Namespace, console: Console) -> int:
    from hetpipe.plan.analysis import divergence_reason, simulate_plan, write_timelines
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
}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console(width=160 if not sys.stdout.isatty() else None)
    try:
        return COMMANDS[args.command](args, console)
    except HetpipeError as err:
        Console(stderr=True, soft_wrap=True).print(f"error: {err}", markup=False, highlight=False)
        return 2
    except KeyboardInterrupt:
        Console(stderr=True, soft_wrap=True).print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
