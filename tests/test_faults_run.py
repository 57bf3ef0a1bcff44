"""`hetpipe run --inject` end to end under torchrun on CPU (issue 16): a slowed rank and a slowed link are
named as stragglers (and nothing else is), runs without faults name nothing, a killed rank and a cut link
fail the run by name; `hetpipe calibrate` turns the slowed run into a cluster file on which the planner
moves work off the slowed card.

Each launch starts 3 ranks of gpt-tiny (micro-batch 2 x 16 tokens, 4 micro-batches, the stages of
tests/test_run_cli.py) on `LAB`, a cluster file like tests/synthetic.py's.  Assertions are on the injected
factors and on which rank is named, never on one wall-time sample.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hetpipe.runtime.faults.straggler import read_stragglers
from hetpipe.runtime.report import RunReport
from tests.forked_launch import use_forked_launch
from tests.test_run_cli import BATCH, MICROBATCHES, MODEL, SAFETY_FACTOR, SEQ, _common, _error, hetpipe_run

pytestmark = pytest.mark.slow

STEPS = 7
#: The fault-free run: the stage-steps two runs of STEPS gave (tests/test_faults_run.py's clean check).
CLEAN_STEPS = 2 * STEPS
#: The injected factor as the detector measures it: never below it by more than the stretch's own 2% and
#: timer granularity; above it by late wake-ups of a sleeping rank on a loaded machine (tests/test_run_cli.py
#: STRETCH_UNDER / STRETCH_OVER, the same bounds as the stretch without faults).
UNDER, OVER = 0.10, 0.50
#: `hetpipe calibrate` must find the slowed card's speed within this of 1 / factor (issue 16).
CALIBRATION_TOLERANCE = 0.10
LAB = """
name: fault-lab
nodes:
  - name: n0
    intra_link: {bandwidth: 16GB/s, latency: 5us}
    network: {bandwidth: 1Gbit/s, latency: 0.2ms}
    devices:
      - {name: fast, memory: 24GB, reserve: 1GB, tensor_tflops: 80, fp32_tflops: 40, memory_bandwidth: 900GB/s}
      - {name: mid, memory: 24GB, reserve: 1GB, tensor_tflops: 60, fp32_tflops: 30, memory_bandwidth: 900GB/s}
  - name: n1
    network: {bandwidth: 1Gbit/s, latency: 0.2ms}
    devices:
      - {name: slow, memory: 12GB, reserve: 1GB, tensor_tflops: 20, fp32_tflops: 10, memory_bandwidth: 900GB/s}
"""


def failing_run_timeout_s() -> float:
    """``--timeout`` for the runs that must fail: 5 s per unit of load per core (1-minute load average), 10 to 60 s.

    The ranks' wait bound also bounds the process-group join and the start-up barrier, where one rank on a
    loaded 2-core machine arrives seconds after the others (importing torch alone took 11 s of wall time at
    load 11, 2.6 s of CPU): a fixed 5 s failed the join there, naming the slow rank instead of the fault.  The
    tests are not about detection time: a killed rank is reported by torchrun as it exits whatever this is;
    a cut link blocks for this long, then fails naming the link.
    """
    per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return min(60.0, max(10.0, 5.0 * per_core))


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> tuple[Path, Path]:
    """(cluster file, plan file): three hand-chosen stages of gpt-tiny on fast, mid, slow."""
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture
    from hetpipe.partitioner.problem import Stage
    from tests.runtime_plans import plan_for

    folder = tmp_path_factory.mktemp("lab")
    cluster = folder / "lab.yaml"
    cluster.write_text(LAB)
    model, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(model, inputs, name=MODEL)
    n = graph.num_units
    stages = (Stage(0, 0, n // 3 - 1), Stage(1, n // 3, 2 * n // 3 - 1), Stage(2, 2 * n // 3, n - 1))
    plan = plan_for(graph, load_cluster(cluster), stages, microbatches=MICROBATCHES)
    plan.save(folder / "plan.json")
    return cluster, folder / "plan.json"


def _run(plan: Path, tmp_path: Path, name: str, *faults: str, steps: int = STEPS) -> RunReport:
    report = tmp_path / f"{name}.json"
    argv = [*_common(plan, tmp_path / name), "--steps", str(steps), "--emulate", "--safety-factor",
            str(SAFETY_FACTOR), "--report", str(report)]
    for f in faults:
        argv += ["--inject", f]
    assert hetpipe_run(argv) == 0
    return RunReport.load(report)


def _work_on(plan, device: str) -> int:
    """FLOPs (forward + backward) the plan puts on ``device``."""
    return sum(u.fwd_flops + u.bwd_flops for st in plan.stages if st.device == device
               for u in plan.units[st.first_unit:st.last_unit + 1])


def _calibrate_and_replan(cluster: Path, report: Path, tmp_path: Path, slowed: str) -> None:
    """`hetpipe calibrate` gives the slowed card 1/3 of its speed; the planner then moves work off it."""
    import hetpipe
    from hetpipe.cli import app
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.models import build

    out = tmp_path / "calibrated.yaml"
    assert app.main(["calibrate", str(report), "--cluster", str(cluster), "-o", str(out)]) == 0
    before, after = load_cluster(cluster), load_cluster(out)
    for dev in before.devices:
        speed = after.device(dev.id).profile.fp32_flops_s / dev.profile.fp32_flops_s
        want = 1 / 3 if dev.id == slowed else 1.0
        assert speed == pytest.approx(want, rel=CALIBRATION_TOLERANCE), (dev.id, speed)
    model, batch = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    plans = [hetpipe.partition(model, c, example_inputs=batch, global_batch=BATCH * MICROBATCHES,
                               optimizer="adam") for c in (cluster, out)]
    assert _work_on(plans[1], slowed) < _work_on(plans[0], slowed), [p.stages for p in plans]


def test_slowed_rank_and_slowed_link_are_named_alone_and_no_fault_names_nothing(lab, tmp_path, capsys, monkeypatch):
    cluster, plan_path = lab
    rep = _run(plan_path, tmp_path, "slow", "slow:rank=1,factor=3,step=2")
    assert rep.injected == ("slow:rank=1,factor=3,step=2",)
    (rec,) = rep.stragglers
    assert (rec.rank, rec.stage, rec.what, rec.since_step) == (1, 1, "compute", 2)
    assert rec.detected_step == 2  # 3x: named after its first slow step (excess 2 >= K x margin = 0.75)
    for measure in ("fwd", "bwd"):
        assert 3 * (1 - UNDER) <= rec.factors[measure] <= 3 * (1 + OVER), rec
    assert read_stragglers(tmp_path / "slow") == (rec,)  # the file a supervisor polls
    assert "WARNING hetpipe.faults: straggler: rank 1 (stage 1" in (tmp_path / "slow" / "torchrun.log").read_text()
    assert "straggler: rank 1 (stage 1" in capsys.readouterr().out
    _calibrate_and_replan(cluster, tmp_path / "slow.json", tmp_path, rep.stages[1].device)

    # The slowed link and the clean run: the same CLI and rank code on ranks forked from the test fork server
    # (`tests.forked_launch`; the injections are the ranks' own), ~10 s of CPU less each; the run above is torchrun's.
    use_forked_launch(monkeypatch)
    rep = _run(plan_path, tmp_path, "link", "link:src=1,dst=2,factor=4,step=1")
    (rec,) = rep.stragglers
    assert (rec.rank, rec.what, rec.since_step, rec.link) == (1, "link", 1, f"{rep.stages[1].device} -> "
                                                                               f"{rep.stages[2].device}")
    assert rec.factors == {"send->2": pytest.approx(4.0)}  # the emulated wire time, exact by construction

    # No fault: one launch of CLEAN_STEPS, as many stage-steps as two launches of STEPS (one launch less,
    # ~15 s of CPU; the detector sees them as one longer window, never an easier one).
    rep = _run(plan_path, tmp_path, "clean", steps=CLEAN_STEPS)
    assert rep.stragglers == () and not list((tmp_path / "clean").glob("straggler-rank*.json"))
    worst = [max(r.ratios[m] for m in ("fwd", "bwd")) for st in rep.stages for r in st.step_ratios]
    assert len(worst) >= 2 * len(rep.stages) * (STEPS - 1), len(worst)
    print(f"no faults: worst per-step measured/predicted {max(worst):.3f} over {len(worst)} stage-steps")


def test_a_killed_rank_fails_the_run_naming_it(lab, tmp_path, capsys):
    plan_path = lab[1]
    rc = hetpipe_run([*_common(plan_path, tmp_path / "run"), "--steps", "4", "--timeout",
                      f"{failing_run_timeout_s():.0f}", "--inject", "kill:rank=1,step=2"])
    line = _error(capsys.readouterr().err)
    assert rc == 2
    assert line.startswith("error: rank 1 (stage 1) exited with code 137 without reporting an error"), line
    assert "(injected: kill:rank=1,step=2)" in line
    assert not (tmp_path / "run" / "error-rank1.json").exists()  # no cleanup: it could not say so itself
    survivors = [json.loads(p.read_text())["rank"] for p in (tmp_path / "run").glob("error-rank*.json")]
    assert 1 not in survivors


def test_a_cut_link_fails_the_run_naming_the_link(lab, tmp_path, capsys):
    plan_path = lab[1]
    rc = hetpipe_run([*_common(plan_path, tmp_path / "run"), "--steps", "4", "--timeout",
                      f"{failing_run_timeout_s():.0f}", "--emulate",
                      "--safety-factor", str(SAFETY_FACTOR), "--inject", "link:src=1,dst=2,factor=cut,step=2"])
    line = _error(capsys.readouterr().err)
    assert rc == 2
    # Whichever rank gives up first, the line names the cut link: the sender by its devices, every other
    # rank by the injected spec.
    assert ("the emulated link" in line and "is cut" in line) or \
        "was cut by --inject link:src=1,dst=2,factor=inf,step=2" in line, line
