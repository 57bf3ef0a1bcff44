"""`hetpipe demo`: the whole story on one CPU box, in under a few minutes.

1. Plan the bundled GPT (``gpt-demo``) on the bundled, emulated home lab
   (``hetpipe/data/homelab-mini.yaml``: RTX 3090 + RTX 4090 on one node, RTX 3060 12GB on
   another over 1 GbE, scaled down so a CPU can run it) and show it next to the
   Megatron/DeepSpeed/torchgpipe baselines: forced onto every card, none fits on the 3060 (not
   even recomputing activations: memory model 2 counts what the runtime holds); on the cards a
   careful user would pick (the headline) they fit and are slower.
2. The same comparison for GPT-2 XL on the full-size home lab (``homelab.yaml``), predicted.
3. Run a few 1F1B training steps of the plan with every device emulated (speed, memory
   limit, links) under torchrun, and put the measured iteration next to the prediction.
4. Write plan.json, run.json, a simulated Gantt chart (PNG) and a Perfetto trace.

Example:
    $ hetpipe demo --out demo-out
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Callable

from rich.console import Console

from hetpipe.cost_models.outputs import atomic_path, atomic_write_text, writable_folder
from hetpipe.plan.schema import Plan

DEMO_MODEL, DEMO_BATCH, DEMO_SEQ, DEMO_MICROBATCHES = "gpt-demo", 2, 128, 6
BIG_MODEL, BIG_BATCH, BIG_SEQ = "gpt2-xl", 1, 1024
#: Search time for the replica planner in the demo (the home lab has 3 cards: it finishes far sooner).
REPLICA_TIME_LIMIT_S = 10.0


def bundled_cluster(name: str) -> Path:
    """Path of a cluster file shipped in the package (``homelab.yaml``, ``homelab-mini.yaml``)."""
    return Path(str(resources.files("hetpipe") / "data" / name))


def _graph(model_name: str, *, batch: int, seq: int, precision: str,
           granularity: str = "block") -> "UnitGraph":  # noqa: F821
    from hetpipe.plan.build import capture_builtin

    return capture_builtin(model_name, batch=batch, seq=seq, precision=precision, granularity=granularity)


def _plan_graph(graph: "UnitGraph", cluster_file: Path, *, global_batch: int | None,  # noqa: F821
                capture_nodes: Callable[[], "UnitGraph"]) -> Plan:  # noqa: F821
    """The plan `hetpipe plan` writes for these settings: its defaults, the selective level offered as it does
    (`selective_plan.offer_for_options`, from ``capture_nodes()``: the model at node granularity)."""
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.plan.build import partition_graph
    from hetpipe.plan.selective_plan import offer_for_options

    cluster = load_cluster(cluster_file)
    offer = offer_for_options(graph, cluster, capture_nodes, recompute="auto", schedule="1f1b", tensor_parallel="off")
    return partition_graph(graph, cluster, global_batch=global_batch, selective=offer)


def _plan(model_name: str, cluster_file: Path, *, batch: int, seq: int, precision: str,
          global_batch: int | None) -> Plan:
    graph = _graph(model_name, batch=batch, seq=seq, precision=precision)
    return _plan_graph(graph, cluster_file, global_batch=global_batch,
                       capture_nodes=lambda: _graph(model_name, batch=batch, seq=seq, precision=precision,
                                                    granularity="node"))


def _replicas_story(graph: "UnitGraph", cluster_file: Path, single: Plan, out: Path,  # noqa: F821
                    console: Console) -> None:
    """Mixed data parallelism (issue #6) on the same cards: shown, and preferred only where it wins."""
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.errors import InfeasibleError
    from hetpipe.plan.replicas import partition_replicas
    from hetpipe.cli.tables import format_seconds, replica_table

    try:
        with console.status("planning mixed data-parallel replicas"):
            rep = partition_replicas(graph, load_cluster(cluster_file), global_batch=single.training.global_batch,
                                     time_limit_s=REPLICA_TIME_LIMIT_S)
    except InfeasibleError as err:
        console.print(f"  mixed replicas: none fits ({err})")
        return
    rep.save(out / "replicas.json")
    t_rep, t_one = rep.predicted.iteration_s, single.predicted.iteration_s
    verdict = "replicas win" if t_rep < t_one else "the single pipeline wins"
    console.print(f"  mixed replicas ({len(rep.replicas)}): {format_seconds(t_rep)} vs one pipeline "
                  f"{format_seconds(t_one)}: {verdict} ({t_one / t_rep:.2f}x); plan in {out / 'replicas.json'}")
    if t_rep < t_one:
        console.print(replica_table(rep))


def _timelines(plan: Plan, out: Path) -> tuple[Path, Path]:
    from hetpipe.cli.timeline import chrome_trace, save_gantt, stage_labels
    from hetpipe.plan.schema import problem_from_plan, stages_from_plan
    from hetpipe.partitioner.placement import simulate_placement

    result = simulate_placement(problem_from_plan(plan), stages_from_plan(plan))
    labels = stage_labels(plan)
    png, trace = out / "gantt.png", out / "trace.json"
    with atomic_path(png, option="--out") as tmp:  # a failed write is one error line, not a traceback
        save_gantt(result, tmp, labels=labels, suptitle=gantt_suptitle(plan),
                   title=f"{plan.model.name}: simulated 1F1B iteration {result.iteration_s:.3f} s "
                         f"(plan T {plan.predicted.iteration_s:.3f} s)")
    atomic_write_text(trace, json.dumps(chrome_trace(result, labels=labels, process="predicted (simulated)")),
                      option="--out")
    return png, trace


def _measured_gantt(plan: Plan, report: "RunReport", out: Path) -> Path | None:  # noqa: F821
    """Predicted (simulated) over measured (emulated seconds) Gantt and trace of the last step, if recorded."""
    from hetpipe.cli.timeline import write_run_timelines

    if not report.timelines:
        return None
    return write_run_timelines(plan, report, gantt=out / "gantt.png", trace=out / "trace.json",
                               suptitle=gantt_suptitle(plan), flags=("--out", "--out"))[0]


def gantt_suptitle(plan: Plan) -> str:
    """The demo Gantt's headline: model, cluster cards, T and the speed-up over the best hand-tuned baseline."""
    from hetpipe.plan.baseline_report import headline

    head = headline(plan)
    cards = " + ".join(dict.fromkeys(d.kind for d in plan.devices))
    over = (f"{head.speedup:.2f}x over the best hand-tuned baseline ({head.best_name})"
            if head.speedup is not None else "no baseline fits")
    forced = f", {head.forced_speedup:.2f}x over {head.forced_name} on every card" if head.forced_speedup else ""
    return f"{plan.model.name} on {cards}: T = {plan.predicted.iteration_s:.3f} s; {over}{forced}"


def settings_line(plan: Plan, *, seq: int) -> str:
    """What a plan was made with, as the flags of ``hetpipe plan`` (the demo's choices are not hidden).

    Example:
        >>> # settings_line(plan, seq=1024)
        >>> # 'settings: --batch 1 --seq 1024 --precision bf16-mixed --optimizer adam --global-batch 6 (6 micro-batches)'
    """
    t = plan.training
    return (f"settings: --batch {t.micro_batch_size} --seq {seq} --precision {t.precision} --optimizer {t.optimizer} "
            f"--global-batch {t.global_batch} ({t.microbatches} micro-batches of {t.micro_batch_size})")


def run_demo(*, out: Path, steps: int, run: bool, console: Console) -> int:
    """The demo (see the module docstring); returns the exit code."""
    from hetpipe.cli.tables import baseline_table, plan_table

    writable_folder(out, "--out")  # made here, checked before any work in cli/checks.py (an API call is checked here)
    console.rule("1. plan gpt-demo on the emulated home lab (3090 + 4090 | 1 GbE | 3060 12GB, scaled down)")
    with console.status("capturing gpt-demo and solving"):
        plan = _plan(DEMO_MODEL, bundled_cluster("homelab-mini.yaml"), batch=DEMO_BATCH, seq=DEMO_SEQ,
                     precision="fp32", global_batch=DEMO_BATCH * DEMO_MICROBATCHES)
    plan_path = out / "plan.json"
    plan.save(plan_path)
    console.print(settings_line(plan, seq=DEMO_SEQ))
    console.print(plan_table(plan))
    console.print(baseline_table(plan))
    for name, b in plan.baselines.items():
        if b.note:
            console.print(f"  {name} forced onto every card: {b.note}")
    console.rule("2. the same question at full size: GPT-2 XL on the real home lab (predicted)")
    with console.status("capturing GPT-2 XL on the meta device and solving"):
        big_graph = _graph(BIG_MODEL, batch=BIG_BATCH, seq=BIG_SEQ, precision="bf16-mixed")
        big = _plan_graph(big_graph, bundled_cluster("homelab.yaml"), global_batch=None,
                          capture_nodes=lambda: _graph(BIG_MODEL, batch=BIG_BATCH, seq=BIG_SEQ, precision="bf16-mixed",
                                                       granularity="node"))
    console.print(settings_line(big, seq=BIG_SEQ) + "; GPT-2 XL's default micro-batch of 4 in fp32 does not fit "
                  "the home lab (`hetpipe plan gpt2-xl` names the flags that do)")
    console.print(plan_table(big))
    console.print(baseline_table(big))
    for lo in big.left_out:
        console.print(f"  left out {lo.device}: {lo.reason}")
    _replicas_story(big_graph, bundled_cluster("homelab.yaml"), big, out, console)
    png, trace = _timelines(plan, out)
    if run:
        from hetpipe.runtime.run import run as run_plan
        from hetpipe.runtime.run import summary_tables

        console.rule(f"3. train {steps} steps of the gpt-demo plan, every device emulated (torchrun, gloo)")
        with console.status(f"training {steps} steps on 3 emulated devices (torchrun)"):
            report = run_plan(plan_path, model=DEMO_MODEL, steps=steps, emulate=True, seq=DEMO_SEQ,
                              report=out / "run.json")
        for table in summary_tables(report):
            console.print(table)
        measured = _measured_gantt(plan, report, out)
        if measured is not None:
            png = measured
    console.rule("files")
    replicas = out / "replicas.json"
    for path in (plan_path, out / "run.json" if run else None, png, trace, replicas if replicas.exists() else None):
        if path is not None:
            console.print(f"  {path}")
    console.print(f"  re-check the plan: hetpipe check {plan_path}")
    return 0
