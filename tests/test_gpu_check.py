"""The prepared GPU script (issue #4, acceptance 6) stays runnable: its CPU dry run passes every check."""

from __future__ import annotations

from benchmarks import gpu_check


def test_gpu_check_dry_run_on_cpu_checks_stages_memory_and_timing(tmp_path, capsys):
    out = tmp_path / "gpu_check.md"
    rc = gpu_check.main(["--device", "cpu", "--model", "gpt-tiny", "--batch", "2", "--seq", "16", "--output", str(out)])
    assert rc == 0
    text = out.read_text()
    assert "| stage modules (3 stages) vs whole model | 52 parameters" in text
    # the executor's held bytes equal the cost model's stage memory exactly (1F1B, one micro-batch in flight)
    assert "held / predicted) | 3.9 MiB (1.000) |" in text, text
    # memory model 5's M_s (the loss's and the optimizer step's transients in) against the live storages the CPU
    # step holds at its peak: within 5%
    row = next(line for line in text.splitlines() if line.startswith("| allocator peak / predicted M_s (memory model 5)"))
    assert 0.95 <= float(row.rsplit("(", 1)[1].split(")")[0]) <= 1.05, row
    # one row per stage: measured F and B beside the cost model's, 6 units split 2 / 2 / 2
    assert [line.split(" | ")[1] for line in text.splitlines() if line[:4] in ("| 0 ", "| 1 ", "| 2 ")] == ["2"] * 3


def test_gpu_check_without_cuda_says_so_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("error: no CUDA device here")
