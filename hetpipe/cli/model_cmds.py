"""``hetpipe models``, ``inspect``, ``plan``, ``check``, ``profile``: a model and a cluster become a plan.

Example:
    >>> p = argparse.ArgumentParser(); add_model_args(p)
    >>> p.parse_args(["gpt-demo", "--cluster", "c.yaml"]).optimizer
    'adam'
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from rich.console import Console

from hetpipe.cli.checks import path_arg
from hetpipe.errors import ConfigError, InfeasibleError

log = logging.getLogger(__name__)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="built-in model name (see `hetpipe models`) or package.module:factory")
    p.add_argument("--cluster", required=True, type=Path, help="cluster file (YAML or JSON)")
    p.add_argument("--batch", type=int, default=None, help="micro-batch size (batch dimension of one micro-batch)")
    p.add_argument("--seq", type=int, default=None, help="sequence length for language models")
    p.add_argument("--optimizer", default="adam", help="sgd | momentum | adam | adamw (default adam)")
    p.add_argument("--precision", default="fp32", help="fp32 | bf16-mixed | fp16-mixed (default fp32)")
    p.add_argument("--granularity", default="block", help="block | node | N (merge to about N units)")
    p.add_argument("--loss", default=None,
                   help="package.module:function(output, targets): cost what your loss saves for backward "
                        "(default: a built-in model's own loss)")
    p.add_argument("--data", default=None,
                   help="package.module:factory yielding (inputs, targets) global batches; its first batch's "
                        "targets are what --loss is costed with")


def load_model(spec: str, *, batch: int | None, seq: int | None) -> tuple[Any, Any, str]:
    """(model on meta, example inputs, display name) for a built-in name or ``pkg.mod:factory``."""
    from hetpipe import models

    if models.takes_size(spec):  # built-in and Hugging Face models
        model, inputs = models.build(spec, device="meta", batch=batch, seq=seq)
        return model, inputs, spec
    resolved = models.resolve(spec, device="meta", batch=batch, seq=seq)
    if resolved.example_inputs is None:
        raise ConfigError(f"model factory {spec!r} returned no example inputs; return (module, example_inputs) "
                          "with one micro-batch so hetpipe can trace and cost it")
    return resolved.model, resolved.example_inputs, spec


def capture_args(args: argparse.Namespace) -> Any:
    """The unit graph of ``args.model`` as the model commands see it (built-ins with their loss costed)."""
    from hetpipe import models
    from hetpipe.partitioner.capture.capture import capture
    from hetpipe.plan.build import capture_builtin
    from hetpipe.plan.user_code import loss_for_capture

    gran: str | int = int(args.granularity) if str(args.granularity).isdigit() else args.granularity
    loss, data = getattr(args, "loss", None), getattr(args, "data", None)
    if models.takes_size(args.model) and not loss and not data:  # built-in or HF: its loss is known
        return capture_builtin(args.model, batch=args.batch, seq=args.seq, optimizer=args.optimizer,
                               precision=args.precision, granularity=gran)
    model, inputs, name = load_model(args.model, batch=args.batch, seq=args.seq)
    fn, targets = loss_for_capture(args.model, model, inputs, loss=loss, data=data)
    if fn is None:
        log.warning("the loss of %s is not costed (what it saves for backward counts on the last stage); pass "
                    "--loss package.module:function and --data", args.model)
    return capture(model, inputs, name=name, granularity=gran, optimizer=args.optimizer, precision=args.precision,
                   loss_fn=fn, targets=targets)


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
        graph = capture_args(args)
    console.print(unit_table(graph, unit_times(graph, cluster)))
    console.print(device_fit_table(graph, cluster))
    if graph.tied:
        for t in graph.tied:
            console.print(f"tied parameter: {' = '.join(t.qualified_names)} (units {list(t.unit_indices)})")
    return 0


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.plan.replica_count import check_sharding_replicas, check_sync_option, parse_replicas, plan_replicas
    from hetpipe.cli.tables import baseline_table, gap_note, plan_table, replica_table

    replicas, sharding = parse_replicas(getattr(args, "replicas", "1")), getattr(args, "sharding", "never")
    check_sharding_replicas(sharding, replicas)  # before the capture, like every other option
    check_sync_option(getattr(args, "sync", "auto"), replicas)
    cluster = load_cluster(args.cluster)
    with console.status(f"capturing {args.model} on the meta device"):
        graph = capture_args(args)
        selective = selective_level(args, graph, cluster)
    try:
        with console.status(f"solving: {graph.num_units} units on {len(cluster.devices)} devices "
                            f"(limit {'auto' if args.time_limit == 'auto' else f'{args.time_limit:g} s'})"):
            plan = plan_replicas(graph, cluster, replicas, global_batch=args.global_batch, solver=args.solver,
                                 time_limit_s=args.time_limit, seed=args.seed,
                                 recompute=getattr(args, "recompute", "auto"),
                                 offload=getattr(args, "offload", "never"),
                                 schedule=getattr(args, "plan_schedule", "1f1b"),
                                 tensor_parallel=getattr(args, "tensor_parallel", "off"),
                                 sharding=sharding, selective=selective, sync=getattr(args, "sync", "auto"))
    except InfeasibleError as err:
        from hetpipe.cli.fit_help import with_fit_hints

        # the hints are for one pipeline, and price no forced selective level (`partitioner.selective_mode`)
        if (isinstance(replicas, int) and replicas > 1) or getattr(args, "recompute", "auto") == "selective":
            raise
        with console.status("nothing fits: trying lighter settings (memory only)"):
            raise with_fit_hints(err, args, graph, cluster, capture_args) from None
    plan = _with_user_code(plan, args)
    plan.save(args.output)
    console.print(plan_table(plan))
    if plan.replicas:
        console.print(replica_table(plan))
    console.print(baseline_table(plan))
    note = gap_note(plan.solver.objective_s, plan.solver.bound_s, plan.solver.time_limit_s, plan.solver.wall_s)
    if note:
        console.print(note)
    for lo in plan.left_out:
        console.print(f"left out {lo.device}: {lo.reason}")
    console.print(f"wrote {args.output}")
    return 0


def selective_level(args: argparse.Namespace, graph: Any, cluster: Any) -> Any:
    """The selective recompute level offered to the planner under ``--recompute auto`` or ``selective`` (its
    tables and record, from a node-granularity capture); None otherwise.  The same code path as
    `hetpipe.partition` (`plan.selective_plan.offer_for_options`)."""
    from hetpipe.plan.selective_plan import offer_for_options

    node_args = argparse.Namespace(**{**vars(args), "granularity": "node"})
    return offer_for_options(graph, cluster, lambda: graph if args.granularity == "node" else capture_args(node_args),
                             recompute=getattr(args, "recompute", "auto"),
                             schedule=getattr(args, "plan_schedule", "1f1b"),
                             tensor_parallel=getattr(args, "tensor_parallel", "off"))


def _with_user_code(plan: Any, args: argparse.Namespace) -> Any:
    """`plan` recording the --loss / --data its tables were costed with (plan version 3 fields)."""
    from dataclasses import replace

    loss, data = getattr(args, "loss", None) or "", getattr(args, "data", None) or ""
    if not (loss or data):
        return plan
    return replace(plan, model=replace(plan.model, loss=loss, data=data))


def _recapture(args: argparse.Namespace, plan: Any, granularity: str | int) -> Any:
    """The model captured as `hetpipe plan` captured it for `plan` (its loss and data included)."""
    from hetpipe import models
    from hetpipe.plan.build import capture_builtin
    from hetpipe.plan.user_code import loss_for_capture
    from hetpipe.partitioner.capture.capture import capture

    batch, t = args.batch or plan.training.micro_batch_size, plan.training
    loss, data = plan.model.loss or None, plan.model.data or None
    if models.takes_size(args.model) and not (loss or data):
        return capture_builtin(args.model, batch=batch, seq=args.seq, optimizer=t.optimizer, precision=t.precision,
                               granularity=granularity)
    # a factory sizes its own inputs: only a built-in takes the plan's micro-batch
    model, inputs, name = load_model(args.model, batch=batch if models.takes_size(args.model) else args.batch,
                                     seq=args.seq)
    fn, targets = loss_for_capture(args.model, model, inputs, loss=loss, data=data) if (loss or data) else (None, None)
    return capture(model, inputs, name=name, granularity=granularity, optimizer=t.optimizer, precision=t.precision,
                   loss_fn=fn, targets=targets)


def cmd_check(args: argparse.Namespace, console: Console) -> int:
    from hetpipe.plan.check import check_plan
    from hetpipe.plan.schema import Plan, verify_model

    plan = Plan.load(args.plan)
    if args.model:
        from hetpipe.cost_models.cluster import load_cluster
        from hetpipe.plan.tables import verify_tables

        cluster = load_cluster(args.cluster) if args.cluster else None
        graph = _recapture(args, plan, "block")
        verify_model(plan, graph)
        if graph.num_units != len(plan.units):  # planned with --granularity N: group the same way
            graph = _recapture(args, plan, len(plan.units))
        # the loss is re-costed when it is known (a built-in's own, or the plan's recorded --loss);
        # an older plan of a factory may have costed one this capture does not know: a lower bound then
        verify_tables(plan, graph, cluster=cluster, loss_costed=":" not in args.model or bool(plan.model.loss))
        if plan.selective is not None:  # the level's nodes, bytes (and seconds) re-derived from a node capture
            from hetpipe.plan.selective_plan import verify_selective

            verify_selective(plan.selective, graph, _recapture(args, plan, "node"), cluster)
    report = check_plan(plan)
    if report.ok:
        sched = "1F1B" if plan.training.schedule in ("1f1b", "gpipe") else plan.training.schedule
        what = (f"the simulated {sched} schedule with optimizer steps" if report.objective == "schedule" else
                "the H-1F1B estimate this plan was solved with (version < 4; re-plan for the schedule objective)")
        console.print(f"{args.plan}: ok; T = {report.iteration_s:.6g} s ({what}), every stage fits")
        return 0
    for v in report.violations:
        console.print(f"{args.plan}: {v}")
    return 1


def add_profile_parser(subparsers: Any) -> None:
    """Add ``hetpipe profile`` to the CLI's subparsers."""
    p = subparsers.add_parser("profile", help="detect local GPUs (pynvml) and write a cluster file")
    p.add_argument("--calibrate", action="store_true", help="measure matmul FLOP/s and local link bandwidth")
    p.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                   help="with --calibrate on a CPU host: N devices, each a group of cores (one pinned process)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="with --cpu-devices: time the groups' calibration in wall time (what a plan promises) or in "
                        "each thread's CPU time (a shared machine: other processes on the cores do not count)")
    p.add_argument("-o", "--output", type=path_arg, default=None)


def cmd_profile(args: argparse.Namespace, console: Console) -> int:
    from hetpipe.cost_models.profile import run_profile
    from hetpipe.runtime.execute.comm_probe import RuntimePath

    # the core groups' link is timed on the runtime's own messages (issue 17 item 4: its imitation ran fast)
    _, summary = run_profile(output=args.output, calibrate=args.calibrate, cpu_devices=args.cpu_devices,
                             message_path=RuntimePath(), cpu_clock=args.clock == "cpu")
    console.print(summary)
    return 0
