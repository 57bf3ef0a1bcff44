"""One `hetpipe run` of a saved plan that writes checkpoints and may resume: the step of every
checkpoint-chain test (replica plans, tensor-parallel groups).

The folder holds the plans (``<name>.json``), the initial weights (``init.pt``) and the batches
(``data.pt``); each run writes its report and its checkpoints (``ck/``) under ``out``.
"""

from __future__ import annotations

from pathlib import Path

from hetpipe.runtime.report import RunReport
from tests.test_run_cli import hetpipe_run


def run_with_checkpoints(folder: Path, plan: str, out: Path, *, model: str, seq: int, steps: int,
                         resume: Path | None, every: int | None = None, timeout_s: int = 60) -> RunReport:
    """Run plan ``<plan>.json`` of ``folder`` to ``steps`` (from ``resume`` when given), checkpointing
    into ``out/ck`` (every ``every`` steps, else at the end); its report."""
    out.mkdir(parents=True, exist_ok=True)
    extra = ["--resume", str(resume)] if resume is not None else []
    extra += ["--checkpoint-every", str(every)] if every is not None else []
    rc = hetpipe_run([str(folder / f"{plan}.json"), "--model", model, "--seq", str(seq), "--steps", str(steps),
                      "--timeout", str(timeout_s), "--data", str(folder / "data.pt"), "--loss", "hetpipe.models:lm_loss",
                      "--weights", str(folder / "init.pt"), "--report", str(out / "run.json"),
                      "--checkpoint-dir", str(out / "ck"), *extra])
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
