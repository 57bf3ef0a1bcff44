"""One `hetpipe run` of a saved plan that writes checkpoints and may resume: the step of every
checkpoint-chain test (replica plans, tensor-parallel groups).

The folder holds the plans (``<name>.json``), the initial weights (``init.pt``) and the batches
(``data.pt``); each run writes its report and its checkpoints (``ck/``) under ``out``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from hetpipe.runtime.report import RunReport
from tests.forked_launch import forked_launches
from tests.machine_load import guard_s
from tests.test_run_cli import hetpipe_run


def run_with_checkpoints(folder: Path, plan: str, out: Path, *, model: str, seq: int, steps: int,
                         resume: Path | None, every: int | None = None, timeout_s: int = 60,
                         forked: bool = False) -> RunReport:
    """Run plan ``<plan>.json`` of ``folder`` to ``steps`` (from ``resume`` when given), checkpointing
    into ``out/ck`` (every ``every`` steps, else at the end); its report.  ``timeout_s`` is the ranks' wait
    bound on an idle machine, scaled by the load (a hang guard); ``forked``: the ranks fork from the test
    fork server (`tests.forked_launch`) instead of torchrun starting them."""
    out.mkdir(parents=True, exist_ok=True)
    # a resumed run continues the checkpoint's weights: --weights only starts a run (the two are refused together)
    extra = ["--resume", str(resume)] if resume is not None else ["--weights", str(folder / "init.pt")]
    extra += ["--checkpoint-every", str(every)] if every is not None else []
    wait_s = guard_s(timeout_s)
    with forked_launches() if forked else contextlib.nullcontext():
        rc = hetpipe_run([str(folder / f"{plan}.json"), "--model", model, "--seq", str(seq), "--steps", str(steps),
                          "--timeout", f"{wait_s:.0f}", "--data", str(folder / "data.pt"),
                          "--loss", "hetpipe.models:lm_loss",
                          "--report", str(out / "run.json"), "--checkpoint-dir", str(out / "ck"), *extra])
    assert rc == 0
    return RunReport.load(out / "run.json")


def write_inputs(folder: Path, model: str, steps: int) -> tuple[dict, list]:
    """Write the initial weights (seed 3) and ``steps`` global batches (seed 9) the runs read; return both."""
    import torch

    from tests.reference_loop import initial_state, seeded_batches

    state = initial_state(model, seed=3)
    torch.save(state, folder / "init.pt")
    batches = seeded_batches(steps, seed=9)
    torch.save(batches, folder / "data.pt")
    return state, batches


def momentum_reference(state: dict, batches: list, *, model: str, lr: float, momentum: float) -> tuple[list, dict]:
    """The plain single-device loop with SGD momentum: (losses, {steps done: (parameters, momentum buffers)})."""
    import torch

    from tests.reference_loop import reference_loop

    snapshots = {}

    def snapshot(step, net, opt):
        snapshots[step] = ({n: p.detach().clone() for n, p in net.state_dict().items()},
                           {n: opt.state[p]["momentum_buffer"].clone() for n, p in net.named_parameters()})

    losses, *_ = reference_loop(state, batches, lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum),
                                model_name=model, on_step=snapshot)
    return losses, snapshots


#: The momentum chains' model and data (tests/test_checkpoint_replicas.py, tests/test_checkpoint_groups.py):
#: gpt-tiny, micro-batches of 2 sequences of 16 tokens, 6 global batches of 8 samples, SGD + momentum.
MODEL, BATCH, SEQ, MICROBATCHES, STEPS, OPTIMIZER = "gpt-tiny", 2, 16, 4, 6, "momentum"


@dataclass(frozen=True)
class MomentumInputs:
    """What both momentum chains read: ``folder`` holds ``P2.json`` (the 2-stage pipeline), ``init.pt`` and
    ``data.pt`` (each chain saves its other plans beside them); ``reference`` is `momentum_reference` over
    all 6 batches.  No process is launched for it (the refusal tests need only the plans)."""

    folder: Path
    graph: object  # the UnitGraph the plans are made of (captured with SGD momentum's state tables)
    p2: object  # the Plan
    reference: tuple[list, dict]


@dataclass(frozen=True)
class MomentumStart:
    """The first link of both momentum chains: steps 0-1 on ``P2``, checkpoint at 2."""

    checkpoint: Path  # P2's checkpoint folder (step 2)
    report: RunReport


def momentum_plan(plan):
    """``plan`` training with SGD + momentum."""
    import dataclasses

    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, optimizer=OPTIMIZER))


def write_momentum_inputs(folder: Path) -> MomentumInputs:
    """Write P2 and the inputs into ``folder``; compute the reference loop (session fixture ``momentum_inputs``)."""
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture
    from hetpipe.partitioner.problem import Stage
    from hetpipe.runtime.rank import DEFAULT_LR, MOMENTUM
    from tests.runtime_plans import plan_for
    from tests.synthetic import synthetic_cluster

    meta, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(meta, inputs, name=MODEL, optimizer=OPTIMIZER)  # the plans' state tables are SGD momentum's
    n = graph.num_units
    p2 = momentum_plan(plan_for(graph, synthetic_cluster(), (Stage(0, 0, n // 2), Stage(1, n // 2 + 1, n - 1)),
                                microbatches=MICROBATCHES))
    p2.save(folder / "P2.json")
    state, batches = write_inputs(folder, MODEL, STEPS)
    reference = momentum_reference(state, batches, model=MODEL, lr=DEFAULT_LR[OPTIMIZER], momentum=MOMENTUM)
    return MomentumInputs(folder, graph, p2, reference)


def start_momentum_chain(inputs: MomentumInputs) -> MomentumStart:
    """Run P2 for 2 steps, checkpoint at 2: one launch shared by both chains (session fixture ``momentum_start``)."""
    out = inputs.folder / "p2"
    report = run_with_checkpoints(inputs.folder, "P2", out, model=MODEL, seq=SEQ, steps=2, resume=None, timeout_s=120)
    return MomentumStart(out / "ck", report)
