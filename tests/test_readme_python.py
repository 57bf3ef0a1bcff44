"""The README's Python example runs as written and returns the plan `hetpipe plan` writes for the same inputs.

A new-user review found the example without the model's loss: its last stage lacked the 2.3 GiB GPT-2's
cross-entropy keeps for backward, while the README said `partition` gives the CLI's plan.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hetpipe.cli.app import main

ROOT = Path(__file__).resolve().parents[1]


def _readme_python_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Python\n"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_readme_python_example_gives_the_cli_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = str(ROOT / "examples/clusters/homelab.yaml")
    code = _readme_python_example().replace("examples/clusters/homelab.yaml", cluster)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md (## Python)", "exec"), {})  # writes plan.json in the working folder
    assert main(["plan", "gpt2-small", "--cluster", cluster, "--batch", "4", "--seq", "1024", "--global-batch", "32",
                 "-o", str(tmp_path / "cli.json")]) == 0
    api, cli = (json.loads((tmp_path / f).read_text()) for f in ("plan.json", "cli.json"))
    assert api["model"]["name"] == cli["model"]["name"] == "gpt2-small"
    keys = ("device", "first_unit", "last_unit", "memory_bytes")
    assert [{k: s[k] for k in keys} for s in api["stages"]] == [{k: s[k] for k in keys} for s in cli["stages"]]
    assert api["predicted"]["iteration_s"] == pytest.approx(cli["predicted"]["iteration_s"], rel=1e-9)
