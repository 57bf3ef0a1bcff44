"""`hetpipe demo --fast`: the README's main job plans, compares and writes its files (no launch here;
the emulated run it adds is covered by tests/test_run_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

from hetpipe.cli import app as cli
from hetpipe.cli.demo import bundled_cluster
from hetpipe.plan.check import check_plan
from hetpipe.plan.schema import Plan

ROOT = Path(__file__).resolve().parents[1]


def test_bundled_clusters_are_the_examples() -> None:
    """One copy: the examples' home-lab files are links to the files shipped in the package."""
    for name in ("homelab.yaml", "homelab-mini.yaml"):
        example = ROOT / "examples" / "clusters" / name
        assert example.resolve() == bundled_cluster(name).resolve()
        assert bundled_cluster(name).read_text() == example.read_text()


def test_demo_fast_plans_beats_baselines_and_writes_files(tmp_path: Path, capsys) -> None:
    assert cli.main(["demo", "--fast", "--out", str(tmp_path)]) == 0
    plan = Plan.load(tmp_path / "plan.json")
    assert check_plan(plan).ok
    # bound and verify (issue 17): the schedule's T with a valid lower bound, OPTIMAL only when they meet
    assert plan.solver.bound_s <= plan.solver.objective_s == plan.predicted.iteration_s
    assert (plan.solver.status == "OPTIMAL") == (plan.solver.bound_s >= plan.solver.objective_s * (1 - 1e-9))
    # the story: forced onto every card, no baseline fits on the small card, not even Megatron's with the
    # planner's recomputation lever (memory model 2: 10.4 of 10.0 MiB on the 3060); hetpipe's fits
    for name in ("parameters", "uniform"):
        assert not plan.baselines[name].fits and "rtx3060" in plan.baselines[name].note
    # ... and the headline is over each rule on the cards a user would pick, which fit and are slower
    for b in plan.baselines.values():
        assert b.best.fits and plan.predicted.iteration_s < b.best.iteration_s
    assert all(s.memory_bytes <= s.usable_bytes for s in plan.stages)
    assert (tmp_path / "gantt.png").stat().st_size > 10_000
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["ph"] for e in trace["traceEvents"]} == {"X", "M"}  # slices, and the metadata naming their rows
    out = capsys.readouterr().out
    assert "out of memory" in out and "faster than the best hand-tuned baseline" in out
    assert str(tmp_path / "replicas.json") in out.split("files")[-1]  # every file written is listed
    # the plan is `hetpipe plan`'s with the settings the demo prints (the review: no selective record, other
    # baselines): same stages, T, selective record and baselines
    cli_path = tmp_path / "cli.json"
    assert cli.main(["plan", "gpt-demo", "--cluster", str(bundled_cluster("homelab-mini.yaml")), "--batch", "2",
                     "--seq", "128", "--precision", "fp32", "--global-batch", "12", "-o", str(cli_path)]) == 0
    demo_doc, cli_doc = (json.loads(p.read_text()) for p in (tmp_path / "plan.json", cli_path))
    for key in ("stages", "predicted", "selective", "baselines"):
        assert demo_doc.get(key) == cli_doc.get(key), key
