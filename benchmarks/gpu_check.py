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
   cost model's prediction for that stage: the ledger against M_s less its backward and step transients,
   the allocator against M_s (memory model 5: the loss's 2 x logits and the optimizer step's list in).  On a CPU the
   allocator's figure is the step's live storages, counted (`capture.transients.BackwardPeak`).
3. **Calibration.**  `calibrate_device` measures matmul FLOP/s (bf16 and fp32) and copy
   bandwidth; the cost model, given exactly those figures, predicts the stage's forward
   and backward per micro-batch, printed next to the executor's CUDA-synchronised
   timings.

Writes ``benchmarks/results/gpu_check.md``.  Without CUDA it stops with one line (exit
2); ``--device cpu`` runs the same code on the CPU (the allocator's figure then counts live
storages), which is how the tests keep it working.

Usage:
    python benchmarks/gpu_check.py [--model gpt2-small] [--stages 3] [--microbatches 4] [--batch 4]

Example:
    $ OMP_NUM_THREADS=1 python benchmarks/gpu_check.py --device cpu --model gpt-tiny --batch 2 --seq 16
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_check.md"
RTOL, ATOL = 1e-4, 1e-5
# What one lent GPU checks by default: two GPTs and a Llama (name:batch:seq per micro-batch).
DEFAULT_MODELS = "gpt2-small:4:1024,gpt2-medium:4:1024,llama-1b:1:2048"


def _setup(args: argparse.Namespace) -> tuple[Any, tuple[torch.Tensor, ...], Any]:
    """(UnitGraph on meta, one meta micro-batch, the model's loss function)."""
    from hetpipe.models import build, training_loss
    from hetpipe.partitioner.capture.capture import capture
    from hetpipe.runtime.stage.buffers import ModelBuffers

    model, inputs = build(args.model, device="meta", batch=args.batch, seq=args.seq)
    fn, targets = training_loss(args.model, inputs)
    graph = capture(model, inputs, name=args.model, loss_fn=fn, targets=targets)
    # Buffers (rotary tables, ...) are recomputed from the meta model, as `hetpipe run`'s ranks do.
    args.buffers = ModelBuffers(model)
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
                 ) -> tuple[dict[str, float], list[Any], dict[str, int]]:
    """Chained stage modules vs the whole model on ``device``: max relative loss and gradient errors.

    Also returns the stage modules and the unit -> stage mapping, which `check_stage_times` times.
    """
    from hetpipe.runtime.stage.build import build_stage, split_stages

    stages, device = args.stages, args.device
    n = graph.num_units
    unit_stage = {u.index: min(stages - 1, u.index * stages // n) for u in graph.units}
    mapping = {name: unit_stage[u.index] for u in graph.units for name in u.node_names}
    program = split_stages(graph.module, mapping, example_inputs=example, num_stages=stages, tied=graph.tied)
    parts = [build_stage(program, s, state_dict=None, device=device, seed=0,
                         buffers=args.buffers) for s in range(stages)]
    whole = build_stage(split_stages(graph.module, {}, example_inputs=example, num_stages=1, tied=graph.tied), 0,
                        state_dict=None, device=device, seed=0,
                         buffers=args.buffers)
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
    del whole, ref
    return {"params": float(len(grads)), "loss_rel_err": loss_err, "grad_rel_err": worst}, parts, unit_stage


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
    # Earlier checks' modules sit in reference cycles until a collection: free them, then count from here.
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    base_bytes = float(torch.cuda.memory_allocated()) if device.startswith("cuda") else 0.0
    program = split_stages(graph.module, {}, example_inputs=example, num_stages=1, tied=graph.tied)
    stage = build_stage(program, 0, state_dict=None, device=device, seed=0,
                         buffers=args.buffers)
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
        if not cuda and step == 3:  # the CPU's stand-in for the allocator: live storages, counted
            stats, alloc_peak = cpu_step_peak(ex, stage, opt, xs, ys)
            continue
        stats = ex.step(xs, ys)
        if cuda and step == 3:
            alloc_peak = float(torch.cuda.max_memory_allocated()) - base_bytes
        if step:
            fwd += stats.forward_s
            bwd += stats.backward_s
    from benchmarks.gpu_peak import executor_peak  # after main() put the checkout on sys.path
    args.peak_lines = executor_peak(ex, xs, ys) if cuda else []
    dev = Device(id="gpu:0", node="n0", profile=profile, reserve_bytes=0)
    problem = build_problem(graph, Cluster(name="lent", devices=(dev,), links={}), microbatches=microbatches)
    whole = (Stage(0, 0, graph.num_units - 1),)
    cost = evaluate(problem, whole).stages[0]
    # M_s less its backward (model 4) and step (model 5) transients: what the executor's ledger counts
    ledger = evaluate(dataclasses.replace(problem, transient_bwd_bytes=(), step_transient={}),
                      whole).stages[0].memory_bytes
    return {"held_peak_bytes": float(stats.memory.peak_bytes), "alloc_peak_bytes": alloc_peak,
            "predicted_bytes": float(cost.memory_bytes), "predicted_ledger_bytes": float(ledger),
            "fwd_s": statistics.median(fwd),
            "bwd_s": statistics.median(bwd), "predicted_fwd_s": cost.fwd_s, "predicted_bwd_s": cost.bwd_s}


def cpu_step_peak(ex: Any, stage: Any, opt: Any, xs: list[Any], ys: list[Any]) -> tuple[Any, float]:
    """(the step's stats, its peak bytes) on a CPU: parameters, buffers, Adam's state and the micro-batches,
    plus the most bytes the step's ops hold at once (`capture.transients.BackwardPeak` over real tensors)."""
    from hetpipe.partitioner.capture.transients import BackwardPeak

    with BackwardPeak("fp32") as peak:
        stats = ex.step(xs, ys)
    held = [*stage.module.parameters(), *stage.module.buffers(), *xs, *ys,
            *(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))]
    before = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    return stats, float(sum(before.values()) + peak.peak_bytes)


TIMED_REPEATS = 5  # timed forward+backward passes per stage after two warm-ups; the median is reported


def _elapsed_s(fn: Any, device: str) -> float:
    """Seconds ``fn()`` takes on ``device``: CUDA events around it on a GPU (kernels are asynchronous)."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _time_stage(part: Any, acts: tuple[Any, ...], last: bool, loss_fn: Any, y: torch.Tensor,
                device: str) -> tuple[float, float, tuple[Any, ...]]:
    """Median forward and backward seconds of one stage on one micro-batch, and its (detached) outputs."""
    fwd, bwd = [], []
    box: dict[str, Any] = {}
    for rep in range(TIMED_REPEATS + 2):
        ins = tuple(a.detach().requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a for a in acts)

        def forward() -> None:
            out = part(*ins)
            box["out"] = out if isinstance(out, tuple) else (out,)
            if last:
                box["loss"] = loss_fn(box["out"][0], y)

        def backward() -> None:
            if last:
                box["loss"].backward()
                return
            outs = [o for o in box["out"] if torch.is_tensor(o) and o.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        f, b = _elapsed_s(forward, device), _elapsed_s(backward, device)
        if rep >= 2:  # the first passes pay allocator growth and kernel selection
            fwd.append(f)
            bwd.append(b)
    for param in part.parameters():
        param.grad = None
    return statistics.median(fwd), statistics.median(bwd), tuple(
        o.detach() if torch.is_tensor(o) else o for o in box["out"])


def check_stage_times(args: argparse.Namespace, graph: Any, example: tuple[torch.Tensor, ...], loss_fn: Any,
                      profile: Any, parts: list[Any], unit_stage: dict[int, int],
                      shaped: Any = None) -> list[dict[str, float]]:
    """Each stage's forward and backward on one micro-batch, measured beside the cost model's F_s and B_s
    (and, given ``shaped``, a profile with matmul rates by shape, beside those it prices)."""
    from hetpipe.cost_models.devices import Cluster, Device, Link
    from hetpipe.partitioner.problem import Stage, evaluate
    from hetpipe.plan.build import build_problem

    spans = [[u for u, s in unit_stage.items() if s == k] for k in range(len(parts))]

    def priced(prof: Any) -> Any:
        devs = tuple(Device(id=f"gpu:{s}", node="n0", profile=prof, reserve_bytes=0) for s in range(len(parts)))
        # Any link will do: only F_s and B_s are compared (the stages share one GPU, nothing is sent).
        links = {(a.id, b.id): Link(a.id, b.id, 1e12, 0.0) for a in devs for b in devs if a.id != b.id}
        problem = build_problem(graph, Cluster(name="lent", devices=devs, links=links), microbatches=args.microbatches)
        return evaluate(problem, tuple(Stage(k, min(us), max(us)) for k, us in enumerate(spans))).stages

    costs = priced(profile)
    by_shape = priced(shaped) if shaped is not None else costs
    x, y = _batch(args, graph, example, rows=args.batch, step=2)
    acts: tuple[Any, ...] = (x,)
    rows = []
    for k, part in enumerate(parts):
        f, b, acts = _time_stage(part, acts, k == len(parts) - 1, loss_fn, y, args.device)
        rows.append({"stage": float(k), "units": float(len(spans[k])), "fwd_s": f, "bwd_s": b,
                     "predicted_fwd_s": costs[k].fwd_s, "predicted_bwd_s": costs[k].bwd_s,
                     "shaped_fwd_s": by_shape[k].fwd_s, "shaped_bwd_s": by_shape[k].bwd_s})
    return rows


def _phase_peak(fn: Any) -> tuple[Any, float, float]:
    """(fn's result, bytes allocated at its start, its peak bytes above that start) on the current CUDA device."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, float(start), float(torch.cuda.max_memory_allocated() - start)


def check_transients(args: argparse.Namespace, graph: Any, example: tuple[torch.Tensor, ...], loss_fn: Any
                     ) -> list[str]:
    """Allocator bytes above what is held at the start of each phase of a plain step (forward with the loss,
    backward, Adam's step with and without ``foreach``), one micro-batch, the whole model as one stage.

    These are the transients the held-bytes ledger (and the cost model's M_s) leave out; on a CPU it is skipped.
    """
    from hetpipe.runtime.stage.build import build_stage, split_stages

    if not args.device.startswith("cuda"):
        return []
    program = split_stages(graph.module, {}, example_inputs=example, num_stages=1, tied=graph.tied)
    stage = build_stage(program, 0, state_dict=None, device=args.device, seed=0, buffers=args.buffers)
    params = list(stage.parameters())
    param_bytes = sum(q.numel() * q.element_size() for q in params)
    x, y = _batch(args, graph, example, rows=args.batch, step=3)
    rows = []
    for foreach in (True, False):
        opt = torch.optim.Adam(params, lr=1e-4, foreach=foreach)
        for _ in range(2):  # the first step allocates Adam's state; the second is what a run repeats
            def forward() -> tuple[int, torch.Tensor]:
                out = stage(x)
                logits = out[0] if isinstance(out, tuple) else out
                return logits.numel() * logits.element_size(), loss_fn(logits, y)

            (logits_bytes, loss), _, f_peak = _phase_peak(forward)
            _, _, b_peak = _phase_peak(loss.backward)
            _, _, s_peak = _phase_peak(opt.step)
            opt.zero_grad(set_to_none=True)
            del loss
        rows.append(f"| {'foreach' if foreach else 'per-tensor'} | {f_peak / 2**20:.1f} | {b_peak / 2**20:.1f} | "
                    f"{s_peak / 2**20:.1f} | {s_peak / param_bytes:.2f} |")
        del opt
    return ["", f"Transients (one micro-batch, whole model, MiB above the bytes allocated at the phase's start; "
                f"parameters {param_bytes / 2**20:.1f} MiB, logits {logits_bytes / 2**20:.1f} MiB):", "",
            "| Adam | forward + loss | backward | step | step / parameter bytes |", "|---|---|---|---|---|", *rows]


def _profile(device: str, calibration: Any) -> Any:
    from hetpipe.cost_models.devices import DeviceProfile

    props = torch.cuda.get_device_properties(device) if device.startswith("cuda") else None
    memory = int(props.total_memory) if props is not None else 2**40
    kind = props.name.lower().replace(" ", "-") if props is not None else "cpu"
    return DeviceProfile(kind, memory, calibration.tensor_matmul_flops_s, calibration.fp32_matmul_flops_s,
                         calibration.memory_bandwidth_bytes_s, matmul_efficiency=1.0, bandwidth_efficiency=1.0,
                         source=f"calibrated on {device} by benchmarks/gpu_check.py")


def report(args: argparse.Namespace, cal: Any, stages: dict[str, float], mem: dict[str, float],
           times: list[dict[str, float]]) -> list[str]:
    """One model's section of the results: numerics, memory, whole-model and per-stage timings."""
    mib = 2**20
    alloc = mem["alloc_peak_bytes"]
    alloc_cell = f"{alloc / mib:.1f} MiB ({mem['held_peak_bytes'] / alloc:.3f})"
    counted = " (CPU: live storages counted)" if args.device == "cpu" else ""
    lines = [
        f"### {args.model}: {args.batch} x {args.seq or 'default'} tokens per micro-batch, {args.microbatches} "
        f"micro-batches, {args.stages} stages", "",
        "| check | figure |", "|---|---|",
        f"| stage modules ({args.stages} stages) vs whole model | {int(stages['params'])} parameters; max relative "
        f"gradient error {stages['grad_rel_err']:.2e}, loss {stages['loss_rel_err']:.2e} (rtol {RTOL}) |",
        f"| held peak (executor accounting) | {mem['held_peak_bytes'] / mib:.1f} MiB |",
        f"| allocator peak{counted} (held / allocator) | {alloc_cell} |",
        f"| cost model, stage memory less backward and step transients (held / predicted) | "
        f"{mem['predicted_ledger_bytes'] / mib:.1f} MiB ({mem['held_peak_bytes'] / mem['predicted_ledger_bytes']:.3f}) |",
        f"| allocator peak / predicted M_s (memory model 5) | {alloc / mib:.1f} / {mem['predicted_bytes'] / mib:.1f} "
        f"MiB ({alloc / mem['predicted_bytes']:.3f}) |",
        f"| F per micro-batch, one stage, measured / predicted | {mem['fwd_s'] * 1e3:.3f} / "
        f"{mem['predicted_fwd_s'] * 1e3:.3f} ms ({mem['fwd_s'] / mem['predicted_fwd_s']:.2f}) |",
        f"| B per micro-batch, one stage, measured / predicted | {mem['bwd_s'] * 1e3:.3f} / "
        f"{mem['predicted_bwd_s'] * 1e3:.3f} ms ({mem['bwd_s'] / mem['predicted_bwd_s']:.2f}) |", "",
        "| stage | units | F measured / predicted | F ratio | F ratio, matmuls by shape | B measured / predicted "
        "| B ratio | B ratio, matmuls by shape |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in times:
        lines.append(f"| {int(r['stage'])} | {int(r['units'])} | {r['fwd_s'] * 1e3:.3f} / "
                     f"{r['predicted_fwd_s'] * 1e3:.3f} ms | {r['fwd_s'] / r['predicted_fwd_s']:.2f} | "
                     f"{r['fwd_s'] / r['shaped_fwd_s']:.2f} | "
                     f"{r['bwd_s'] * 1e3:.3f} / {r['predicted_bwd_s'] * 1e3:.3f} ms | "
                     f"{r['bwd_s'] / r['predicted_bwd_s']:.2f} | {r['bwd_s'] / r['shaped_bwd_s']:.2f} |")
    return lines + [""]


def header(args: argparse.Namespace, cal: Any) -> list[str]:
    """The device, the command and the calibration every model's prediction is priced on."""
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    return [f"## GPU check ({args.device}, {name})", "",
            f"`python benchmarks/gpu_check.py --device {args.device} --models {args.models} --stages {args.stages} "
            f"--microbatches {args.microbatches}` -- torch {torch.__version__}; fp32, TF32 off; Adam; "
            f"F/B medians of {TIMED_REPEATS} passes (CUDA events on a GPU) after two warm-ups", "",
            f"Calibration (`calibrate_device`): matmul bf16 / fp32 {cal.tensor_matmul_flops_s / 1e12:.1f} / "
            f"{cal.fp32_matmul_flops_s / 1e12:.1f} TFLOP/s, copy bandwidth "
            f"{cal.memory_bandwidth_bytes_s / 1e9:.0f} GB/s; the cost model prices every model below on exactly "
            f"these figures (efficiency 1.0).", ""]


def _models(spec: str) -> list[tuple[str, int | None, int | None]]:
    """``"gpt2-small:4:1024,llama-1b:1"`` -> [(name, batch or None, seq or None), ...]."""
    out = []
    for item in spec.split(","):
        name, *rest = item.split(":")
        nums = [int(v) for v in rest] + [None, None]
        out.append((name, nums[0], nums[1]))
    return out


def check_model(args: argparse.Namespace, cal: Any) -> list[str]:
    """Every check on ``args.model``; a failure is reported in its section, not raised (one GPU call runs all)."""
    gc.collect()
    try:
        graph, example, loss_fn = _setup(args)
        stages, parts, unit_stage = check_stages(args, graph, example, loss_fn)
        profile = _profile(args.device, cal)
        times = check_stage_times(args, graph, example, loss_fn, profile, parts, unit_stage, shaped=args.shaped)
        del parts
        mem = check_memory_and_timing(args, graph, example, loss_fn, profile=profile)
        return (report(args, cal, stages, mem, times)[:-1] + check_transients(args, graph, example, loss_fn)
                + args.peak_lines + [""])
    except Exception as exc:  # noqa: BLE001 -- the remaining models still run; the error is the figure
        logging.exception("gpu_check: %s failed", args.model)
        return [f"### {args.model}", "", f"failed: `{type(exc).__name__}: {str(exc)[:300]}`", ""]
    finally:
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    from hetpipe.cost_models.calibrate import calibrate_device

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", default=DEFAULT_MODELS, help="name[:batch[:seq]],... (default: %(default)s)")
    p.add_argument("--model", default=None, help="one model (overrides --models)")
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
    if args.model:
        args.models = f"{args.model}:{args.batch}" + (f":{args.seq}" if args.seq else "")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 numerics check (TF32 would need rtol ~1e-3)
    torch.backends.cudnn.allow_tf32 = False
    small = args.device == "cpu"
    cal = calibrate_device(args.device, size=256 if small else 8192, repeats=3 if small else 10,
                           copy_bytes=2**22 if small else 2**30)
    from hetpipe.cost_models.op_calibration import GPU_MATMUL_WIDTHS, GPU_OP_ROWS, measure_matmul_rates

    widths, rows = ((32, 64), 256) if small else (GPU_MATMUL_WIDTHS, GPU_OP_ROWS)
    rates = tuple(measure_matmul_rates(args.device, repeats=3, widths=widths, rows=rows))
    args.shaped = dataclasses.replace(_profile(args.device, cal), op_rates=rates)
    lines = header(args, cal) + [
        "Matmuls by shape (`measure_matmul_rates`: chains of 4 linear layers, forward and backward, on "
        f"{rows} tokens): " + ", ".join(f"{k.split(':')[1]} {r / 1e12:.1f}" for k, r in rates)
        + " TFLOP/s (work key: the product of a matmul's two smaller sides); the 'by shape' ratios price "
        "each stage with them (`timing.pass_time_s`: the per-op path, memory-bound ops at the copy bandwidth).", ""]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    failed = False
    for name, batch, seq in _models(args.models):
        args.model, args.batch, args.seq = name, batch or args.batch, seq
        section = check_model(args, cal)
        failed |= any(line.startswith("failed:") for line in section)
        lines += section
        print("\n".join(section), flush=True)
        args.output.write_text("\n".join(lines) + "\n")  # after each model: a cut-off run keeps what it measured
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
