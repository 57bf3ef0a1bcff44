"""CLI flags checked before any work: numbers in range, outputs writable, usage errors on one line.

`check_args` runs in `hetpipe.cli.app.main` right after parsing, so ``--time-limit -5``,
``--microbatches 0`` or ``-o /missing/dir/plan.json`` are refused before a capture or a
solve that would be thrown away.  `OneLineParser` turns argparse's usage errors into the
same one-line ``error:`` convention (exit 2) as every other `HetpipeError`.

Example:
    >>> import argparse
    >>> check_args(argparse.Namespace(command="simulate", microbatches=4, gantt=None, trace=None))
    >>> try:
    ...     check_args(argparse.Namespace(command="simulate", microbatches=0))
    ... except ConfigError as err:
    ...     print(err)
    --microbatches: must be a whole number >= 1, got 0; give at least 1 micro-batch per iteration
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

from hetpipe.cost_models.outputs import check_folder, check_writable
from hetpipe.cost_models.validate import MAX_TIME_LIMIT_S, finite_number, whole_number
from hetpipe.errors import ConfigError

#: Whole-number flags: attribute -> (flag, least value, what to do).
_WHOLE = {
    "batch": ("--batch", 1, "give the micro-batch size, e.g. --batch 4"),
    "seq": ("--seq", 1, "give the sequence length, e.g. --seq 1024"),
    "global_batch": ("--global-batch", 1, "give the samples per iteration, a multiple of --batch"),
    "microbatches": ("--microbatches", 1, "give at least 1 micro-batch per iteration"),
    "steps": ("--steps", 1, "run at least 1 step"),
    "seed": ("--seed", 0, "use e.g. --seed 0"),
}
#: Positive real flags: attribute -> (flag, largest value, what to do).
_POSITIVE = {
    "time_limit": ("--time-limit", MAX_TIME_LIMIT_S, "give the solver's budget in seconds, e.g. --time-limit 10"),
    "timeout": ("--timeout", MAX_TIME_LIMIT_S, "give the seconds a rank waits for a peer, e.g. --timeout 60"),
    "lr": ("--lr", 1e3, "give a learning rate such as --lr 1e-3"),
    "safety_factor": ("--safety-factor", 1e3, "give a margin such as --safety-factor 2"),
    "max_minutes": ("--max-minutes", 7 * 24 * 60.0, "give the longest run you accept, e.g. --max-minutes 10"),
}
#: Output files: attribute -> flag.
_OUTPUTS = {"output": "-o/--output", "gantt": "--gantt", "trace": "--trace", "report": "--report"}


class OneLineParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose usage errors are one `ConfigError` line (no usage dump, exit 2)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message}; see `{self.prog} --help`")


def _check_out_dir(path: Path) -> None:
    """``demo --out DIR``: an existing writable folder, or one that can be made in an existing writable folder."""
    try:
        is_file = path.exists() and not path.is_dir()
    except OSError:
        is_file = False  # a folder on the way that may not be searched: check_folder says so
    if is_file:
        raise ConfigError(f"--out {str(path)!r} is a file; give a folder for plan.json, run.json and gantt.png")
    check_folder(path, "--out")


def path_arg(text: str) -> Path:
    """An output option's value as a `Path`: argparse's ``type=`` (``Path("")`` would silently be ``.``).

    Example:
        >>> path_arg("plan.json")
        PosixPath('plan.json')
    """
    if not text:
        raise argparse.ArgumentTypeError("the path is empty; give a path")
    return Path(text)


def _seconds_or_auto(text: str) -> float:
    """``--time-limit``'s text as seconds (range checked after); a word other than ``auto`` is refused."""
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"--time-limit: must be seconds or auto, got {text!r}; give the solver's budget in seconds, "
                          "e.g. --time-limit 10, or auto (the default)") from None


def check_args(args: argparse.Namespace) -> None:
    """Raise `ConfigError` for the first flag out of range or output that cannot be written."""
    for name, (flag, least, fix) in _WHOLE.items():
        if getattr(args, name, None) is not None:
            whole_number(getattr(args, name), flag, minimum=least, fix=fix)
    if isinstance(getattr(args, "time_limit", None), str) and args.time_limit != "auto":
        args.time_limit = _seconds_or_auto(args.time_limit)
    for name, (flag, most, fix) in _POSITIVE.items():
        if getattr(args, name, None) not in (None, "auto"):
            finite_number(getattr(args, name), flag, strict=True, maximum=most, fix=fix)
    if getattr(args, "solver", None) is not None:
        from hetpipe.partitioner.solvers.solve import SOLVERS

        if args.solver not in SOLVERS:
            raise ConfigError(f"--solver: unknown solver {args.solver!r}; use one of {', '.join(SOLVERS)}")
    if getattr(args, "recompute", None) is not None:
        from hetpipe.cost_models.recompute import check_recompute_option

        check_recompute_option(args.recompute)
    if getattr(args, "offload", None) is not None:
        from hetpipe.cost_models.offload import check_offload_option

        check_offload_option(args.offload)
    if getattr(args, "plan_schedule", None) is not None:
        from hetpipe.partitioner.schedule_choice import check_schedule_option

        check_schedule_option(args.plan_schedule)
    if getattr(args, "tensor_parallel", None) is not None:
        from hetpipe.plan.tp_plan import check_tensor_parallel_option

        check_tensor_parallel_option(args.tensor_parallel)
    for name, flag in _OUTPUTS.items():
        if name == "output" and getattr(args, "command", None) == "profile":
            continue  # `profile -o` creates its folder (cost_models/profile.py)
        if getattr(args, name, None) is not None:
            check_writable(getattr(args, name), flag)
    if getattr(args, "command", None) == "demo" and getattr(args, "out", None) is not None:
        _check_out_dir(args.out)
