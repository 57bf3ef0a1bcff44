"""Output paths that cannot be written: one ``error:`` line naming the option and the path, exit 2, before any work.

``os.access`` says yes to root for ``/proc`` and ``/sys``, so the checks in
`hetpipe.cost_models.outputs` create (and remove) a probe file instead.  The ``/proc`` and
``/sys`` cases run as any user (both refuse new files to everyone) and are skipped where the
folders do not exist.  A write that fails although the check passed is one line too (the
fallback cases turn the check off).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetpipe.cli import checks
from hetpipe.cli.app import main
from hetpipe.cost_models.outputs import atomic_write_text, check_folder, check_writable, writable_folder
from hetpipe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = str(ROOT / "examples/clusters/homelab-mini.yaml")


def _one_error(capsys: pytest.CaptureFixture[str], argv: list[str], *, before_any_work: bool = False) -> str:
    """Run the CLI in-process; assert exit 2, one `error:` line on stderr, no traceback; return it.
    `before_any_work`: also nothing on stdout (each command prints its tables, estimate or plans as its work goes)."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert not (before_any_work and out), f"the check came after the work: {out[-500:]}"
    lines = err.strip().splitlines()
    assert code == 2, (code, out[-500:], err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert "Traceback" not in out + err, err[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["plan", "mlp-tiny", "--cluster", CLUSTER, "-o", str(path), "--time-limit", "5"]) == 0
    return path


#: (id, argv with {plan} and {target}, the option the error names)
COMMANDS = [
    ("plan-o", ["plan", "mlp-tiny", "--cluster", CLUSTER, "--time-limit", "5", "-o", "{target}.json"], "-o/--output"),
    ("run-report", ["run", "{plan}", "--model", "mlp-tiny", "--steps", "2", "--emulate", "--report",
                    "{target}.json"], "--report"),
    ("show-gantt", ["show", "{plan}", "--gantt", "{target}.png"], "--gantt"),
    ("show-trace", ["show", "{plan}", "--trace", "{target}.json"], "--trace"),
    ("calibrate-o", ["calibrate", "{plan}", "--cluster", CLUSTER, "-o", "{target}.yaml"], "-o/--output"),
    ("demo-out", ["demo", "--fast", "--out", "{target}"], "--out"),
]
FOLDERS = ["/proc", "/sys"]


@pytest.mark.parametrize("folder", FOLDERS)
@pytest.mark.parametrize("argv, option", [c[1:] for c in COMMANDS], ids=[c[0] for c in COMMANDS])
def test_unwritable_system_folder_is_one_error_before_any_work(
        capsys: pytest.CaptureFixture[str], plan_path: Path, folder: str, argv: list[str], option: str) -> None:
    if not Path(folder).is_dir():
        pytest.skip(f"{folder} does not exist here")
    target = f"{folder}/hetpipe-test-x"
    argv = [a.format(plan=plan_path, target=target) for a in argv]
    line = _one_error(capsys, argv, before_any_work=True)  # not a wall-time bound: nothing printed before it
    assert line.startswith(f"error: {option} '{target}") and "not writable" in line, line


@pytest.mark.parametrize("argv, option", [c[1:] for c in COMMANDS], ids=[c[0] for c in COMMANDS])
def test_a_file_in_the_way_is_named_as_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], plan_path: Path,
                                              argv: list[str], option: str) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a folder\n")
    target = blocker / "sub" / "x"
    line = _one_error(capsys, [a.format(plan=plan_path, target=target) for a in argv])
    assert line.startswith(f"error: {option} '{target}") and f"'{blocker}' is a file, not a folder" in line, line
    assert "does not exist" not in line
    assert blocker.read_text() == "a file, not a folder\n"


@pytest.mark.parametrize("argv", [["plan", "mlp-tiny", "--cluster", CLUSTER, "-o", ""],
                                  ["show", "{plan}", "--gantt", ""], ["run", "{plan}", "--model", "mlp-tiny",
                                                                      "--steps", "1", "--report", ""],
                                  ["demo", "--fast", "--out", ""]], ids=["plan-o", "show-gantt", "run-report", "demo"])
def test_an_empty_path_is_called_empty(capsys: pytest.CaptureFixture[str], plan_path: Path, argv: list[str]) -> None:
    line = _one_error(capsys, [a.format(plan=plan_path) for a in argv])
    assert "the path is empty" in line and "is a directory" not in line, line


def test_the_api_checks_name_an_empty_path_and_a_file_in_the_way(tmp_path: Path) -> None:
    for check in (check_writable, check_folder, writable_folder):
        with pytest.raises(ConfigError, match="the path is empty"):
            check("", "--opt")
    (tmp_path / "f").write_text("x")
    for check in (check_writable, check_folder, writable_folder):
        with pytest.raises(ConfigError, match=r"is a file, not a folder"):
            check(tmp_path / "f" / "a" / "b", "--opt")
    with pytest.raises(ConfigError, match=r"'.*f' is a file, not a folder"):
        writable_folder(tmp_path / "f", "--save-weights")


def test_a_device_is_not_replaced_by_a_file() -> None:
    """``-o /dev/null`` as root would otherwise rename a regular file over the device."""
    if not Path("/dev/null").exists():
        pytest.skip("no /dev/null here")
    with pytest.raises(ConfigError, match="not a regular file"):
        check_writable("/dev/null", "-o/--output")


@pytest.mark.parametrize("folder", FOLDERS)
def test_folder_checks_probe_by_creating_a_file(tmp_path: Path, folder: str) -> None:
    if not Path(folder).is_dir():
        pytest.skip(f"{folder} does not exist here")
    with pytest.raises(ConfigError, match="not writable"):
        check_folder(folder, "--out")
    with pytest.raises(ConfigError, match="--checkpoint-dir"):
        writable_folder(folder, "--checkpoint-dir")
    check_writable(tmp_path / "a.json", "-o")
    check_folder(tmp_path, "--out")
    writable_folder(tmp_path, "--out")
    assert list(tmp_path.iterdir()) == []  # the probes leave nothing behind


@pytest.fixture
def no_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The up-front checks pass whatever the path (as `os.access` did for root on /proc)."""
    monkeypatch.setattr(checks, "check_writable", lambda path, option: None)
    monkeypatch.setattr(checks, "check_folder", lambda path, option: None)


FALLBACK = [("plan-o", ["plan", "mlp-tiny", "--cluster", CLUSTER, "--time-limit", "5", "-o", "/proc/x.json"], ""),
            ("show-gantt", ["show", "{plan}", "--gantt", "/proc/g.png"], "--gantt"),
            ("show-trace", ["show", "{plan}", "--trace", "/proc/t.json"], "--trace"),
            ("demo-out", ["demo", "--fast", "--out", "/proc/demo"], "--out")]


@pytest.mark.usefixtures("no_checks")
@pytest.mark.parametrize("argv, option", [c[1:] for c in FALLBACK], ids=[c[0] for c in FALLBACK])
def test_a_failing_final_write_is_one_error(capsys: pytest.CaptureFixture[str], plan_path: Path, argv: list[str],
                                           option: str) -> None:
    if not Path("/proc").is_dir():
        pytest.skip("/proc does not exist here")
    line = _one_error(capsys, [a.format(plan=plan_path) for a in argv])
    assert "/proc/" in line and option in line, line


def test_atomic_write_failure_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot write --trace '.*missing/t.json': .*with --trace"):
        atomic_write_text(tmp_path / "missing" / "t.json", "{}", option="--trace")
    with pytest.raises(ConfigError, match="cannot write"):
        atomic_write_text(tmp_path, "{}")  # a folder: the rename fails
    assert list(tmp_path.iterdir()) == []  # no temporary file left
