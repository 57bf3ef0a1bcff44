"""``hetpipe run`` (torchrun, one process per stage) and ``hetpipe demo``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from hetpipe.cli.checks import path_arg
from hetpipe.runtime.estimate import DEFAULT_MAX_MINUTES


def add_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``hetpipe run`` to the CLI's subparsers."""
    p = subparsers.add_parser("run", help="train with a plan: torchrun, one process per stage (or --emulate)")
    p.add_argument("plan", type=Path, help="plan.json from `hetpipe plan`")
    p.add_argument("--model", required=True, help="the model the plan was made for (built-in or package.module:factory)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps to run")
    p.add_argument("--emulate", action="store_true",
                   help="emulate the plan's devices on this machine (speed, memory limit, links)")
    p.add_argument("--report", type=path_arg, default=None, help="write the run report (run.json) here")
    p.add_argument("--schedule", default=None, help="1f1b | gpipe | zb-1f1b | zb-h1 (default: the plan's training.schedule)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds any rank waits for a peer (default 60; with --emulate 3 emulated iterations if longer)")
    p.add_argument("--max-minutes", type=float, default=DEFAULT_MAX_MINUTES,
                   help=f"--emulate: refuse a run estimated above this many minutes (default {DEFAULT_MAX_MINUTES:g})")
    p.add_argument("--seq", type=int, default=None, help="sequence length the plan was made with (LMs)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the synthetic data")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3 Adam/AdamW, 1e-2 SGD)")
    p.add_argument("--data", default=None, help="package.module:factory returning an iterable of (inputs, targets)")
    p.add_argument("--loss", default=None, help="package.module:function(output, targets) (default: the model's)")
    p.add_argument("--weights", default=None,
                   help="initial weights: a state-dict file, a .safetensors file or a save_pretrained folder "
                        "(each rank reads only its stage's tensors; default: seeded weights, see --seed)")
    p.add_argument("--save-weights", default=None, metavar="DIR",
                   help="after the run, write the trained weights to DIR as safetensors shards + index")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save parameters, optimizer state, step, data position and random state into DIR/step-NNNNNN "
                        "every --checkpoint-every steps and at the end (each rank its stage, by parameter name)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N", help="steps between checkpoints")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from the newest complete checkpoint in DIR (or the step-NNNNNN folder named), on "
                        "this plan or another; --steps is the total to reach")
    p.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="after a rank dies, re-plan on the surviving devices (a replica plan: relaunch the same "
                        "plan) and resume from the newest checkpoint, up to N times (needs --checkpoint-dir; default: "
                        "no restart)")
    p.add_argument("--wait-for-return", type=float, default=None, metavar="SECONDS",
                   help="after a rank dies, wait up to SECONDS for its device to be back (RUN_DIR/back-<device>, "
                        "or an injected kill's down=S) and resume on the same plan; else re-plan (needs --max-restarts)")
    p.add_argument("--adapt", action="store_true",
                   help="on a straggler report, re-plan with the measured slowdown and, if the predicted gain over "
                        "the remaining steps beats the restart, relaunch at the next checkpoint (needs --checkpoint-dir)")
    p.add_argument("--safety-factor", type=float, default=None,
                   help="emulation: margin of each action's target over its contended real time (default 2)")
    p.add_argument("--run-dir", type=path_arg, default=None, help="keep per-rank results and the torchrun log here")
    p.add_argument("--no-sync-overlap", dest="sync_overlap", action="store_false",
                   help="replica plans: run the gradient sync after backward instead of overlapped with it")
    p.add_argument("--inject", action="append", default=None, metavar="SPEC",
                   help="inject a fault (repeatable): slow:rank=R,factor=F,step=K | link:src=A,dst=B,factor=F|cut,"
                        "step=K (both need --emulate) | kill:rank=R,step=K[,down=S]")
    p.add_argument("--straggler-margin", type=float, default=None, metavar="FRACTION",
                   help="name a stage slower than the plan by more than this fraction (default 0.25)")
    p.add_argument("--straggler-steps", type=int, default=None, metavar="K",
                   help="... for up to K consecutive steps (default 3): named once the slow steps' summed excess "
                        "over the plan reaches K x the margin, so a 3x card after 1 step, one just over the margin after K")
    p.add_argument("--netns", action="store_true",
                   help="a two-node plan: each node in its own network namespace, the link between them shaped by "
                        "tc (needs root); elsewhere falls back to --emulate and says so")
    return p


def cmd_run(args: argparse.Namespace, console: Any) -> int:
    """``hetpipe run``: launch, print the report's tables, write ``--report``."""
    from hetpipe.runtime.run import run, summary_tables

    if args.netns:  # real shaped links where the machine allows it, else --emulate (hetpipe.cli.netns_run)
        from hetpipe.cli.netns_run import netns_or_emulate

        if netns_or_emulate(args, console):
            return 0
    from hetpipe.plan.schema import Plan
    from hetpipe.runtime.checkpoint.options import check_options, checkpoint_args

    # every option and file check before anything is printed ("resuming from", the estimate)
    plan = Plan.load(args.plan)
    resumed = check_options(plan, args.checkpoint_dir, args.checkpoint_every, args.resume, steps=args.steps,
                            seed=args.seed, weights=args.weights)
    timeout_s, done = args.timeout, 0
    if resumed is not None:  # its model, names and shapes too (a capture, ~1 s; run() repeats it for the API)
        checkpoint_args(plan, args.checkpoint_dir, args.checkpoint_every, args.resume, model=args.model,
                        seq=args.seq, steps=args.steps, seed=args.seed)
        folder, info = resumed
        console.print(f"resuming from {folder} (step {info.step}, saved by a {info.num_stages}-stage plan)")
        done = info.step
    if args.emulate:  # the estimate first: a run of hours is refused before anything starts
        from hetpipe.runtime.estimate import default_timeout_s, estimate_wall, refuse_if_too_long

        est = estimate_wall(plan, steps=args.steps - done, safety_factor=args.safety_factor)
        console.print(est.line())
        refuse_if_too_long(est, plan, max_minutes=args.max_minutes)
        timeout_s = timeout_s or default_timeout_s(est)
    report = run(args.plan, model=args.model, steps=args.steps, emulate=args.emulate, report=args.report,
                 schedule=args.schedule, timeout_s=timeout_s, seq=args.seq, seed=args.seed, lr=args.lr,
                 data=args.data, loss=args.loss, safety_factor=args.safety_factor, run_dir=args.run_dir,
                 sync_overlap=args.sync_overlap, weights=args.weights, save_weights=args.save_weights,
                 checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume,
                 inject=args.inject, straggler_margin=args.straggler_margin, straggler_steps=args.straggler_steps,
                 max_restarts=args.max_restarts, adapt=args.adapt, wait_for_return=args.wait_for_return)
    for table in summary_tables(report):
        console.print(table)
    for note in report.notes:
        console.print(f"note: {note}")
    for fault in report.injected:
        console.print(f"injected: {fault}")
    for straggler in report.stragglers:
        console.print(straggler.line(), markup=False, highlight=False)
    if args.save_weights:  # the trained weights: shards + model.safetensors.index.json
        console.print(f"wrote {args.save_weights}")
    if args.report:
        console.print(f"wrote {args.report}")
    return 0


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from hetpipe.cli.demo import run_demo

    return run_demo(out=args.out, steps=args.steps, run=not args.fast, console=console)
