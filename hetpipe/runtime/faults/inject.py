"""``--inject SPEC``: faults injected into an emulated run (issue 16, item 5).

Three forms, each from a global step ``K`` (0-based, counted like the run's steps; a
resumed run continues the count):

* ``slow:rank=R,factor=F,step=K`` -- rank R computes F times slower: its emulated F and B
  targets are stretched by F (`hetpipe.runtime.emulate.pipeline.ComputeStretch.factor`);
* ``link:src=A,dst=B,factor=F,step=K`` -- the emulated link from rank A to rank B (pipeline
  neighbours) carries every message F times slower (`LinkClock.factor`); ``factor=inf`` or
  ``factor=cut`` cuts it: a send over it blocks for the timeout, then the run fails naming the link;
  with ``down=S`` the cut link is back S seconds after step K (``RUN_DIR/down-<link>.json``);
* ``kill:rank=R,step=K[,down=S]`` -- rank R's process exits at once with status `KILL_EXIT_CODE` at the
  start of step K (``os._exit``: no cleanup, no error file, like a node that lost power); with
  ``down=S`` its device is back S seconds later (``RUN_DIR/down-rank<R>.json``, read by
  `hetpipe.runtime.faults.returns` for ``--wait-for-return``).

Slowing compute or links is emulation only (real devices are not slowed by hetpipe); a kill
works in any run.  `parse_faults` turns specs into frozen records, `check_faults` checks them
against the plan before anything is launched, `FaultSchedule` answers what holds at a step.

Example:
    >>> parse_fault("slow:rank=1,factor=3,step=2")
    SlowCompute(rank=1, factor=3.0, step=2)
    >>> parse_fault("link:src=0,dst=1,factor=cut,step=4").spec()
    'link:src=0,dst=1,factor=inf,step=4'
    >>> parse_fault("kill:rank=2,step=5")
    KillRank(rank=2, step=5, down_s=0.0)
    >>> parse_fault("kill:rank=2,step=5,down=3").spec()
    'kill:rank=2,step=5,down=3'
    >>> parse_fault("slow:rank=1,factor=0.5,step=2")
    Traceback (most recent call last):
    ...
    hetpipe.errors.ConfigError: --inject 'slow:rank=1,factor=0.5,step=2': factor 0.5 must be a number >= 1 (how many times slower); write e.g. factor=3
    >>> FaultSchedule(parse_faults(["slow:rank=1,factor=3,step=2"])).compute_factor(rank=1, step=2)
    3.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence, Union

from hetpipe.errors import ConfigError

#: Exit status of a killed rank: 128 + SIGKILL (9), what a shell reports for a process killed by
#: the kernel's OOM killer or ``kill -9`` -- the status a supervisor sees for a lost node.
KILL_EXIT_CODE = 137
KINDS = ("slow", "link", "kill")
_FIELDS = {"slow": ("rank", "factor", "step"), "link": ("src", "dst", "factor", "step"), "kill": ("rank", "step")}
_OPTIONAL = {"kill": ("down",), "link": ("down",)}  # seconds until a killed device / cut link is back (0: not said)
_EXAMPLES = {"slow": "slow:rank=1,factor=3,step=2", "link": "link:src=0,dst=1,factor=4,step=2",
             "kill": "kill:rank=2,step=5"}


@dataclass(frozen=True)
class SlowCompute:
    """Rank ``rank`` computes ``factor`` times slower from step ``step``."""

    rank: int
    factor: float
    step: int

    def spec(self) -> str:
        return f"slow:rank={self.rank},factor={self.factor:g},step={self.step}"


@dataclass(frozen=True)
class SlowLink:
    """The emulated link ``src`` -> ``dst`` (ranks) is ``factor`` times slower from ``step``; inf: cut."""

    src: int
    dst: int
    factor: float
    step: int
    down_s: float = 0.0  # a cut: seconds until it is back (0: not said)

    @property
    def cut(self) -> bool:
        return math.isinf(self.factor)

    def spec(self) -> str:
        down = f",down={self.down_s:g}" if self.down_s else ""
        return f"link:src={self.src},dst={self.dst},factor={self.factor:g},step={self.step}{down}"


@dataclass(frozen=True)
class KillRank:
    """Rank ``rank`` exits hard (status `KILL_EXIT_CODE`) at the start of step ``step``; its device
    is back ``down_s`` seconds later (0: the fault does not say)."""

    rank: int
    step: int
    down_s: float = 0.0

    def spec(self) -> str:
        down = f",down={self.down_s:g}" if self.down_s else ""
        return f"kill:rank={self.rank},step={self.step}{down}"


Fault = Union[SlowCompute, SlowLink, KillRank]


def _error(text: str, message: str) -> ConfigError:
    return ConfigError(f"--inject {text!r}: {message}")


def _int(text: str, name: str, value: str) -> int:
    try:
        out = int(value)
    except ValueError:
        out = -1
    if out < 0:
        raise _error(text, f"{name} {value!r} must be a whole number >= 0; write e.g. {name}=1")
    return out


def _factor(text: str, value: str, *, cut_allowed: bool) -> float:
    if cut_allowed and value.lower() in ("cut", "inf"):
        return math.inf
    try:
        out = float(value)
    except ValueError:
        out = math.nan
    if not (out >= 1.0 and (math.isfinite(out) or cut_allowed)):
        hint = " (or factor=cut)" if cut_allowed else ""
        raise _error(text, f"factor {value} must be a number >= 1 (how many times slower){hint}; write e.g. "
                           "factor=3")
    return out


def _seconds(text: str, value: str) -> float:
    try:
        out = float(value)
    except ValueError:
        out = math.nan
    if not (math.isfinite(out) and out >= 0):
        raise _error(text, f"down {value!r} must be a number of seconds >= 0 (how long the device stays away); "
                           "write e.g. down=10")
    return out


def _fields(text: str, kind: str, body: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, body.split(",")):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in (*_FIELDS[kind], *_OPTIONAL.get(kind, ())):
            raise _error(text, f"{part!r} is not a field of a {kind} fault; give {', '.join(_FIELDS[kind])} as "
                               f"name=value, e.g. {_EXAMPLES[kind]}")
        out[key] = value.strip()
    missing = [f for f in _FIELDS[kind] if f not in out]
    if missing:
        raise _error(text, f"lacks {', '.join(missing)}; write e.g. {_EXAMPLES[kind]}")
    return out


def parse_fault(text: str) -> Fault:
    """One ``--inject`` spec -> its record (see the module docstring); one-line `ConfigError` otherwise."""
    kind, colon, body = str(text).partition(":")
    kind = kind.strip().lower()
    if not colon or kind not in KINDS:
        raise _error(text, f"unknown fault {kind!r}; use one of {', '.join(KINDS)}, e.g. "
                           f"{' or '.join(_EXAMPLES.values())}")
    f = _fields(text, kind, body)
    step = _int(text, "step", f["step"])
    if kind == "slow":
        return SlowCompute(_int(text, "rank", f["rank"]), _factor(text, f["factor"], cut_allowed=False), step)
    if kind == "link":
        src, dst = _int(text, "src", f["src"]), _int(text, "dst", f["dst"])
        down = _seconds(text, f.get("down", "0"))
        return SlowLink(src, dst, _factor(text, f["factor"], cut_allowed=True), step, down)
    return KillRank(_int(text, "rank", f["rank"]), step, _seconds(text, f.get("down", "0")))


def parse_faults(specs: Sequence[str | Fault] | None) -> tuple[Fault, ...]:
    """Every spec parsed (records pass through unchanged)."""
    if specs is None:
        return ()
    if isinstance(specs, str):
        specs = [specs]
    return tuple(s if isinstance(s, (SlowCompute, SlowLink, KillRank)) else parse_fault(s) for s in specs)


def check_faults(faults: Sequence[Fault], *, num_ranks: int, emulate: bool, replicas: bool,
                 steps: int | None = None) -> None:
    """Refuse, before launching, faults this run cannot apply (one line each: spec, value, fix).

    Example:
        >>> check_faults(parse_faults(["slow:rank=1,factor=3,step=2"]), num_ranks=3, emulate=False, replicas=False)
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: --inject 'slow:rank=1,factor=3,step=2': slowing compute or links needs --emulate (real devices are not slowed by hetpipe); add --emulate or inject only kill faults
    """
    for f in faults:
        ranks = (f.src, f.dst) if isinstance(f, SlowLink) else (f.rank,)
        for r in ranks:
            if r >= num_ranks:
                raise _error(f.spec(), f"rank {r} does not exist: the run has ranks 0-{num_ranks - 1} (one process "
                                       "per card, every tensor-parallel group member included)")
        if isinstance(f, KillRank):
            continue
        if not emulate:
            raise _error(f.spec(), "slowing compute or links needs --emulate (real devices are not slowed by "
                                   "hetpipe); add --emulate or inject only kill faults")
        if replicas:
            raise _error(f.spec(), "slow and link faults are supported for single-pipeline plans only; inject "
                                   "kill faults into a replica plan, or run a single-pipeline plan")
        if isinstance(f, SlowLink) and abs(f.src - f.dst) != 1:
            raise _error(f.spec(), f"no pipeline message goes from rank {f.src} to rank {f.dst}: only neighbouring "
                                   "stages talk; give src and dst one apart, e.g. src=0,dst=1")
    if steps is not None:
        late = [f.spec() for f in faults if f.step >= steps]
        if late:
            raise _error(late[0], f"step {late[0].rsplit('=', 1)[1]} is not before --steps {steps}: the fault "
                                  "would never happen; inject it at an earlier step")


@dataclass(frozen=True)
class FaultSchedule:
    """What the injected faults do at a step (pure; every rank holds the whole schedule)."""

    faults: tuple[Fault, ...] = ()

    def compute_factor(self, *, rank: int, step: int) -> float:
        """Product of the compute slowdowns on ``rank`` in force at ``step`` (1.0: none)."""
        out = 1.0
        for f in self.faults:
            if isinstance(f, SlowCompute) and f.rank == rank and step >= f.step:
                out *= f.factor
        return out

    def link_factor(self, *, src: int, dst: int, step: int) -> float:
        """Product of the slowdowns of the link ``src`` -> ``dst`` at ``step`` (inf: cut)."""
        out = 1.0
        for f in self.faults:
            if isinstance(f, SlowLink) and (f.src, f.dst) == (src, dst) and step >= f.step:
                out *= f.factor
        return out

    def kills(self, *, rank: int, step: int) -> bool:
        """Whether ``rank`` dies at the start of ``step``."""
        return self.kill_at(rank=rank, step=step) is not None

    def kill_at(self, *, rank: int, step: int) -> KillRank | None:
        """The kill of ``rank`` at the start of ``step``, if any."""
        return next((f for f in self.faults if isinstance(f, KillRank) and f.rank == rank and f.step == step), None)

    def cuts_starting(self, *, src: int, step: int) -> tuple[SlowLink, ...]:
        """The cuts of ``src``'s links that begin at ``step``."""
        return tuple(f for f in self.faults if isinstance(f, SlowLink) and f.cut and f.src == src and f.step == step)

    def cut_at(self, step: int) -> SlowLink | None:
        """The first link cut in force at ``step``, if any (to name it in a timeout's message)."""
        return next((f for f in self.faults if isinstance(f, SlowLink) and f.cut and step >= f.step), None)

    def specs(self) -> tuple[str, ...]:
        return tuple(f.spec() for f in self.faults)

    @classmethod
    def from_specs(cls, specs: Sequence[str] | None) -> "FaultSchedule":
        return cls(parse_faults(list(specs or ())))


def run_ranks(plan: Any) -> int:
    """How many processes a run of ``plan`` launches: one per card of every stage, each tensor-parallel
    group member included (`hetpipe.plan.group_run.rank_slots`); ``--inject``'s ``rank=`` counts these.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> run_ranks(NS(stages=(NS(device="a", group_devices=()), NS(device="b", group_devices=("b", "c")))))
        3
    """
    return len(rank_devices(plan))


def rank_devices(plan: Any) -> tuple[str, ...]:
    """The card each launched rank of ``plan`` runs on, in rank order (stages in order, each group's lead first).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> rank_devices(NS(stages=(NS(device="a"), NS(device="b", group_devices=("b", "c")))))
        ('a', 'b', 'c')
    """
    return tuple(d for st in plan.stages for d in (tuple(getattr(st, "group_devices", ()) or ()) or (st.device,)))


def describe(faults: Any) -> str:
    """``"slow:rank=1,factor=3,step=2; kill:rank=2,step=5"`` for logs."""
    return "; ".join(f.spec() for f in faults)
