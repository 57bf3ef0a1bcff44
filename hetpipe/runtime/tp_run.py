"""One rank of a plan with tensor-parallel groups: its member's shard, its executor wiring and its
emulated times (issue 15; the worker calls these after joining the process group).

* `setup_groups`: all-gather the rank layout (`hetpipe.runtime.tp_ranks`), create every group's
  process groups (collective, same order everywhere), and on a group member cut its shard out of
  the stage it built from the full initial weights (`hetpipe.runtime.tp_shard.shard_model`: the
  same seeded init or ``--weights`` a single device starts from, sliced by the plan's shares) and
  wire the executor (`hetpipe.runtime.execute.group.group_wiring`).
* `save_grouped`: ``--save-weights``: every group gathers its shards back, the leads write.
* `member_predicted`: what ``--emulate`` stretches a member's F and B to, its own share's time
  plus the group's all-reduces and the lead's broadcast as the contract prices them
  (`hetpipe.plan.group_run.member_timings`); a width-1 stage keeps its plan F_s and B_s.

Example:
    >>> from types import SimpleNamespace as NS
    >>> units = [NS(tensor_parallel=()), NS(tensor_parallel=("a", "b")), NS(tensor_parallel=("c",))]
    >>> stage_blocks(units, NS(first_unit=1, last_unit=2))
    ['a', 'b', 'c']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from hetpipe.errors import ConfigError
from hetpipe.plan.group_run import RankSlot, member_timings
from hetpipe.plan.schema import Plan
from hetpipe.plan.user_code import import_callable
from hetpipe.runtime.emulate.pipeline import StageTiming
from hetpipe.runtime.execute.group import group_wiring
from hetpipe.runtime.execute.options import ReplicaWiring
from hetpipe.runtime.stage.types import StageModule
from hetpipe.runtime.stage.weights import save_pipeline
from hetpipe.runtime.rank import node_to_stage, resolve_for_plan
from hetpipe.runtime.tp_export import (
    is_export_stage, member_node_stage, member_stage_graph, shard_export_stage)
from hetpipe.runtime.tp_ranks import GroupHandles, Layout, gather_layout
from hetpipe.runtime.tp_shard import MemberShare, gather_parameter, shard_model
from hetpipe.runtime.tp_vocab import check_vocab_loss, vocab_loss


@dataclass(frozen=True)
class GroupSetup:
    """This rank's layout and the wiring its executor takes."""

    layout: Layout
    wiring: ReplicaWiring
    handles: GroupHandles
    module: Any = None  # this member's sharded stage module (None on a width-1 stage)

    def loss(self, loss_fn: Any) -> Any:
        """The loss this rank runs: a head split by vocabulary runs the vocab-parallel cross-entropy
        (`tp_vocab.vocab_loss`); otherwise ``loss_fn`` itself."""
        return loss_fn if self.module is None or loss_fn is None else vocab_loss(loss_fn, self.module)


def stage_blocks(units: Sequence[Any], plan_stage: Any) -> list[Any]:
    """The tensor-parallel blocks of the units a plan stage runs, in unit order."""
    return [b for u in units[plan_stage.first_unit:plan_stage.last_unit + 1] for b in u.tensor_parallel]


def check_shardable(plan: Plan, graph: Any, *, loss: str | None = None) -> None:
    """Refuse, before launching, a group stage whose blocks' layers are neither ``nn.Linear`` / ``Conv1D``
    (``nn.Embedding``) modules (``torch.fx``) nor weights applied in a ``torch.export`` graph (plain
    containers: Hugging Face models, re-exported per member by `tp_export`), and a ``--loss`` other than
    the built-in LM loss when the last stage's head is split by vocabulary."""
    last = plan.stages[-1]
    if loss is not None and last.group_devices and any(b.kind == "head" for b in stage_blocks(graph.units, last)):
        check_vocab_loss(import_callable(loss, option="--loss"))
    for st in plan.stages:
        blocks = stage_blocks(graph.units, st) if st.group_devices else []
        for block in sorted(blocks, key=lambda b: b.is_vocab):  # the pairs' layers named first
            for spec in block.parameters:
                path = spec.name.rsplit(".", 1)[0]
                kind = type(graph.module.get_submodule(path)).__name__
                if kind not in ("Linear", "Conv1D", "Embedding", "Module"):
                    raise ConfigError(f"plan stage {st.index} runs on the group {list(st.group_devices)}, but its "
                                      f"tensor-parallel layer {path!r} is a {kind} in the captured graph, which "
                                      "groups cannot shard; re-plan with --tensor-parallel off")


def setup_groups(plan: Plan, slot: RankSlot, stage: StageModule, units: Sequence[Any], *,
                 timeout_s: float, source: Any = None) -> GroupSetup:
    """Collective: layout, process groups, this member's shard, its wiring (module docstring).

    ``source``: the rank's run (``worker._Run``): a stage of a ``torch.export`` graph (Hugging Face
    models) is re-exported at the member's widths from its ``args.model`` and ``args.seq`` and aligned
    with its captured graph module ``meta_model`` (`tp_export`)."""
    layout = gather_layout(plan, slot)
    handles = GroupHandles(layout, [g.stages for g in stage.tied_groups], timeout_s=timeout_s)
    st = plan.stages[slot.stage]
    if not st.group_devices:
        return GroupSetup(layout, ReplicaWiring(tied_group=handles.tied_group), handles)
    blocks = stage_blocks(units, st)
    if not blocks:
        raise ConfigError(f"plan stage {slot.stage} runs on the group {list(st.group_devices)}, but its units "
                          f"{st.first_unit}-{st.last_unit} have no tensor-parallel block in this model; re-create "
                          "the plan with `hetpipe plan --tensor-parallel auto` for this model")
    group, share = handles.my_group(), MemberShare(slot.member, tuple(st.group_shares))
    if is_export_stage(stage.module, blocks):
        if source is None:
            raise ConfigError("a tensor-parallel stage of a torch.export graph is rebuilt from its model: pass "
                              "source= (the rank's run: its args.model, args.seq, meta_model) to setup_groups")
        _shard_export(plan, slot, stage, blocks, share=share, group=group, model=source.args.model,
                      seq=source.args.seq, full_graph=source.meta_model)
    else:
        shard_model(stage.module, blocks, share=share, group=group)
    wiring = group_wiring(stage, group=group, lead_rank=layout.stage_ranks[slot.stage], is_lead=layout.is_lead,
                          tied_group=handles.tied_group)
    return GroupSetup(layout, wiring, handles, stage.module)


def _shard_export(plan: Plan, slot: RankSlot, stage: StageModule, blocks: Sequence[Any], *, share: MemberShare,
                  group: Any, model: str, seq: int | None, full_graph: Any) -> None:
    """A stage of a ``torch.export`` graph: re-export the member's model at its widths (`tp_export`)."""
    resolved = resolve_for_plan(plan, model=model, seq=seq)
    full_stages = node_to_stage(plan, full_graph)
    local = member_stage_graph(resolved.model, resolved.example_inputs, blocks, share=share, stage=slot.stage,
                               node_stage=lambda gm: member_node_stage(full_graph, full_stages, gm),
                               expect=(stage.in_cut, stage.out_cut))
    shard_export_stage(stage.module, local, blocks, share=share, group=group, device=stage.device)


def save_grouped(setup: GroupSetup, plan: Plan, stage: StageModule, units: Sequence[Any], *,
                 names: Mapping[str, str], out_dir: str) -> None:
    """``--save-weights`` of a grouped plan (collective): each group gathers its full parameters onto
    every member (`gather_parameter`), then the leads write the stages as a single pipeline does."""
    slot = setup.layout.slot
    st = plan.stages[slot.stage]
    shards: dict[Any, Any] = {}  # parameter -> its shard, put back after writing (training may go on)
    if st.group_devices:
        share, params = MemberShare(slot.member, tuple(st.group_shares)), dict(stage.module.named_parameters())
        for block in stage_blocks(units, st):
            for spec in block.parameters:
                p = params[spec.name]
                if p in shards:  # a tied embedding and head: one parameter, gathered once
                    continue
                full = gather_parameter(p, spec, parts=block.parts, share=share, group=setup.handles.my_group())
                shards[p], p.data = p.data, full
    try:
        if setup.layout.is_lead:
            save_pipeline(stage.module, names, out_dir, stage=slot.stage, num_stages=len(plan.stages),
                          group=setup.handles.leads)
    finally:
        for p, shard in shards.items():
            p.data = shard


def member_predicted(plan: Plan, slot: RankSlot, stage_timing: StageTiming) -> StageTiming:
    """The F and B a rank is emulated at: its member's own (group stages) or the stage's (``stage_timing``)."""
    mine = member_timings(plan).get((slot.stage, slot.member))
    return stage_timing if mine is None else StageTiming(mine.fwd_s, mine.bwd_s)
