"""Item 7 of issue 11: when nothing fits, the error names the flags that would fit, with the figure each reaches."""

from __future__ import annotations

import dataclasses
import re

import pytest

from hetpipe.cli import app
from hetpipe.partitioner.solvers.infeasible import MemoryFit, least_memory_fit
from hetpipe.plan.build import build_problem
from hetpipe.plan.fit_hints import FitOption, Settings, alternatives, fit_hint
from hetpipe.plan.schema import Plan
from tests.synthetic import synthetic_cluster, synthetic_graph

CLUSTER = "examples/clusters/homelab-mini.yaml"


def test_least_memory_fit_is_the_smallest_factor_that_fits():
    from hetpipe.partitioner.solvers.solve import solve

    problem = build_problem(synthetic_graph(6), synthetic_cluster(), microbatches=4)
    fit = least_memory_fit(problem)

    def scaled(f: float):
        devs = tuple(dataclasses.replace(d, usable_bytes=int(d.usable_bytes * f)) for d in problem.devices)
        return dataclasses.replace(problem, devices=devs)

    assert fit is not None and fit.factor < 1 and fit.fits
    solve(scaled(fit.factor * (1 + 1e-6)), solver="dp")  # fits just above the factor
    from hetpipe.errors import InfeasibleError
    with pytest.raises(InfeasibleError):
        solve(scaled(fit.factor * (1 - 1e-3)), solver="dp")  # and nothing fits clearly below it


def test_hint_without_any_fitting_setting_reports_the_lightest_of_each_group():
    s = Settings(4, None, "fp32", "adam")
    over = MemoryFit(1.5, 0, "d0", 15 * 2**20, 10 * 2**20)
    opts = [FitOption(s, "--batch 2", over, "--batch"), FitOption(s, "--batch 1", over, "--batch"),
            FitOption(s, "--optimizer sgd", over, "--optimizer")]
    text = fit_hint(opts, current=MemoryFit(2.0, 0, "d0", 20 * 2**20, 10 * 2**20))
    assert text.startswith("No lighter setting fits; the best each reaches: --batch 1 (fullest stage 15.00 MiB")
    assert "--batch 2" not in text and "--optimizer sgd" in text and "cards with 2.00x" in text


def test_alternatives_of_a_factory_offer_only_precision_optimizer_and_offload():
    flags = [o.flags for o in alternatives(Settings(8, None, "fp32", "adam"), builtin=False, lm=False)]
    assert flags == ["--precision bf16-mixed", "--optimizer sgd", "--offload auto",
                     "--precision bf16-mixed --optimizer sgd"]  # sgd leaves nothing to offload: not combined


def test_cli_error_names_the_largest_batch_that_fits_and_it_does(tmp_path, capsys):
    base = ["plan", "gpt-demo", "--cluster", CLUSTER, "--recompute", "none"]
    capsys.readouterr()
    assert app.main([*base, "-o", str(tmp_path / "no.json")]) == 2  # gpt-demo's default micro-batch 8
    err = capsys.readouterr().err
    assert err.startswith("error: no plan fits in memory") and err.count("\n") == 1
    # recomputation is offered as a flag hetpipe applies, with the figure it reaches
    assert re.search(r"--recompute all \(fullest stage [\d.]+ MiB of [\d.]+ MiB on", err), err
    assert re.search(r"These settings fit: .*--recompute auto \(fullest stage", err), err
    m = re.search(r"These settings fit: --batch (\d+) \(fullest stage ([\d.]+) MiB of ([\d.]+) MiB", err)
    assert m, err
    batch, fullest, usable = int(m.group(1)), float(m.group(2)), float(m.group(3))
    assert fullest <= usable
    assert app.main([*base, "--batch", str(batch), "-o", str(tmp_path / "yes.json")]) == 0
    plan = Plan.load(tmp_path / "yes.json")
    assert all(s.memory_bytes <= s.usable_bytes for s in plan.stages)
    assert app.main([*base, "--batch", str(batch * 2), "-o", str(tmp_path / "no2.json")]) == 2  # the largest


def test_demo_says_which_micro_batch_and_precision_it_uses(tmp_path, capsys):
    capsys.readouterr()
    assert app.main(["demo", "--fast", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "settings: --batch 2 --seq 128 --precision fp32 --optimizer adam --global-batch 12" in out
    assert "settings: --batch 1 --seq 1024 --precision bf16-mixed --optimizer adam" in out


def test_default_recompute_auto_fits_what_none_cannot_and_show_says_what_it_cost(tmp_path, capsys):
    from hetpipe.plan.check import check_plan
    from hetpipe.plan.levers import stage_levers

    out = tmp_path / "auto.json"
    assert app.main(["plan", "gpt-demo", "--cluster", CLUSTER, "-o", str(out)]) == 0  # micro-batch 8, as above
    plan = Plan.load(out)
    # version 8: the loss's transient (memory model 4) on the last stage, whose 4 MiB of logits' gradients now make
    # whole units there cheaper than the selective level (memory model 3 chose the level there: version 7)
    assert plan.version == 9 and any(s.recompute_units for s in plan.stages) and check_plan(plan).ok
    assert [s.selective for s in plan.stages] == [False, False, False]
    assert plan.selective is not None  # a baseline's placement runs the level: its tables recorded, so check re-derives it
    assert plan.cost_model["recompute"].startswith("auto:")
    levers = [lv for lv in stage_levers(plan) if lv is not None]
    assert levers and all(lv.saved_bytes + lv.selective_saved_bytes > 0 and lv.extra_s + lv.selective_s > 0
                          for lv in levers)
    capsys.readouterr()
    assert app.main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "recompute" in shown and re.search(r"\d+ units, -[\d.]+ [KMG]iB, \+[\d.]+", shown.replace("\n", " ")), shown
    assert app.main(["plan", "gpt-demo", "--cluster", CLUSTER, "--recompute", "some", "-o", str(out)]) == 2
    assert "--recompute" in capsys.readouterr().err
