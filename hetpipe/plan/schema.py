"""The plan: a versioned, self-describing JSON document (``format: "hetpipe.plan"``).

A plan records the tables the solver optimised (per-unit costs and times per
device kind, devices, links, micro-batches), the chosen stages, the predicted
iteration, the solver's status and bound, and the baselines.  Anyone can
re-check it from the file alone: `check_plan` rebuilds the `Problem` from the
recorded tables and recomputes T and every M_s with `problem.evaluate`
(`check_plan` lives in `plan.check`: it never needs the planner).

Example (a plan saved, loaded back unchanged, and rebuilt into the solver's problem):
    >>> import tempfile
    >>> from pathlib import Path
    >>> from hetpipe.models import build
    >>> from hetpipe.plan.build import partition
    >>> model, inputs = build("mlp-tiny", device="meta", batch=2)
    >>> plan = partition(model, "examples/clusters/homelab.yaml", example_inputs=inputs, global_batch=8)
    >>> path = Path(tempfile.mkdtemp()) / "plan.json"
    >>> plan.save(path)
    >>> Plan.load(path) == plan
    True
    >>> plan.version, len(problem_from_plan(plan).devices), stages_from_plan(plan)[0].device
    (9, 3, 1)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from hetpipe.cost_models.outputs import atomic_write_text
from hetpipe.cost_models.recompute import RECOMPUTE_MODES
from hetpipe.cost_models.sync import BUCKET_CAP_BYTES
from hetpipe.cost_models.validate import MAX_PLAN_FILE_BYTES
from hetpipe.errors import PlanError
from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, TiedCopy
from hetpipe.cost_models.offload import offload_rates
from hetpipe.plan.offload_note import offload_mode
from hetpipe.plan.tp_plan import PlanBlock, with_plan_splits  # issue 15: groups and their unit tables
# re-exported: `check_plan` and the tests import them from here
from hetpipe.plan.check_report import CheckReport, close_to_recorded, structure_violations  # noqa: F401
from hetpipe.plan.serde import from_json, least_version, to_json
from hetpipe.plan.shard_schema import PlanShard
from hetpipe.plan.chunk_schema import PlanChunk, virtual_stages
from hetpipe.plan.validate import validate_plan
from hetpipe.plan.model_match import verify_model  # noqa: F401  (re-exported: run and check import it here)
from hetpipe.plan.selective_schema import PlanSelective, tables_from_plan_selective
from hetpipe.plan.step_schema import KindSeconds, KindStepTransient, problem_step_fields  # re-exported

PLAN_FORMAT = "hetpipe.plan"
#: Newest plan version this hetpipe reads and writes; a plan is written with the lowest version its
#: content needs (fields declare ``metadata={"since": N}``, `least_version`).  2: replicas, sync (#6);
#: 3: recompute_units, loss, baseline best, memory model 2; 4: T = the simulated schedule with optimizer steps,
#: offload, tensor-parallel groups; 5: split schedules (bwd_weight_s), sharded sync groups; 6: chunks (interleaved);
#: 7: the selective recompute level (`Plan.selective`, `PlanStage.selective`; `plan.selective_schema`); 8: transients;
#: 9: the optimizer step's transient (`Plan.step_transient` and the step tables, `plan.step_schema`).
PLAN_VERSION = 9
#: The version of a plan without replicas.
PLAN_VERSION_SINGLE = 1
#: The first version that may carry replicas.
PLAN_VERSION_REPLICAS = 2
#: The first version that may carry memory levers (a stage's recompute_units, issue 14).
PLAN_VERSION_LEVERS = 3
#: The first version with `Plan.memory_model` and memory model 2's unit tables (`grad_bytes`, ...): an
#: older hetpipe refuses it by its version instead of re-checking its memory with another formula.
PLAN_VERSION_MEMORY = 3
#: The first version whose T is the simulated schedule (`Plan.objective` = "schedule").
PLAN_VERSION_OBJECTIVE = 4
#: `Plan.objective` of plans made before version 4: T was the H-1F1B estimate.
ESTIMATE_OBJECTIVE = "estimate"
#: The first version that may carry a stage run by a tensor-parallel group (issue 15).
PLAN_VERSION_GROUPS = 4
#: `Plan.cost_model` key recording the recomputation setting the plan was solved with
#: (``"auto: ..."``; absent = ``none``); `check_plan` re-derives each stage's choice under it.
RECOMPUTE_NOTE = "recompute"


@dataclass(frozen=True)
class PlanTied:
    names: tuple[str, ...]  # every qualified name of the shared parameter
    units: tuple[int, ...]  # units using it; the runtime replicates it on their stages
    # state bytes (weight, gradient, optimizer state) of one replica: counted in M_s of every
    # stage that uses it without holding units[0], its owner (0 in plans written before)
    state_bytes: int = 0
    step_bytes: int = field(default=0, metadata={"since": 9})  # the replica as its optimizer steps it (model 5)


@dataclass(frozen=True)
class PlanModel:
    name: str
    fingerprint: str
    param_count: int
    num_units: int
    tracer: str
    tied: tuple[PlanTied, ...] = ()
    # Version 3: the user code the tables were costed with (`hetpipe plan --loss/--data`), so
    # `hetpipe check --model` re-derives them the same way; empty for a model's own loss.
    loss: str = field(default="", metadata={"since": 3})
    data: str = field(default="", metadata={"since": 3})


@dataclass(frozen=True)
class PlanTraining:
    global_batch: int
    micro_batch_size: int
    microbatches: int
    optimizer: str
    precision: str
    schedule: str = "1f1b"


@dataclass(frozen=True)
class PlanDevice:
    id: str
    kind: str
    node: str
    memory_bytes: int
    usable_bytes: int
    # Version 4: the card's link to its host and the host's memory bandwidth (the offload lever's
    # prices, `hetpipe.cost_models.offload`); written only by plans solved with offload.
    host_link_bytes_s: float = field(default=0.0, metadata={"since": 4})
    host_memory_bytes_s: float = field(default=0.0, metadata={"since": 4})
    cores: tuple[int, ...] = field(default=(), metadata={"since": 4})  # a CPU core group (cost_models/cpu_cores.py)


@dataclass(frozen=True)
class PlanLink:
    src: str
    dst: str
    bandwidth_bytes_s: float
    latency_s: float
    kind: str = ""


@dataclass(frozen=True)
class UnitTimes:
    fwd: float  # seconds per micro-batch
    bwd: float
    # Version 4: the unit's bandwidth share of the optimizer step, once per iteration
    # (`hetpipe.cost_models.optimizer_step.unit_step_s`).
    step: float = field(default=0.0, metadata={"since": 4})


@dataclass(frozen=True)
class PlanUnit:
    index: int
    name: str
    node_names: tuple[str, ...]
    fwd_flops: int
    bwd_flops: int
    param_bytes: int
    state_bytes: int
    activation_bytes: int
    boundary_bytes: int
    time_s: Mapping[str, UnitTimes]  # device kind -> times
    # Version 3 (memory model 2): the part of boundary_bytes whose storage the stage ending here
    # also holds for backward (`hetpipe.partitioner.capture.graph.Unit.boundary_held_bytes`).
    boundary_held_bytes: int = field(default=0, metadata={"since": 3})
    # Version 3: the parameter gradients within state_bytes (held from a step's first backward on).
    grad_bytes: int = field(default=0, metadata={"since": 3})
    # Version 3: the part of boundary_bytes that requires grad (the gradient message back).
    boundary_grad_bytes: int = field(default=0, metadata={"since": 3})
    # Version 3: the storages the unit makes and saves itself (what recomputing it frees and redoes).
    recompute_bytes: int = field(default=0, metadata={"since": 3})
    # Version 4 (issue 15; plans solved with --tensor-parallel auto): what a group splits (`plan/tp_plan.py`).
    tp_flops_fraction: float = field(default=0.0, metadata={"since": 4})
    tp_param_fraction: float = field(default=0.0, metadata={"since": 4})
    tp_blocks: tuple[PlanBlock, ...] = field(default=(), metadata={"since": 4})
    weight_grad_bytes: int = field(default=0, metadata={"since": 5})  # split plans: kept from B to W (`Unit`'s)
    transient_bwd_bytes: int = field(default=0, metadata={"since": 8})  # memory model 4 (`Unit`'s)
    step_param_bytes: int = field(default=0, metadata={"since": 9})  # memory model 5 (`Unit`'s; `step_schema`)
    step_tensor_bytes: int = field(default=0, metadata={"since": 9})


@dataclass(frozen=True)
class PlanStage:
    index: int
    device: str  # device id
    first_unit: int
    last_unit: int
    fwd_s: float
    bwd_s: float
    memory_bytes: int
    usable_bytes: int
    send_s: float  # C_s one way to the next stage; 0 for the last
    # Version 3 (issue 14): global unit indices in [first_unit, last_unit] whose forward the stage recomputes
    # in the backward (non-reentrant checkpoint).  Left out while empty: plans without levers stay version 1/2.
    recompute_units: tuple[int, ...] = field(default=(), metadata={"since": 3})
    # Version 4 (issue 14): the stage keeps its optimizer state on the host: the bytes that leaves
    # its card and the seconds O_s it adds after its last backward (`hetpipe.cost_models.offload`).
    offload: bool = field(default=False, metadata={"since": 4})
    offload_bytes: int = field(default=0, metadata={"since": 4})
    offload_s: float = field(default=0.0, metadata={"since": 4})
    # Version 4: S_s, the stage's optimizer step (units' shares + its kind's launch share).
    step_s: float = field(default=0.0, metadata={"since": 4})
    # Version 4 (issue 15): a tensor-parallel group of one node's cards (or two nodes'): member ids (`device` first)
    # and shares (> 0, sum 1; `partitioner/tp_tables.py`); empty: `device` alone.
    group_devices: tuple[str, ...] = field(default=(), metadata={"since": 4})
    group_shares: tuple[float, ...] = field(default=(), metadata={"since": 4})
    bwd_weight_s: float = field(default=0.0, metadata={"since": 5})  # W_s: bwd_s's weight-gradient part (ZB W)
    chunks: tuple[PlanChunk, ...] = field(default=(), metadata={"since": 6})  # interleaved: chunk_schema.py
    selective: bool = field(default=False, metadata={"since": 7})  # runs `Plan.selective` on its units


@dataclass(frozen=True)
class Predicted:
    iteration_s: float
    bubble_fraction: float
    samples_per_s: float
    utilisation: Mapping[str, float]  # device id -> busy fraction of the iteration
    # The same stages under the discrete-event simulator (`hetpipe.schedule.simulate`, 1F1B):
    # informational, not the objective; 0.0 in plans written before it was recorded.
    simulated_iteration_s: float = 0.0
    # Version 4: the H-1F1B estimate of the same stages (HARP / AMP / Metis, no step), for
    # comparison only: the objective is the schedule (`Plan.objective`).
    t_1f1b_estimate_s: float = field(default=0.0, metadata={"since": 4})


@dataclass(frozen=True)
class SolverReport:
    name: str
    status: str
    objective_s: float
    bound_s: float
    wall_s: float
    time_limit_s: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class BaselineStage:
    device: str  # device id
    first_unit: int
    last_unit: int


@dataclass(frozen=True)
class BestBaselineReport:
    """A baseline's cut rule on its best device subset and order (`partitioner.baseline_search`)."""

    iteration_s: float
    fits: bool
    search: str  # "exact" | "local search" | "none fits"
    stages: tuple[BaselineStage, ...] = ()
    profile_kind: str = ""  # time-homogeneous: the kind whose times it balances
    note: str = ""


@dataclass(frozen=True)
class BaselineReport:
    iteration_s: float  # forced: every card (at most one per unit) in the cluster file's order
    fits: bool
    note: str = ""
    # Version 3 (issue 17): the same rule on the cards and order a careful user would pick.
    best: BestBaselineReport | None = field(default=None, metadata={"since": 3})


@dataclass(frozen=True)
class LeftOut:
    device: str
    reason: str


@dataclass(frozen=True)
class PlanReplica:
    """A pipeline replica (version 2): `stages[first_stage : first_stage + num_stages]` of the plan."""

    index: int
    first_stage: int
    num_stages: int
    microbatches: int  # m_r
    samples: int  # m_r x micro_batch_size
    grad_weight: float  # samples / global_batch: the replica's weight in the averaged gradient
    iteration_s: float  # T_r: its pipeline's time with m_r micro-batches


@dataclass(frozen=True)
class PlanSyncGroup:
    """One ring all-reduce of a gradient sync: units [first_unit, last_unit], one holder per replica."""

    first_unit: int
    last_unit: int
    devices: tuple[str, ...]
    num_bytes: int
    bandwidth_bytes_s: float  # slowest link between two holders
    latency_s: float  # largest latency between two holders
    time_s: float
    shard: PlanShard | None = field(default=None, metadata={"since": 5})  # optimizer state sharded (ZeRO-1)


@dataclass(frozen=True)
class PlanSync:
    """How the replicas stay consistent (see `hetpipe.cost_models.sync`)."""

    policy: str  # synchronous | diloco
    outer_steps: int  # H: steps per sync (1 for synchronous)
    compute_s: float  # max_r T_r
    sync_s: float  # one full exchange (sum over groups)
    amortised_s: float  # sync_s / H, charged per step
    budget_fraction: float
    reason: str
    groups: tuple[PlanSyncGroup, ...] = ()
    # Largest gradient all-reduce part the runtime sends (whole parameters; the cost model charges
    # each part one ring latency).  Default: torch DDP's 25 MiB (`hetpipe.cost_models.sync.BUCKET_CAP_BYTES`).
    bucket_cap_bytes: int = BUCKET_CAP_BYTES


@dataclass(frozen=True)
class Plan:
    """A pipeline plan.  `Plan.save` / `Plan.load` round-trip exactly.

    With `replicas` (version 2) `stages` lists every replica's stages, replica by replica,
    each `PlanStage.index` its position in its own pipeline; `training.microbatches` is
    the sum of the replicas' m_r and `predicted.iteration_s` is max_r T_r + sync_s / H.
    """

    model: PlanModel
    training: PlanTraining
    devices: tuple[PlanDevice, ...]
    links: tuple[PlanLink, ...]
    units: tuple[PlanUnit, ...]
    stages: tuple[PlanStage, ...]
    predicted: Predicted
    solver: SolverReport
    baselines: Mapping[str, BaselineReport] = field(default_factory=dict)
    left_out: tuple[LeftOut, ...] = ()
    cost_model: Mapping[str, str] = field(default_factory=dict)  # assumptions, human-readable
    format: str = PLAN_FORMAT
    version: int = PLAN_VERSION_SINGLE
    replicas: tuple[PlanReplica, ...] = ()
    sync: PlanSync | None = None
    # Version 3: the `hetpipe.cost_models.stage_memory.MEMORY_MODEL` its memory_bytes were computed
    # with; plans without the field were made with memory model 1.
    memory_model: int = field(default=1, metadata={"since": 3})
    # Version 4: what predicted.iteration_s is: "schedule" (the simulated 1F1B action lists with
    # every stage's optimizer step); absent = the H-1F1B estimate (`ESTIMATE_OBJECTIVE`).
    objective: str = field(default="", metadata={"since": 4})
    # Version 4: per device kind, the launch share of the optimizer step (once per stage).
    step_launch_s: tuple[KindSeconds, ...] = field(default=(), metadata={"since": 4})
    # Version 7: the selective recompute level offered to the planner (None: not offered; `selective_schema`).
    selective: PlanSelective | None = field(default=None, metadata={"since": 7})
    # Version 9: per device kind, the optimizer step's path and its transient's multiples (memory model 5).
    step_transient: tuple[KindStepTransient, ...] = field(default=(), metadata={"since": 9})

    @property
    def objective_name(self) -> str:
        """The objective the plan was solved with: ``schedule`` or ``estimate`` (older plans)."""
        return self.objective or ESTIMATE_OBJECTIVE

    def __post_init__(self) -> None:
        # A plan built in code takes the version its content needs; a file that claims less is
        # refused by `from_dict` (an older hetpipe would not know those fields).
        object.__setattr__(self, "version", max(self.version, least_version(self)))
        if (self.replicas or self.sync is not None) and self.version < PLAN_VERSION_REPLICAS:
            raise PlanError(f"plan.version is {self.version} but the plan has replicas, which need version "
                            f"{PLAN_VERSION_REPLICAS}; set \"version\": {PLAN_VERSION_REPLICAS}")
        if bool(self.replicas) != (self.sync is not None):
            raise PlanError("plan.replicas and plan.sync go together: a replica plan records both; "
                            "re-create it with `partition_replicas`")

    def to_dict(self) -> dict:
        doc = to_json(self)
        # Put the self-description first so `head plan.json` says what it is.
        return {"format": doc.pop("format"), "version": doc.pop("version"), **doc}

    @classmethod
    def from_dict(cls, doc: object, *, source: str = "plan") -> "Plan":
        _check_header(doc, source)
        try:
            plan = from_json(cls, doc, path="plan")
            if plan.version > doc["version"]:
                raise PlanError(f"plan.version is {doc['version']} but the plan uses fields of version "
                                f"{plan.version}; set \"version\": {plan.version}")
            validate_plan(plan)
            return plan
        except PlanError as err:
            if source == "plan":
                raise
            fix = "" if "re-create" in str(err) or "remove it" in str(err) else (
                "; fix the field or re-create the plan with `hetpipe plan`")
            raise PlanError(f"{source}: {err}{fix}") from None

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")  # never a half-written plan

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        if not isinstance(path, (str, os.PathLike)):
            raise PlanError(f"plan: expected a plan file path or a Plan, got {type(path).__name__}; "
                            "pass the plan.json written by `hetpipe plan` or a Plan object")
        path = Path(path)
        try:
            if path.is_file() and path.stat().st_size > MAX_PLAN_FILE_BYTES:
                raise PlanError(f"{path}: {path.stat().st_size} bytes is more than a plan file may have "
                                f"({MAX_PLAN_FILE_BYTES}); pass the plan.json written by `hetpipe plan`")
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise PlanError(f"cannot read plan {path}: {err.strerror}") from None
        except UnicodeDecodeError:
            raise PlanError(f"{path}: not a text file (not UTF-8); pass the plan.json written by "
                            "`hetpipe plan`") from None
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as err:
            hint = " (the file looks truncated)" if err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated") else ""
            raise PlanError(
                f"{path}:{err.lineno}:{err.colno}: not valid JSON{hint}: {err.msg}; re-create it with `hetpipe plan`"
            ) from None
        return cls.from_dict(doc, source=str(path))

    def device_index(self) -> dict[str, int]:
        return {d.id: i for i, d in enumerate(self.devices)}


def _check_header(doc: object, source: str) -> None:
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise PlanError(f"{source}: not a hetpipe plan (format is {got!r}, expected {PLAN_FORMAT!r})")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise PlanError(f"{source}: plan version must be an integer, got {version!r}")
    if version > PLAN_VERSION:
        raise PlanError(
            f"{source}: plan version {version} was written by a newer hetpipe (this one reads up to "
            f"{PLAN_VERSION}); upgrade hetpipe or re-plan with this version"
        )
    if version < 1:
        raise PlanError(f"{source}: plan version {version} is invalid (versions start at 1)")


def problem_from_plan(plan: Plan) -> Problem:
    """Rebuild the solver's `Problem` from the tables recorded in `plan`."""
    kinds = sorted({d.kind for d in plan.devices})
    missing = [(u.index, k) for u in plan.units for k in kinds if k not in u.time_s]
    if missing:
        u, k = missing[0]
        raise PlanError(f"unit {u} has no time_s for device kind {k!r}; re-plan or add the entry")
    index = plan.device_index()
    n = len(plan.devices)
    bandwidth = [[math.inf] * n for _ in range(n)]
    latency = [[0.0] * n for _ in range(n)]
    for link in plan.links:
        if link.src not in index or link.dst not in index:
            raise PlanError(f"link {link.src} -> {link.dst} names a device that is not in the plan")
        bandwidth[index[link.src]][index[link.dst]] = link.bandwidth_bytes_s
        latency[index[link.src]][index[link.dst]] = link.latency_s
    scheduled = plan.objective_name == "schedule"
    return with_plan_splits(plan, Problem(
        step_s={k: tuple(u.time_s[k].step for u in plan.units) for k in kinds} if scheduled else {},
        step_launch_s={ks.kind: ks.seconds for ks in plan.step_launch_s} if scheduled else {},
        objective=plan.objective_name,
        schedule="1f1b" if plan.training.schedule.startswith("gpipe") else plan.training.schedule,  # gpipe: 1F1B's T
        fwd_s={k: tuple(u.time_s[k].fwd for u in plan.units) for k in kinds},
        bwd_s={k: tuple(u.time_s[k].bwd for u in plan.units) for k in kinds},
        state_bytes=tuple(u.state_bytes for u in plan.units),
        activation_bytes=tuple(u.activation_bytes for u in plan.units),
        boundary_bytes=tuple(u.boundary_bytes for u in plan.units),
        boundary_held_bytes=tuple(u.boundary_held_bytes for u in plan.units),
        grad_bytes=tuple(u.grad_bytes for u in plan.units),
        boundary_grad_bytes=tuple(u.boundary_grad_bytes for u in plan.units) if plan.memory_model >= 2 else (),
        recompute_bytes=tuple(u.recompute_bytes for u in plan.units) if plan.memory_model >= 2 else (),
        weight_grad_bytes=tuple(u.weight_grad_bytes for u in plan.units),
        transient_bwd_bytes=tuple(u.transient_bwd_bytes for u in plan.units), **problem_step_fields(plan),
        devices=tuple(DeviceSlot(d.id, d.kind, d.node, d.usable_bytes, d.host_link_bytes_s, d.host_memory_bytes_s)
                      for d in plan.devices),
        bandwidth_bytes_s=tuple(tuple(row) for row in bandwidth), latency_s=tuple(tuple(row) for row in latency),
        microbatches=plan.training.microbatches,
        tied=tuple(TiedCopy(t.units[0], tuple(t.units), t.state_bytes, t.step_bytes) for t in plan.model.tied
                   if t.units and t.state_bytes),
        recompute=recompute_mode(plan),
        offload=offload_mode(plan),
        offload_rates=offload_rates(plan.training.optimizer, plan.training.precision) if plan.memory_model >= 2 else None,
        selective=tables_from_plan_selective(plan.selective, num_units=len(plan.units), kinds=kinds),
    ))


def recompute_mode(plan: Plan) -> str:
    """The recomputation setting `plan` was solved with (`RECOMPUTE_NOTE`; ``none`` when absent)."""
    word = str(plan.cost_model.get(RECOMPUTE_NOTE, "none")).split(":")[0].strip()
    if word not in RECOMPUTE_MODES:
        raise PlanError(f"plan.cost_model.{RECOMPUTE_NOTE}: {word!r} is not one of {', '.join(RECOMPUTE_MODES)}; "
                        "fix the field or re-create the plan with `hetpipe plan`")
    return word


def stages_from_plan(plan: Plan) -> tuple[Stage, ...]:
    index = plan.device_index()
    out = []
    for st in plan.stages:
        if st.device not in index:
            raise PlanError(f"stage {st.index} runs on device {st.device!r}, which the plan does not list")
        out.append(Stage(index[st.device], st.first_unit, st.last_unit, tuple(sorted(st.recompute_units)), st.offload,
                         tuple(index[d] for d in st.group_devices), st.selective))
    chunked = [(index[st.device], st.chunks) for st in plan.stages]  # interleaved: the v p virtual stages
    return virtual_stages(chunked) if any(c for _, c in chunked) else tuple(out)

