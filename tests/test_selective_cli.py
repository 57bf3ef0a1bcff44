"""`hetpipe plan --recompute auto` offers the selective recompute level (issue 14); `check` and `show` read it.

gpt-tiny on two 7 MB cards (1 MB reserved): the exact DP runs the level on its first stage (with a one-unit
prefix on top), so the plan is version 7 (8 with the loss's transient table); `check` re-derives it from the file, `check --model` from a fresh
node capture (and the cluster's seconds); `show` prints what it frees and costs; `--recompute none` never
offers it.
"""

from __future__ import annotations

import json

import yaml

from hetpipe.cli.app import main
from hetpipe.plan.schema import Plan


def tight_cluster(path, mb: float):
    def dev(name: str) -> dict:
        return {"name": name, "memory": f"{mb}MB", "reserve": "1MB", "tensor_tflops": 0.071, "fp32_tflops": 0.03558,
                "memory_bandwidth": "936MB/s", "source": "tests/test_selective_cli.py: a tight card"}
    doc = {"name": "tight", "nodes": [{"name": "desk", "intra": "pcie-host",
                                       "network": {"bandwidth": "1Gbit/s", "latency": "0.2ms"},
                                       "devices": [dev("a"), dev("b")]}]}
    path.write_text(yaml.safe_dump(doc))
    return path


def test_plan_check_and_show_a_selective_plan(tmp_path, capsys):
    cluster = tight_cluster(tmp_path / "tight.yaml", 7)  # 7 MB: memory model 4 adds the loss's 2 x logits (1 MiB)
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--cluster", str(cluster), "--solver", "dp", "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.version == 9 and plan.selective is not None  # 8: the loss's transient table; 9: the step's
    assert [st.selective for st in plan.stages] == [True, False]
    shown = capsys.readouterr().out
    assert "selective -" in shown  # the levers column: bytes freed, seconds paid
    assert main(["check", str(out)]) == 0
    assert main(["check", str(out), "--model", "gpt-tiny", "--cluster", str(cluster)]) == 0
    capsys.readouterr()
    doc = json.loads(out.read_text())
    doc["selective"]["units"][0]["nodes"] = doc["selective"]["units"][0]["nodes"][:1]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    assert main(["check", str(bad)]) == 0  # the file alone cannot tell which nodes the model drops
    assert main(["check", str(bad), "--model", "gpt-tiny"]) == 2  # a PlanError, as for edited unit tables
    assert "the model's level drops" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    doc["stages"][0]["selective"] = False
    bad.write_text(json.dumps(doc))
    assert main(["check", str(bad)]) == 1
    assert "stage 0: selective is False, but recompute auto chooses True" in capsys.readouterr().out
    roomy, none = tight_cluster(tmp_path / "roomy.yaml", 8), tmp_path / "none.json"  # where `none` fits
    assert main(["plan", "gpt-tiny", "--cluster", str(roomy), "--solver", "dp", "--recompute", "none",
                 "-o", str(none)]) == 0
    assert Plan.load(none).selective is None and "selective" not in json.loads(none.read_text())  # no v7 field
