"""Issue 12 item 3: `hetpipe plan` says where its answer's gap to the proven bound is above 2% (`cli.tables.gap_note`).

The line names the gap, the limit it was reached at and the measured effect of a longer one; at 2% or below, or
where the answer is proved optimal, nothing is printed.  End to end: a real `hetpipe plan` prints the line once the
threshold is lowered under its gap, and not once it is raised over it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetpipe.cli import tables
from hetpipe.cli.app import main
from hetpipe.cli.tables import gap_note

CLUSTER = Path(__file__).resolve().parents[1] / "examples/clusters/homelab-mini.yaml"


def test_gap_note_only_above_two_percent() -> None:
    assert gap_note(1.0, 0.985, 10.0) is None  # 1.5%: within the target
    assert gap_note(1.0, 1.0, 10.0) is None  # proved optimal
    line = gap_note(1.0, 0.97, 10.0)
    assert line is not None and line.startswith("gap 3.0% between T 1.000 s and its proven lower bound 970.00 ms")
    assert "within a limit of 10 s: a longer --time-limit can tighten it" in line
    assert gap_note(2.0, 0.0, 60.0).startswith("gap 100.0%")  # no bound proved: all of T
    assert gap_note(1.0, 0.97, 10.0, wall_s=9.5) == line  # the limit used: a longer one can help


def test_gap_note_says_a_search_that_ended_early_is_not_helped_by_more_time() -> None:
    line = gap_note(1.0, 0.776, 60.0, wall_s=0.13)  # the new-user review's mlp: 0.13 s of 60 s, same at 10 s
    assert line is not None and "a longer --time-limit can tighten it" not in line
    assert "ended on its own after 0.13 s of a limit of 60 s, so a longer --time-limit will not tighten it" in line


def test_plan_prints_the_note_where_the_gap_is_above_the_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "gpt-tiny", "--cluster", str(CLUSTER), "-o", str(tmp_path / "plan.json"), "--time-limit", "2"]
    monkeypatch.setattr(tables, "GAP_NOTE_ABOVE", -1.0)  # every gap is above it
    assert main(args) == 0
    assert "--time-limit" in capsys.readouterr().out  # either form: gpt-tiny may end before its limit
    monkeypatch.setattr(tables, "GAP_NOTE_ABOVE", 1.0)  # no gap is above it
    assert main(args) == 0
    assert "--time-limit" not in capsys.readouterr().out
