"""A plan written by re-planning (the supervisor's `plan.replan`, after a lost rank or a straggler) passes
`hetpipe check`: its recorded baselines are priced from the tables it records (second review: gpt-demo on
homelab-mini, desk:1 lost, recorded the baselines' best cards with the selective level but dropped the level's
tables, so check recomputed their T without it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetpipe.cli.app import main
from hetpipe.plan.check import check_plan
from hetpipe.plan.replan import replan
from hetpipe.plan.schema import Plan

CLUSTER = Path(__file__).resolve().parents[1] / "examples/clusters/homelab-mini.yaml"


@pytest.fixture(scope="module")
def mini_plan(tmp_path_factory) -> Plan:
    out = tmp_path_factory.mktemp("replan") / "plan.json"
    assert main(["plan", "gpt-demo", "--cluster", str(CLUSTER), "--batch", "1", "--global-batch", "4",
                 "-o", str(out)]) in (0, None)
    return Plan.load(out)


def test_a_plan_replanned_without_a_lost_card_passes_check(mini_plan):
    assert "desk:1" in {s.device for s in mini_plan.stages} and check_plan(mini_plan).ok
    new = replan(mini_plan, lost=("desk:1",), time_limit_s=5.0).plan  # what `supervise._lost` calls
    assert "desk:1" not in {d.id for d in new.devices}
    assert check_plan(new).violations == ()


def test_a_plan_replanned_around_a_slow_card_passes_check(mini_plan):
    new = replan(mini_plan, slowdown={"desk:0": 3.0}, time_limit_s=5.0).plan  # an `--adapt` switch's plan
    assert check_plan(new).violations == ()
