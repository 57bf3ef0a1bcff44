"""Issue #4, acceptance 6: the one prepared script to run when the device tool lends a GPU.

The lent machine has one GPU, and NCCL cannot pair two ranks on one device, so the
checks run in one process on that GPU:

1. **Stage modules on CUDA.**  ``--model`` is split into ``--stages`` uneven stages
   (`split_stages`), every stage built on the GPU from one seeded initialisation
   (`build_stage`), and the stages are chained forward and backward on one batch: the
   loss and every parameter's gradient (tied copies summed) must equal the whole model's
   on the same GPU (fp32, TF32 off; rtol 1e-4, atol 1e-5).
2. **Memory accounting.**  One `PipelineExecutor` runs the whole model as one stage with
   ``--microbatches`` micro-batches under 1F1B (Adam; one micro-batch in flight, as the
   cost model assumes for a last stage): its peak held
   bytes (`hetpipe.runtime.execute.held.HeldBytes`: parameters, gradients, optimizer state,
   saved activations) next to ``torch.cuda.max_memory_allocated()`` over the same step
   (the allocator's view: it adds temporaries, workspaces and rounding) and next to the
   cost model's prediction for that stage.
3. **Calibration.**  `calibrate_device` measures matmul FLOP/s (bf16 and fp32) and copy
   bandwidth; the cost model, given exactly those figures, predicts the stage's forward
   and backward per micro-batch, printed next to the executor's CUDA-synchronised
   timings.

Writes ``benchmarks/results/gpu_check.md``.  Without CUDA it stops with one line (exit
2); ``--device cpu`` runs the same code on the CPU (the memory row then has no allocator
figure), which is how the tests keep it working.

Usage:
    python benchmarks/gpu_check.py [--model gpt2-small] [--stages 3] [--microbatches 4] [--batch 4]

Example:
    $ OMP_NUM_THREADS=1 python benchmarks/gpu_check.py --device cpu --model gpt-tiny --batch 2 --seq 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_check.md"
RTOL, ATOL = 1e-4, 1e-5


def _setup(args: argparse.Namespace) -> tuple[Any, tuple[torch.Tensor, ...], Any]:
    """(UnitGraph on meta, one meta micro-batch, the model's loss function)."""
    from hetpipe.models import build, training_loss
    from hetpipe.partitioner.capture.capture import capture

    model, inputs = build(args.model, device="meta", batch=args.batch, seq=args.seq)
    fn, targets = training_loss(args.model, inputs)
    graph = capture(model, inputs, name=args.model, loss_fn=fn, targets=targets)
    return graph, inputs, fn


def _batch(args: argparse.Namespace, graph: Any, example: tuple[torch.Tensor, ...], *, rows: int,
           step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``hetpipe run``'s synthetic global batch of ``rows`` samples (inputs, targets) on ``args.device``."""
    from hetpipe.runtime.data import data_stream

    stream = data_stream(None, model=args.model, global_batch=rows, seed=step, example=example,
                         meta_model=graph.module)
    x, y = next(stream)
    x = x[0] if isinstance(x, (tuple, list)) else x
    return x.to(args.device), y.to(args.device)


def check_stages(args: argparse.Namespace, graph: Any, example: tuple[torch.Tensor, ...], loss_fn: Any
                 ) -> dict[str, float]:
    """Chained stage modules vs the whole model on ``device``: max relative loss and gradient errors."""
    from hetpipe.runtime.stage.build import build_stage, split_stages

    stages, device = args.stages, args.device
    n = graph.num_units
    mapping = {name: min(stages - 1, u.index * stages // n) for u in graph.units for name in u.node_names}
    program = split_stages(graph.module, mapping, example_inputs=example, num_stages=stages, tied=graph.tied)
    parts = [build_stage(program, s, state_dict=None, device=device, seed=0) for s in range(stages)]
    whole = build_stage(split_stages(graph.module, {}, example_inputs=example, num_stages=1, tied=graph.tied), 0,
                        state_dict=None, device=device, seed=0)
    x, y = _batch(args, graph, example, rows=args.batch * args.microbatches)
    ref_loss = loss_fn(whole(x), y)
    ref_loss.backward()
    acts: Any = (x,)
    for part in parts:
        out = part(*acts)
        acts = out if isinstance(out, tuple) else (out,)
    loss = loss_fn(acts[0], y)
    loss.backward()
    grads: dict[str, torch.Tensor] = {}
    for part in parts:
        canon = {g.local_name(part.stage): g.canonical_name for g in part.tied_groups}
        for name, p in part.module.named_parameters():
            key = canon.get(name, name)
            grads[key] = grads[key] + p.grad if key in grads else p.grad.clone()
    ref = dict(whole.module.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, g in grads.items():
        torch.testing.assert_close(g, ref[name].grad, rtol=RTOL, atol=ATOL, msg=lambda m, k=name: f"grad {k}: {m}")
        worst = max(worst, float((g - ref[name].grad).abs().max() / ref[name].grad.abs().max().clamp_min(1e-30)))
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    loss_err = abs(float(loss.detach() - ref_loss.detach())) / abs(float(ref_loss.detach()))
    return {"params": float(len(grads)), "loss_rel_err": loss_err,
            "grad_rel_err": worst}


def check_memory_and_timing(args: argparse.Namespace, graph: Any, example: tuple[torch.Tensor, ...], loss_fn: Any,
                            profile: Any) -> dict[str, float]:
    """One-stage 1F1B step: held bytes vs the allocator's peak vs the cost model; timings vs predicted."""
    from hetpipe.cost_models.devices import Cluster, Device
    from hetpipe.plan.build import build_problem
    from hetpipe.partitioner.problem import Stage, evaluate
    from hetpipe.runtime.execute.executor import PipelineExecutor
    from hetpipe.runtime.execute.options import ExecutorOptions
    from hetpipe.schedule.builders import one_f_one_b
    from hetpipe.runtime.stage.build import build_stage, split_stages

    microbatches, device = args.microbatches, args.device
    program = split_stages(graph.module, {}, example_inputs=example, num_stages=1, tied=graph.tied)
    stage = build_stage(program, 0, state_dict=None, device=device, seed=0)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-4)
    ex = PipelineExecutor(stage, rank=0, num_stages=1, schedule_actions=one_f_one_b(1, microbatches)[0], loss_fn=loss_fn,
                          optimizer=opt, microbatches=microbatches, options=ExecutorOptions(timeout_s=60.0))
    x, y = _batch(args, graph, example, rows=args.batch * microbatches, step=1)
    xs, ys = list(x.chunk(microbatches)), list(y.chunk(microbatches))
    cuda = device.startswith("cuda")
    fwd, bwd, alloc_peak = [], [], float("nan")
    for step in range(4):  # step 0 allocates Adam's state; steps 1.. are what a run repeats
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        stats = ex.step(xs, ys)
        if cuda and step == 3:
            alloc_peak = float(torch.cuda.max_memory_allocated())
        if step:
            fwd += stats.forward_s
            bwd += stats.backward_s
    dev = Device(id="gpu:0", node="n0", profile=profile, reserve_bytes=0)
    problem = build_problem(graph, Cluster(name="lent", devices=(dev,), links={}), microbatches=microbatches)
    cost = evaluate(problem, (Stage(0, 0, graph.num_units - 1),)).stages[0]
    return {"held_peak_bytes": float(stats.memory.peak_bytes), "alloc_peak_bytes": alloc_peak,
            "predicted_bytes": float(cost.memory_bytes), "fwd_s": statistics.median(fwd),
            "bwd_s": statistics.median(bwd), "predicted_fwd_s": cost.fwd_s, "predicted_bwd_s": cost.bwd_s}


def _profile(device: str, calibration: Any) -> Any:
    from hetpipe.cost_models.devices import DeviceProfile

    props = torch.cuda.get_device_properties(device) if device.startswith("cuda") else None
    memory = int(props.total_memory) if props is not None else 2**40
    kind = props.name.lower().replace(" ", "-") if props is not None else "cpu"
    return DeviceProfile(kind, memory, calibration.tensor_matmul_flops_s, calibration.fp32_matmul_flops_s,
                         calibration.memory_bandwidth_bytes_s, matmul_efficiency=1.0, bandwidth_efficiency=1.0,
                         source=f"calibrated on {device} by benchmarks/gpu_check.py")


def report(args: argparse.Namespace, cal: Any, stages: dict[str, float], mem: dict[str, float]) -> list[str]:
    mib = 2**20
    alloc = mem["alloc_peak_bytes"]
    alloc_cell = "n/a (CPU)" if alloc != alloc else f"{alloc / mib:.1f} MiB ({mem['held_peak_bytes'] / alloc:.3f})"
    return [
        f"# GPU check ({args.device}, {torch.cuda.get_device_name(args.device) if args.device.startswith('cuda') else 'CPU'})",
        "", f"`python benchmarks/gpu_check.py --device {args.device} --model {args.model} --stages {args.stages} "
            f"--microbatches {args.microbatches} --batch {args.batch}` -- torch {torch.__version__}", "",
        "| check | figure |", "|---|---|",
        f"| stage modules ({args.stages} stages) vs whole model | {int(stages['params'])} parameters; max relative "
        f"gradient error {stages['grad_rel_err']:.2e}, loss {stages['loss_rel_err']:.2e} (rtol {RTOL}) |",
        f"| matmul bf16 / fp32 (measured) | {cal.tensor_matmul_flops_s / 1e12:.1f} / "
        f"{cal.fp32_matmul_flops_s / 1e12:.1f} TFLOP/s |",
        f"| copy bandwidth (measured) | {cal.memory_bandwidth_bytes_s / 1e9:.0f} GB/s |",
        f"| held peak (executor accounting) | {mem['held_peak_bytes'] / mib:.1f} MiB |",
        f"| allocator peak (held / allocator) | {alloc_cell} |",
        f"| cost model, stage memory (held / predicted) | {mem['predicted_bytes'] / mib:.1f} MiB "
        f"({mem['held_peak_bytes'] / mem['predicted_bytes']:.3f}) |",
        f"| F per micro-batch, measured / predicted | {mem['fwd_s'] * 1e3:.3f} / {mem['predicted_fwd_s'] * 1e3:.3f} ms "
        f"({mem['fwd_s'] / mem['predicted_fwd_s']:.2f}) |",
        f"| B per micro-batch, measured / predicted | {mem['bwd_s'] * 1e3:.3f} / {mem['predicted_bwd_s'] * 1e3:.3f} ms "
        f"({mem['bwd_s'] / mem['predicted_bwd_s']:.2f}) |",
    ]


def main(argv: list[str] | None = None) -> int:
    from hetpipe.cost_models.calibrate import calibrate_device

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device here; run this on the lent GPU machine, or pass --device cpu for a dry run",
              file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 numerics check (TF32 would need rtol ~1e-3)
    torch.backends.cudnn.allow_tf32 = False
    graph, example, loss_fn = _setup(args)
    stages = check_stages(args, graph, example, loss_fn)
    small = args.device == "cpu"
    cal = calibrate_device(args.device, size=256 if small else 8192, repeats=3 if small else 10,
                           copy_bytes=2**22 if small else 2**30)
    mem = check_memory_and_timing(args, graph, example, loss_fn, profile=_profile(args.device, cal))
    lines = report(args, cal, stages, mem)
    print("\n".join(lines))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
