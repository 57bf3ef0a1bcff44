"""Injected faults belong to a supervised run, not to one launch (issue 16; `hetpipe.runtime.faults.carry`).

Pure: plans are stand-ins with ``stages[i].device`` and ``devices[j].kind``; the furthest step earlier
attempts finished is given, as the supervisor's folders would say.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

from hetpipe.runtime.faults.carry import InjectionCarrier, high_water
from hetpipe.runtime.steps_done import StepsDone, write_steps


def _plan(*devices: str, kinds: dict[str, str] | None = None):
    kinds = kinds or {}
    return NS(stages=tuple(NS(device=d) for d in devices),
              devices=tuple(NS(id=d, kind=kinds.get(d, "fast")) for d in ("a", "b", "c")))


def test_each_fault_fires_once_in_whichever_attempt_reaches_its_step():
    c = InjectionCarrier(["kill:rank=1,step=3", "kill:rank=0,step=9", "link:src=1,dst=2,factor=cut,step=6,down=2"])
    three = _plan("a", "b", "c")
    assert c.specs_for(three, high_water=0, start=0, attempt="attempt-0") == (
        "kill:rank=1,step=3", "kill:rank=0,step=9", "link:src=1,dst=2,factor=inf,step=6,down=2")
    # attempt-0 died at the start of step 3 (the kill); the relaunch resumes from step 2 without it
    assert c.specs_for(three, high_water=3, start=2, attempt="attempt-1") == (
        "kill:rank=0,step=9", "link:src=1,dst=2,factor=inf,step=6,down=2")
    # attempt-1 failed at step 4 for another reason: the step-6 cut and the step-9 kill were not reached
    two = _plan("a", "c")
    assert c.specs_for(two, high_water=4, start=4, attempt="attempt-2") == (
        "kill:rank=0,step=9", "link:src=0,dst=1,factor=inf,step=6,down=2")  # clamped to the 2-stage plan's link
    assert [r.fired for r in c.records] == [True, False, False]
    c.settle(10)  # the run finished its 10 steps in attempt-2
    assert [r.fired for r in c.records] == [True, True, True]
    assert c.lines()[2] == ("link:src=1,dst=2,factor=inf,step=6,down=2: fired as "
                            "link:src=0,dst=1,factor=inf,step=6,down=2 on a -> c in attempt-2")


def test_a_slowdown_stays_with_its_card_beyond_what_the_plan_prices():
    c = InjectionCarrier(["slow:rank=2,factor=3,step=2", "kill:rank=0,step=5"])
    assert c.specs_for(_plan("a", "b", "c"), high_water=0, start=0) == ("slow:rank=2,factor=3,step=2",
                                                                         "kill:rank=0,step=5")
    # a kill relaunch from step 4 on a plan with card c first: the slowdown follows c from step 4
    assert c.specs_for(_plan("c", "b"), high_water=5, start=4) == ("slow:rank=0,factor=3,step=4",)
    # a plan that prices c 2x slower (re-planned by --adapt) is emulated 2x slower already: 1.5x is left
    assert c.specs_for(_plan("b", "c", kinds={"c": "fast@x2"}), high_water=6, start=6) == (
        "slow:rank=1,factor=1.5,step=6",)
    assert c.specs_for(_plan("c", kinds={"c": "fast@x3"}), high_water=7, start=7) == ()  # priced in full
    assert c.specs_for(_plan("a", "b"), high_water=7, start=7) == ()  # the card is not in the plan


def test_a_link_fault_on_a_one_stage_plan_cannot_fire_and_is_not_carried_past_its_step():
    c = InjectionCarrier(["link:src=0,dst=1,factor=cut,step=3"])
    assert c.specs_for(_plan("b"), high_water=0, start=0) == ()
    assert c.specs_for(_plan("a", "b"), high_water=1, start=0) == ("link:src=0,dst=1,factor=inf,step=3",)
    c = InjectionCarrier(["link:src=0,dst=1,factor=cut,step=3"])
    c.specs_for(_plan("b"), high_water=0, start=0)
    assert c.specs_for(_plan("a", "b"), high_water=4, start=4) == ()  # the one-stage attempt reached step 3
    assert c.lines() == ["link:src=0,dst=1,factor=inf,step=3: not fired: a link fault on a 1-stage plan (no link)"]


def test_the_high_water_mark_is_the_furthest_step_any_attempt_finished(tmp_path):
    for attempt, rank, done in (("attempt-0", 0, 5), ("attempt-0", 1, 4), ("attempt-1", 0, 3)):
        (tmp_path / attempt).mkdir(exist_ok=True)
        write_steps(tmp_path / attempt, StepsDone(rank=rank, stage=rank, steps_done=done, pid=1, step_s=(),
                                                  time_scale=1.0, time_s=0.0))
    assert high_water(tmp_path, 2) == 5 and high_water(tmp_path / "none", 2) == 2


def _tp_plan():
    """gpt-demo --tensor-parallel auto on homelab-mini: 2 stages on 3 ranks (desk:0 leads desk:1)."""
    return NS(stages=(NS(index=0, device="shelf:0", group_devices=(), first_unit=0, last_unit=0),
                      NS(index=1, device="desk:0", group_devices=("desk:0", "desk:1"), first_unit=1, last_unit=9)),
              devices=tuple(NS(id=d, kind="k") for d in ("shelf:0", "desk:0", "desk:1")), replicas=())


def test_rank_counts_every_tensor_parallel_member_as_torchrun_numbers_them():
    from hetpipe.plan.group_run import rank_slots
    from hetpipe.runtime.adapt_decision import stage_text
    from hetpipe.runtime.faults.options import fault_args

    plan = _tp_plan()
    assert [s.device for s in rank_slots(plan)] == ["shelf:0", "desk:0", "desk:1"]  # the worker's rank -> card
    assert fault_args(plan, ["kill:rank=2,step=1"], emulate=True, steps=3, margin=None,
                      window_steps=None).inject == ("kill:rank=2,step=1",)  # was: rank 2 does not exist
    c = InjectionCarrier(["kill:rank=2,step=3", "slow:rank=2,factor=2,step=1"])
    assert c.specs_for(plan, high_water=0, start=0, attempt="attempt-0") == ("kill:rank=2,step=3",
                                                                            "slow:rank=2,factor=2,step=1")
    assert [r.target for r in c.records] == ["desk:1", "desk:1"]  # was: fired as kill:rank=1 on desk:0
    c.settle(3)
    assert c.lines()[0] == "kill:rank=2,step=3: fired as kill:rank=2,step=3 on desk:1 in attempt-0"
    assert stage_text(plan) == "shelf:0[0-0] desk:0+desk:1[1-9]"


def test_a_link_fault_on_a_tensor_parallel_plan_joins_the_stage_leads():
    c = InjectionCarrier(["link:src=1,dst=0,factor=2,step=1"])
    assert c.specs_for(_tp_plan(), high_water=0, start=0) == ("link:src=1,dst=0,factor=2,step=1",)
    assert c.records[0].target == "desk:0 -> shelf:0"


def test_a_killed_group_member_is_named_by_its_stage_and_card(tmp_path):
    from hetpipe.runtime.launch import first_error, rank_places

    log = "Failures:\n[2]:\n  rank      : 2 (local_rank: 2)\n  exitcode  : 137 (pid: 9404) \n"
    line = first_error(tmp_path, log, rank_places(_tp_plan()))  # was: rank 2 (stage 2), a stage the plan lacks
    assert line.startswith("rank 2 (stage 1, device desk:1) exited with code 137 without reporting an error"), line


def test_a_killed_group_member_records_its_own_card_as_down():
    """``kill:rank=2,...,down=S`` writes the down record the supervisor's ``--wait-for-return`` reads under the
    dead rank's card (`supervise.diagnose`: desk:1), not its lead's."""
    from hetpipe.runtime.faults.watch import StepWatch

    plan = _tp_plan()
    assert [StepWatch.card(NS(plan=plan, stage=s, rank=r, device=plan.stages[s].device))
            for s, r in ((0, 0), (1, 1), (1, 2))] == ["shelf:0", "desk:0", "desk:1"]
