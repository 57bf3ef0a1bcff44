"""``--adapt`` on a slow link (issue 16, item 3): the ranks' detection names the link, the supervisor
re-plans with that link's bandwidth / factor and latency x factor, and relaunches at a checkpoint.

gpt-tiny on the 3-device synthetic cluster (stages on n0:0, n0:1, n1:2; the 1 GbE link n0:1 -> n1:2
carries stage 1's activations), emulated; ``--inject link:src=1,dst=2,factor=F,step=2`` slows that
link F times.  Nothing here is written by hand: the straggler report is the ranks' own.
"""

from __future__ import annotations

import pytest

from hetpipe.runtime.report import RunReport
from tests.test_supervise import _argv, _assert_equals_single_device, setup  # noqa: F401 - `setup` is a fixture
from tests.test_run_cli import SAFETY_FACTOR, hetpipe_run
from tests.supervise_data import DELAY_ENV

LINK = ("n0:1", "n1:2")


def test_a_slow_link_is_read_and_priced_on_the_pair():
    import json
    import tempfile
    from pathlib import Path

    from hetpipe.plan.check import check_plan
    from hetpipe.plan.replan import replan
    from hetpipe.runtime.supervise import Straggler, read_straggler
    from tests.runtime_plans import synthetic_plan

    plan = synthetic_plan()  # n0:0 [0-2], n0:1 [3-4], n1:2 [5]
    path = Path(tempfile.mkdtemp()) / "straggler-rank1.json"
    path.write_text(json.dumps({"rank": 1, "stage": 1, "device": "n0:1", "what": "link", "factors": {"send->2": 4.0},
                                "link": "n0:1 -> n1:2", "since_step": 1, "detected_step": 3}))
    s = read_straggler(path, plan)
    assert s == Straggler(1, 1, "n0:1", 4.0, 3, LINK, since=1) and s.what == "rank 1's link n0:1 -> n1:2"
    path.write_text(json.dumps({"rank": 1, "what": "link", "factors": {"send->2": 4.0}, "link": "n0:1 -> x:9"}))
    assert read_straggler(path, plan) is None  # a link to a device the plan does not have
    r = replan(plan, link_slowdown={LINK: 4.0})
    assert check_plan(r.plan).ok
    links = {(l.src, l.dst): l for l in r.plan.links}
    before = {(l.src, l.dst): l for l in plan.links}
    for pair in (LINK, LINK[::-1]):  # both directions: the objective prices a cut as twice its forward link
        assert links[pair].bandwidth_bytes_s == pytest.approx(before[pair].bandwidth_bytes_s / 4, rel=1e-12)
        assert links[pair].latency_s == pytest.approx(before[pair].latency_s * 4, rel=1e-12)
    untouched = [p for p in before if set(p) != set(LINK)]
    assert all(links[p] == before[p] for p in untouched if p in links)
    # The old cuts priced on the slowed link: slower than recorded by the slowed cut's messages alone.
    assert r.old_iteration_s > plan.predicted.iteration_s and r.new_iteration_s < r.old_iteration_s


@pytest.mark.slow
def test_adapt_replans_away_from_a_slowed_link(setup, tmp_path, monkeypatch):  # noqa: F811 - the fixture
    """The link n0:1 -> n1:2 carries messages 30x slower from step 2 (the old cuts then predict
    ~20x their T; the emulated run, slowed in that direction only, measures ~15x).  The detection
    names it after step 2 (one step: its excess is far above K x margin); the re-plan (n0:0 + n0:1, no inter-node
    cut) pays over the remaining steps, so the job stops at the next checkpoint (4 or 8) and continues
    there; the parameters equal one device's (SGD, as the compute case)."""
    folder, state = setup
    steps, every, factor = 48, 4, 30.0  # 40 steps left: measured gain 2-3x the restart cost (load 5)
    monkeypatch.setenv(DELAY_ENV, "0")
    argv = _argv(folder, tmp_path, steps, "--adapt", "--emulate", "--safety-factor", str(SAFETY_FACTOR),
                 "--inject", f"link:src=1,dst=2,factor={factor:g},step=2", every=every, plan="plan3-sgd.json")
    assert hetpipe_run(argv) == 0
    report = RunReport.load(tmp_path / "run.json")
    (r,) = report.restarts
    assert r.kind == "adapt" and r.device == "n0:1 -> n1:2" and r.factor == pytest.approx(factor, rel=1e-6)
    assert r.resumed_step >= 2 + 1 and r.resumed_step % every == 0 and r.steps_redone == r.failed_step - r.resumed_step
    assert r.new_predicted_s < r.old_predicted_s and "n1:2" not in r.new_stages
    assert any(n.startswith("straggler: rank 1's link n0:1 -> n1:2 30x slower") for n in report.notes), report.notes
    _assert_equals_single_device(tmp_path / "ck", report, state, steps, "sgd")
