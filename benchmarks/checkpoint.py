"""Issue 16, item 1: checkpoints that move between plans -- size and save time per stage, and resuming
one checkpoint on other plans, checked against a plain single-device PyTorch loop.

``gpt-demo`` (seq 64, micro-batch 2, global batch 8, Adam) is cut by hand into 3 stages and trained 4 steps with ``hetpipe.run(...,
checkpoint_dir=, checkpoint_every=2)`` (gloo, not emulated).  Per stage: the parameter + buffer
bytes and Adam state bytes the rank saved, its files on disk, and its seconds inside ``dcp.save``
(from the checkpoint's marker), at step 2 and step 4.  Then the step-2 checkpoint is resumed for
2 more steps on the same plan and on three others (a hand 2-stage cut, a hand 4-stage cut, the
planner's cut of ``examples/clusters/homelab-mini.yaml``); each resumed run saves again at step 4, and its losses and final
parameters are compared with a single-device loop over the same weights and data (max abs diff),
the same-plan resume also with the uninterrupted run (bitwise: 0).  A plan with a tensor-parallel group
(stage 0 on two cards at shares 0.7 / 0.3) resumes the step-2 checkpoint too, saves at steps 3 and 4
(size, gather and save time per stage), and its step-3 checkpoint is resumed on the 3-stage source plan.

Usage:
    python benchmarks/checkpoint.py

Writes ``benchmarks/results/checkpoint.md``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import markdown_table, write_result  # noqa: E402

MODEL, BATCH, SEQ, GLOBAL, STEPS, EVERY = "gpt-demo", 2, 64, 8, 4, 2


def _plans(tmp: Path) -> dict[str, Path]:
    """The source plan (a hand 3-stage cut, first) and the plans the checkpoint is resumed on."""
    import hetpipe
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture
    from hetpipe.partitioner.problem import Stage
    from tests.runtime_plans import plan_for
    from tests.synthetic import synthetic_cluster

    meta, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(meta, inputs, name=MODEL)
    n, m = graph.num_units, GLOBAL // BATCH
    four = synthetic_cluster((("n0", "fast", 40.0, 24.0), ("n0", "mid", 30.0, 24.0), ("n1", "slow", 10.0, 12.0),
                              ("n1", "slow", 10.0, 12.0)))
    hand = (("hand, 3 stages (source)", synthetic_cluster(), (Stage(0, 0, 2), Stage(1, 3, n - 4), Stage(2, n - 3, n - 1))),
            ("hand, 2 stages", synthetic_cluster(), (Stage(0, 0, n // 2 - 1), Stage(1, n // 2, n - 1))),
            ("hand, 4 stages", four, (Stage(0, 0, 1), Stage(1, 2, n // 2), Stage(2, n // 2 + 1, n - 3),
                                      Stage(3, n - 2, n - 1))))
    out = {}
    for label, cluster, stages in hand:
        out[label] = tmp / f"{label.split(' (')[0].replace(', ', '-').replace(' ', '')}.json"
        plan_for(graph, cluster, stages, microbatches=m).save(out[label])
    plan = hetpipe.partition(meta, ROOT / "examples" / "clusters" / "homelab-mini.yaml", example_inputs=inputs,
                             global_batch=GLOBAL, name=MODEL)
    out["planner, homelab-mini"] = tmp / "homelab-mini.json"
    plan.save(out["planner, homelab-mini"])
    out.update(_replica_plans(graph, tmp))
    out[GROUPED] = tmp / "grouped.json"
    _grouped_plan(meta, inputs).save(out[GROUPED])
    return out


GROUPED = "group 0.7 / 0.3 + 1 card"
SHARES = (0.7, 0.3)


def _grouped_plan(meta, inputs):
    """Stage 0 (units 0-3) on a tensor-parallel group of two cards at shares 0.7 / 0.3 (an RTX 3090 leading
    a 3060: tests/test_tp_runtime.py's plan), stage 1 (the rest) on a 4090; Adam, m = 4."""
    import dataclasses

    from hetpipe.cost_models.cluster import cluster_from_dict
    from hetpipe.partitioner.capture.capture import capture
    from hetpipe.partitioner.problem import Stage, evaluate
    from hetpipe.plan.build import assemble_plan, build_problem
    from hetpipe.plan.schema import SolverReport

    graph = capture(meta, inputs, name=MODEL)
    cluster = cluster_from_dict({"nodes": [{"name": "box", "intra": "pcie-host", "devices": [
        {"gpu": "rtx3090"}, {"gpu": "rtx3060-12gb"}, {"gpu": "rtx4090"}]}]})
    problem = build_problem(graph, cluster, microbatches=GLOBAL // BATCH, tensor_parallel="auto")
    stages = (Stage(0, 0, 3, members=(0, 1)), Stage(2, 4, graph.num_units - 1))
    ev = evaluate(problem, stages)
    plan = assemble_plan(graph, cluster, problem=problem, stages=stages, global_batch=GLOBAL,
                         solver=SolverReport("hand", "FEASIBLE", ev.iteration_s, 0.0, 0.0))
    return dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], group_shares=SHARES),
                                             *plan.stages[1:]))


def _replica_plans(graph, tmp: Path) -> dict[str, Path]:
    """Replica plans the checkpoint also resumes on: 2 replicas (2 stages, m = 3 | 1 stage, m = 1) and the
    same with every sync group's optimizer state sharded 0.75 / 0.25 (ZeRO-1)."""
    import dataclasses

    from hetpipe.partitioner.problem import Stage
    from hetpipe.plan.shard_schema import PlanShard
    from tests.runtime_plans import replica_plan_for
    from tests.synthetic import synthetic_cluster

    n = graph.num_units
    plan = replica_plan_for(graph, synthetic_cluster(), [((Stage(0, 0, n // 2), Stage(1, n // 2 + 1, n - 1)), 3),
                                                         ((Stage(2, 0, n - 1),), 1)])
    groups = tuple(dataclasses.replace(g, shard=PlanShard((0.75, 0.25), 0, (0, 0), g.time_s))
                   for g in plan.sync.groups)
    sharded = dataclasses.replace(plan, sync=dataclasses.replace(plan.sync, groups=groups))
    out = {"replicas: 2 (m = 3, m = 1)": tmp / "replicas.json",
           "replicas, sharded 0.75 / 0.25": tmp / "replicas-sharded.json"}
    plan.save(out["replicas: 2 (m = 3, m = 1)"])
    sharded.save(out["replicas, sharded 0.75 / 0.25"])
    return out


def _cuts(path: Path) -> str:
    plan = json.loads(path.read_text())
    return " \\| ".join(f"{s['first_unit']}-{s['last_unit']} {'+'.join(s.get('group_devices') or [s['device']])}"
                         for s in plan["stages"])


def _data(tmp: Path) -> tuple[dict, list]:
    import torch

    from hetpipe.models import build

    torch.manual_seed(1)
    model, _ = build(MODEL, device="cpu", batch=BATCH, seq=SEQ)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, tmp / "init.pt")
    gen = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, 512, (GLOBAL, SEQ), generator=gen)
        batches.append((ids, torch.roll(ids, -1, 1)))
    torch.save(batches, tmp / "data.pt")
    return state, batches


def _reference(state: dict, batches: list) -> tuple[list[float], dict]:
    import torch

    from hetpipe.models import build, lm_loss
    from hetpipe.runtime.rank import DEFAULT_LR

    model, _ = build(MODEL, device="cpu", batch=BATCH, seq=SEQ)
    model.load_state_dict(state)
    opt = torch.optim.Adam(model.parameters(), lr=DEFAULT_LR["adam"])
    m, losses = GLOBAL // BATCH, []
    for ids, targets in batches:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(ids.chunk(m), targets.chunk(m)):
            loss = lm_loss(model(x), y) / m
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(plan: Path, tmp: Path, ck: Path, **kw: object):
    import hetpipe

    return hetpipe.run(plan, model=MODEL, steps=STEPS, seq=SEQ, data=str(tmp / "data.pt"), loss="hetpipe.models:lm_loss",
                       weights=tmp / "init.pt", checkpoint_dir=ck, timeout_s=120.0, **kw)


def _max_param_diff(folder: Path, ref: dict) -> float:
    from tests.test_checkpoint import read_checkpoint

    saved = read_checkpoint(folder)
    return max(float((saved[f"model/{k}"] - v).abs().max()) for k, v in ref.items() if f"model/{k}" in saved)


def _size_rows(folder: Path) -> list[list[object]]:
    info = json.loads((folder / "hetpipe-checkpoint.json").read_text())
    rows = []
    for s, (save_s, mb, ob) in enumerate(zip(info["stage_save_s"], info["stage_model_bytes"],
                                             info["stage_optim_bytes"])):
        disk = sum(p.stat().st_size for p in folder.glob(f"__{s}_*.distcp"))
        rows.append([info["step"], s, f"{mb / 2**20:.2f}", f"{ob / 2**20:.2f}", f"{(mb + ob) / 2**20:.2f}",
                     f"{disk / 2**20:.2f}", f"{disk / (mb + ob):.3f}" if mb + ob else "-", f"{save_s * 1000:.0f}"])
    return rows


def _group_rows(folder: Path, plan: Path) -> list[list[object]]:
    """Per stage of the grouped plan's checkpoint: what its lead wrote (whole tensors), the gather before it."""
    stages = json.loads(plan.read_text())["stages"]
    info = json.loads((folder / "hetpipe-checkpoint.json").read_text())
    rows, rank = [], 0
    for s, st in enumerate(stages):
        width = len(st.get("group_devices") or [st["device"]])
        disk = sum(p.stat().st_size for r in range(rank, rank + width) for p in folder.glob(f"__{r}_*.distcp"))
        rank += width
        mb, ob = info["stage_model_bytes"][s], info["stage_optim_bytes"][s]
        gathered = info["stage_gather_bytes"][s]
        rows.append([info["step"], s, width, f"{mb / 2**20:.2f}", f"{ob / 2**20:.2f}", f"{disk / 2**20:.2f}",
                     f"{gathered / 2**20:.2f}", f"{gathered / (mb + ob):.3f}" if mb + ob else "-",
                     f"{info['stage_gather_s'][s] * 1000:.0f}", f"{info['stage_save_s'][s] * 1000:.0f}"])
    return rows


def _resume_row(label: str, plans: dict, tmp: Path, source: Path, *, at: int, ref_losses, ref_state,
                full) -> list[object]:
    """Resume ``source`` (a checkpoint folder at step ``at``) on plan ``label``; the row of the resume table."""
    ck = tmp / f"ck-from-{source.parent.name}-{plans[label].stem}"
    start = time.perf_counter()
    rep = _run(plans[label], tmp, ck, resume=source)
    wall = time.perf_counter() - start
    loss_diff = max(abs(a - b) for a, b in zip(rep.losses, ref_losses[at:]))
    vs_full = max(abs(a - b) for a, b in zip(rep.losses, full.losses[at:]))
    return [f"resume at step {at} (the group's checkpoint)", label, _cuts(plans[label]),
            f"{loss_diff:.1e}", f"{_max_param_diff(ck / f'step-{STEPS:06d}', ref_state):.1e}", f"{vs_full:.1e}",
            f"{wall:.0f}"]


def main() -> int:
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # reading back in this process
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        plans = _plans(tmp)
        state, batches = _data(tmp)
        ref_losses, ref_state = _reference(state, batches)
        source = next(iter(plans))
        replica_rows: list[list[object]] = []
        group_rows: list[list[object]] = []
        start = time.perf_counter()
        full = _run(plans[source], tmp, tmp / "ck", checkpoint_every=EVERY)
        full_s = time.perf_counter() - start
        size_rows = _size_rows(tmp / "ck" / "step-000002") + _size_rows(tmp / "ck" / "step-000004")
        rows = [["(uninterrupted)", source, _cuts(plans[source]),
                 f"{max(abs(a - b) for a, b in zip(full.losses, ref_losses)):.1e}",
                 f"{_max_param_diff(tmp / 'ck' / 'step-000004', ref_state):.1e}", "-", f"{full_s:.0f}"]]
        for label, path in plans.items():
            ck = tmp / f"ck-{path.stem}"
            start = time.perf_counter()
            grouped = label == GROUPED  # saves at step 3 too: resumed on the source plan below
            rep = _run(path, tmp, ck, resume=tmp / "ck" / "step-000002", checkpoint_every=1 if grouped else None)
            wall = time.perf_counter() - start
            loss_diff = max(abs(a - b) for a, b in zip(rep.losses, ref_losses[EVERY:]))
            vs_full = max(abs(a - b) for a, b in zip(rep.losses, full.losses[EVERY:]))
            rows.append([f"resume at step {EVERY}", label, _cuts(path), f"{loss_diff:.1e}",
                         f"{_max_param_diff(ck / 'step-000004', ref_state):.1e}", f"{vs_full:.1e}", f"{wall:.0f}"])
            print(rows[-1], flush=True)
            if label.startswith("replicas"):
                replica_rows += [[label, *row] for row in _size_rows(ck / "step-000004")]
            if grouped:
                group_rows = _group_rows(ck / "step-000003", path) + _group_rows(ck / "step-000004", path)
                rows.append(_resume_row(source, plans, tmp, ck / "step-000003", at=3, ref_losses=ref_losses,
                                        ref_state=ref_state, full=full))
                print(rows[-1], flush=True)
    load_after = os.getloadavg()
    body = "\n\n".join([
        f"`{MODEL}` (seq {SEQ}, micro-batch {BATCH}, global batch {GLOBAL}, Adam, fp32), `hetpipe.run` on gloo "
        f"without emulation, {STEPS} steps, checkpoints every {EVERY}. Load average (1/5/15 min) before "
        f"{load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, after "
        f"{load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} (the 2-core machine is shared: save "
        "times are indicative).",
        "**Size and save time per stage** (the source plan: 3 stages). Saved = "
        "parameters + buffers + Adam state (exp_avg, exp_avg_sq, step) of the stage; a tied parameter is saved by "
        "its first stage only. Disk = the rank's `.distcp` files (random generator states included); "
        "save = seconds inside `dcp.save` on that rank (collective: it includes waiting for the slowest rank).",
        markdown_table(["step", "stage", "params+buffers MiB", "Adam state MiB", "saved MiB", "disk MiB",
                        "disk / saved", "save ms"], size_rows),
        "**Resume onto other plans.** The step-2 checkpoint of the source plan resumed for 2 more steps; "
        "max abs diff of the per-step losses and of the final parameters vs a plain single-device PyTorch loop "
        "over the same initial weights and data (acceptance: 1e-5), and of the losses vs the uninterrupted run "
        "(same plan: bitwise, 0). Wall = the whole `hetpipe.run` (torchrun start-up included).",
        markdown_table(["run", "plan", "stages: units device", "loss diff vs 1 device", "param diff vs 1 device",
                        "loss diff vs uninterrupted", "wall s"], rows),
        "**Replica plans** (the rows above starting `replicas`; stages listed replica after replica): the step-4 "
        "checkpoint each wrote, per plan stage. Replica 0's ranks write every tensor once; replica 1's rank writes "
        "only its random generators (its parameters and state equal replica 0's). Sharded: replica 0's holders "
        "all-gather the group's Adam state from both holders, then write it whole (save includes that gather). "
        "Adam's default eps 1e-8 lets the replicas' summation order move near-zero-gradient elements "
        "(tests/test_shard_runtime.py), which the param diff shows if it exceeds the pipelines'.",
        markdown_table(["plan", "step", "plan stage", "params+buffers MiB", "Adam state MiB", "saved MiB", "disk MiB",
                        "disk / saved", "save ms"], replica_rows),
        f"**Tensor-parallel group** (`{GROUPED}`: stage 0 = units 0-3 on two cards at shares {SHARES[0]} / "
        f"{SHARES[1]}, stage 1 one card): its checkpoints at steps 3 and 4, per plan stage. The group's members "
        "all-gather every split parameter and its Adam moments along the split dimension "
        "(`hetpipe.runtime.checkpoint.groups`), then the lead writes them whole under the model's names (the layout "
        "a width-1 stage writes); the member writes only its random generators. Gathered = the whole split "
        "tensors assembled, summed over the members (each receives the others' slices); gather ms = the slowest "
        "member's seconds in that all-gather, before `dcp.save`; save ms = seconds inside `dcp.save`. Disk = every "
        "member's `.distcp` files. The resume table's rows `" + GROUPED + "` (the source's step-2 checkpoint "
        "resumed on the group) and `resume at step 3 (the group's checkpoint)` (the group's own checkpoint resumed "
        "on the 3-stage source plan) show the equality with one device.",
        markdown_table(["step", "plan stage", "cards", "params+buffers MiB", "Adam state MiB", "disk MiB",
                        "gathered MiB", "gathered / saved", "gather ms", "save ms"], group_rows),
    ])
    print(body)
    write_result("checkpoint", "Checkpoints that move between plans (issue 16)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
