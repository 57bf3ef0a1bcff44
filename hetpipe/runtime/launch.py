"""Launch a plan with torchrun: one process per stage, a watchdog, and the first error by name.

hetpipe does not bring its own launcher or transport: `torchrun_command` runs
``python -m torch.distributed.run`` (the ``torchrun`` entry point, from the same
Python) with ``--standalone --nproc-per-node=<stages>`` around
``-m hetpipe.runtime.worker``.  torchrun sets ``OMP_NUM_THREADS=1`` per rank and
tears the whole job down when one rank fails.  Several nodes use torchrun's c10d
rendezvous instead (`multinode_command`).

Failure behaviour: every rank bounds each wait by ``timeout_s`` and, when it fails,
writes ``error-rank<r>.json`` (rank, stage, action, message) into the run directory
before exiting.  `launch` adds a watchdog on top -- start-up must finish within
`startup_timeout_s`, and then some rank must report progress (a finished action,
`hetpipe.runtime.execute.heartbeat`, or step) at least every ``timeout_s + PROGRESS_GRACE_S`` -- and kills the job's process
group otherwise.  `first_error` then picks the earliest rank error (the root cause;
the others are its consequences), or the torchrun exit summary when no rank
managed to write one.

Example:
    >>> spec = LaunchSpec(plan_path=Path("plan.json"), model="gpt-demo", steps=2, nproc=3,
    ...                   run_dir=Path("/tmp/run"), emulate=True)
    >>> cmd = torchrun_command(spec, python="python")
    >>> cmd[:6]
    ['python', '-m', 'torch.distributed.run', '--standalone', '--nnodes=1', '--nproc-per-node=3']
    >>> cmd[cmd.index("-m", 3):][:3]
    ['-m', 'hetpipe.runtime.worker', 'plan.json']
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetpipe.errors import HetpipeError, RuntimeFailure
from hetpipe.plan.group_run import has_groups, rank_slots
from hetpipe.plan.schema import Plan

log = logging.getLogger(__name__)

# Seconds allowed for start-up beyond one rank's: every rank imports torch, captures
# the model on meta and builds its stage (measured: 7-8 s for 2 ranks, 13-15 s for 4
# on 2 cores, environment_facts.md "Processes"); 60 s + 15 s per rank is 4x that.
STARTUP_BASE_S = 60.0
STARTUP_PER_RANK_S = 15.0
# Beyond `timeout_s` between two progress reports: a rank's own wait times out first
# (after timeout_s) and reports by name; the watchdog is only the backstop.
PROGRESS_GRACE_S = 30.0
# After the first rank error, how long torchrun gets to tear the job down itself.
TEARDOWN_GRACE_S = 20.0
KILL_GRACE_S = 5.0  # SIGTERM -> SIGKILL
POLL_S = 0.1
# A file a supervisor creates in the run directory to end the job now (`hetpipe.runtime.supervise`:
# after a complete checkpoint, to relaunch on a better plan); the job then fails with `STOPPED`.
STOP_REQUEST = "stop-request"
STOPPED = "stopped on request"
WORKER_MODULE = "hetpipe.runtime.worker"


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a worker needs, as command-line arguments (see `worker_args`)."""

    plan_path: Path
    model: str
    steps: int
    nproc: int
    run_dir: Path
    emulate: bool = False
    schedule: str | None = None
    timeout_s: float = 60.0
    seed: int = 0
    seq: int | None = None
    lr: float | None = None
    data: str | None = None  # "package.module:factory" or a path to a saved data file
    loss: str | None = None  # "package.module:function"
    safety_factor: float | None = None
    sync_overlap: bool = True  # replica plans: overlap the gradient sync with backward
    weights: str | None = None  # a checkpoint file or folder (`hetpipe.runtime.stage.weights`)
    save_weights: str | None = None  # a folder: each rank writes its stage's shard, stage 0 the index
    checkpoint_dir: str | None = None  # a folder of step-NNNNNN checkpoints (`hetpipe.runtime.checkpoint`)
    checkpoint_every: int | None = None  # steps between checkpoints (and one at the end)
    resume: str | None = None  # the complete checkpoint folder to continue from
    inject: tuple[str, ...] = ()  # --inject fault specs (`hetpipe.runtime.faults.inject`)
    straggler_margin: float | None = None  # `hetpipe.runtime.faults.straggler`
    straggler_steps: int | None = None
    switch_at: str | None = None  # "STEPS=PLAN.json": switch plans in place then (`hetpipe.runtime.switch`)
    switch_listen: bool = False  # take a supervisor's in-place switch requests (``--adapt``)


def worker_args(spec: LaunchSpec) -> list[str]:
    """The worker's argv (after ``-m hetpipe.runtime.worker``)."""
    args = [str(spec.plan_path), "--model", spec.model, "--steps", str(spec.steps), "--run-dir",
            str(spec.run_dir), "--timeout", repr(float(spec.timeout_s)), "--seed", str(spec.seed)]
    optional = {"--schedule": spec.schedule, "--seq": spec.seq, "--lr": spec.lr, "--data": spec.data,
                "--loss": spec.loss, "--safety-factor": spec.safety_factor, "--weights": spec.weights,
                "--save-weights": spec.save_weights, "--checkpoint-dir": spec.checkpoint_dir,
                "--checkpoint-every": spec.checkpoint_every, "--resume": spec.resume,
                "--straggler-margin": spec.straggler_margin, "--straggler-steps": spec.straggler_steps,
                "--switch-at": spec.switch_at}
    for flag, value in optional.items():
        if value is not None:
            args += [flag, str(value)]
    for fault in spec.inject:
        args += ["--inject", fault]
    if spec.emulate:
        args.append("--emulate")
    if not spec.sync_overlap:
        args.append("--no-sync-overlap")
    if spec.switch_listen:
        args.append("--switch-listen")
    return args


def torchrun_command(spec: LaunchSpec, *, python: str = sys.executable) -> list[str]:
    """``torchrun --standalone`` on this host, one process per stage."""
    return [python, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={spec.nproc}",
            "--max-restarts=0", "--monitor-interval=0.1", "-m", WORKER_MODULE, *worker_args(spec)]


def multinode_command(spec: LaunchSpec, *, node: str, nnodes: int, nproc_per_node: int, endpoint: str,
                      job_id: str = "hetpipe") -> str:
    """The torchrun line to run on the plan node ``node`` of a multi-node job (c10d rendezvous).

    Every node runs the same line with its own ``--plan-node`` and ``--nproc-per-node`` (its
    number of stages); the worker maps local ranks to that node's stages in pipeline
    order, so the rendezvous may number the nodes in any order.

    Example:
        >>> spec = LaunchSpec(Path("plan.json"), "gpt2-small", 100, 3, Path("run"))
        >>> print(multinode_command(spec, node="desk", nnodes=2, nproc_per_node=2, endpoint="desk:29500"))
        ... # doctest: +NORMALIZE_WHITESPACE
        torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=desk:29500
          --rdzv-id=hetpipe --max-restarts=0 -m hetpipe.runtime.worker plan.json --model gpt2-small
          --steps 100 --run-dir run --timeout 60.0 --seed 0 --plan-node desk
    """
    cmd = ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job_id}", "--max-restarts=0", "-m", WORKER_MODULE,
           *worker_args(spec), "--plan-node", node]
    return shlex.join(cmd)


# ----------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class RankError:
    """What a failing rank wrote before exiting."""

    rank: int
    stage: int
    action: str
    message: str
    kind: str
    time_s: float  # time.time() when written

    def line(self) -> str:
        """One line naming rank, stage and action (added when the message lacks them)."""
        first = self.message.strip().splitlines()[0] if self.message.strip() else self.kind
        if f"rank {self.rank}" in first:
            return first
        where = f"rank {self.rank} (stage {self.stage}" + (f", at {self.action}" if self.action else "") + ")"
        return f"{where}: {first}"


def error_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"error-rank{rank}.json"


def write_error(run_dir: Path, error: RankError) -> None:
    """Atomically write a rank's error (the worker calls this before exiting)."""
    path = error_path(run_dir, error.rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(error.__dict__))
    os.replace(tmp, path)


def read_errors(run_dir: Path) -> list[RankError]:
    """Every rank error in ``run_dir``, earliest first."""
    out = []
    for path in sorted(run_dir.glob("error-rank*.json")):
        try:
            out.append(RankError(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError) as err:  # a rank killed mid-write; the others still count
            log.warning("ignoring unreadable %s: %s", path, err)
    return sorted(out, key=lambda e: (e.time_s, e.rank))


# One entry of torchrun's failure summary: its own "rank : R (local_rank: L)" line, then its
# "exitcode : C" line (only the entry's time/host lines may come between, never another rank).  A
# pattern that spans lines freely pairs the agent's earlier "failed (exitcode: 1) local_rank: 0" log
# line with the next entry's exit code and loses a rank.
_EXIT_RE = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank[^\n]*\n(?:\s*(?:time|host)\s*:[^\n]*\n)*"
                      r"\s*exitcode\s*:\s*(-?\d+)", re.M)
_SIGTERM = -15  # how torchrun tears down the survivors once one rank failed


def exit_codes(log_text: str) -> dict[int, int]:
    """Rank -> exit code from torchrun's failure summary (negative: killed by that signal).

    Example:
        >>> exit_codes("rank      : 2 (local_rank: 2)\\n  exitcode  : -9 (pid: 7)")
        {2: -9}
    """
    return {int(rank): int(code) for rank, code in _EXIT_RE.findall(log_text)}


def describe_exit(code: int) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it).

    >>> describe_exit(-9), describe_exit(3)
    ('was killed by signal 9 (SIGKILL)', 'exited with code 3')
    """
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"was killed by signal {-code}"


def rank_places(plan: Any) -> dict[int, str]:
    """Rank -> ``"stage S, device D"`` for a plan with tensor-parallel groups (its members are ranks of their
    own, `plan.group_run.rank_slots`); empty otherwise: rank r runs stage r.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> rank_places(NS(stages=(NS(index=0, device="a", group_devices=()),
        ...                        NS(index=1, device="b", group_devices=("b", "c")))))
        {0: 'stage 0, device a', 1: 'stage 1, device b', 2: 'stage 1, device c'}
    """
    if not has_groups(plan):
        return {}
    return {r: f"stage {s.stage}, device {s.device}" for r, s in enumerate(rank_slots(plan))}


def _place(rank: int, places: dict[int, str] | None) -> str:
    return (places or {}).get(rank, f"stage {rank}")


def summary_from_log(log_text: str, places: dict[int, str] | None = None) -> str:
    """torchrun's failure summary as one line (used when no rank wrote an error file; ``places``: `rank_places`)."""
    codes = exit_codes(log_text)
    if codes:
        rank, code = min(codes.items(), key=lambda rc: (rc[1] == _SIGTERM, rc[1] >= 0, rc[0]))
        return f"rank {rank} ({_place(rank, places)}) {describe_exit(code)} without reporting an error; see the log for its output"
    tail = [ln for ln in log_text.strip().splitlines() if ln.strip()][-1:] or ["no output"]
    return f"torchrun failed: {tail[0].strip()}"


def first_error(run_dir: Path, log_text: str, places: dict[int, str] | None = None) -> str:
    """The line `hetpipe run` reports: the root cause first, then what the first survivor saw.

    A rank that was killed by a signal (other than torchrun's own SIGTERM teardown), or exited
    with a status other than 0 and the workers' own 1 (an injected kill's 137), without writing
    an error file is the root cause: it could not say so itself, and the survivors' errors
    ("failed waiting on ... from rank k") are its consequences.  Otherwise the earliest rank
    error is, or torchrun's summary when nobody wrote one.
    torchrun's own "Root Cause" entry is not used: it is the first failure torchrun
    *observed*, not the first that happened.
    """
    errors = read_errors(run_dir)
    reported = {e.rank for e in errors}
    # A rank that died without its error file: killed by a signal, or exited hard (an injected kill's 137).
    killed = sorted(r for r, c in exit_codes(log_text).items() if c not in (0, 1, _SIGTERM) and r not in reported)
    if killed:
        code = exit_codes(log_text)[killed[0]]
        head = f"rank {killed[0]} ({_place(killed[0], places)}) {describe_exit(code)} without reporting an error"
        return f"{head}; then {errors[0].line()}" if errors else f"{head}; see the log for its output"
    return errors[0].line() if errors else summary_from_log(log_text, places)


def _places_of(plan_path: Path) -> dict[int, str]:
    """`rank_places` of the plan file a launch ran (empty where it cannot be read: the message keeps ranks)."""
    try:
        return rank_places(Plan.load(plan_path))
    except (OSError, ValueError, HetpipeError):  # naming the failure must not fail; the plan was checked at launch
        return {}


# ----------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class LaunchOutcome:
    returncode: int
    wall_s: float
    log_path: Path
    killed_by_watchdog: str  # why the watchdog killed the job; "" if it did not


def startup_timeout_s(nproc: int) -> float:
    return STARTUP_BASE_S + STARTUP_PER_RANK_S * nproc


def _progress_times(run_dir: Path) -> list[float]:
    return [p.stat().st_mtime for p in run_dir.glob("progress-rank*")]


def watchdog_reason(spec: LaunchSpec, started: float, error_seen: float | None) -> str:
    """Why the job must be killed now, or ""."""
    now = time.time()
    if error_seen is not None and now - error_seen > TEARDOWN_GRACE_S:
        return f"torchrun did not tear the job down within {TEARDOWN_GRACE_S:.0f} s of the first rank error"
    progress = _progress_times(spec.run_dir)
    if len(progress) < spec.nproc:
        limit = startup_timeout_s(spec.nproc)
        if now - started > limit:
            return (f"only {len(progress)} of {spec.nproc} ranks started within {limit:.0f} s "
                    f"(see {spec.run_dir / 'torchrun.log'})")
        return ""
    idle = now - max(progress)
    if idle > spec.timeout_s + PROGRESS_GRACE_S:
        return f"no rank reported progress for {idle:.0f} s (timeout {spec.timeout_s:.0f} s + {PROGRESS_GRACE_S:.0f} s)"
    return ""


def _kill(proc: subprocess.Popen[Any]) -> None:
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def launch(spec: LaunchSpec, *, env: dict[str, str] | None = None) -> LaunchOutcome:
    """Run torchrun for `spec` under the watchdog; raise `RuntimeFailure` with the first error if it fails."""
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    log_path = spec.run_dir / "torchrun.log"
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    started, error_seen, reason = time.time(), None, ""
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(torchrun_command(spec), stdout=log_file, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)  # own process group: the watchdog kills it whole
        try:
            while proc.poll() is None:
                time.sleep(POLL_S)
                if error_seen is None and any(spec.run_dir.glob("error-rank*.json")):
                    error_seen = time.time()
                reason = watchdog_reason(spec, started, error_seen)
                if (spec.run_dir / STOP_REQUEST).exists():
                    reason = f"{STOPPED} ({spec.run_dir / STOP_REQUEST})"
                if reason:
                    log.warning("killing the job: %s", reason)
                    _kill(proc)
                    break
        except BaseException:  # KeyboardInterrupt included: never leave ranks behind
            _kill(proc)
            raise
    outcome = LaunchOutcome(proc.wait(), time.time() - started, log_path, reason)
    if outcome.returncode != 0 or reason:
        message = first_error(spec.run_dir, log_path.read_text(errors="replace"), _places_of(spec.plan_path))
        if reason and not read_errors(spec.run_dir):
            message = f"{reason}; {message}"
        raise RuntimeFailure(message)
    return outcome
