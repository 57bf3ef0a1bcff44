"""A plan made with ``--seq 16`` and run without it: the same model name captures to another fingerprint,
and the error names the captured shapes and ``--seq`` (it once said only "re-plan it")."""

from __future__ import annotations

import pytest

from hetpipe.cli import app
from hetpipe.errors import PlanError
from hetpipe.plan.schema import Plan
from hetpipe.runtime.rank import capture_for_plan


@pytest.fixture(scope="module")
def seq16_plan(tmp_path_factory) -> Plan:
    path = tmp_path_factory.mktemp("seq") / "plan.json"
    assert app.main(["plan", "gpt-tiny", "--batch", "2", "--seq", "16", "--global-batch", "8", "--cluster",
                     "examples/clusters/homelab-mini.yaml", "-o", str(path)]) == 0
    return Plan.load(path)


def test_omitted_seq_names_the_shape_and_the_flag(seq16_plan):
    """`hetpipe run`, `hetpipe.run` and `hetpipe.Trainer` all capture through `capture_for_plan`."""
    capture_for_plan(seq16_plan, model="gpt-tiny", seq=16)  # the planned shape: accepted
    with pytest.raises(PlanError) as err:
        capture_for_plan(seq16_plan, model="gpt-tiny", seq=None)  # gpt-tiny's default seq, 64
    text = str(err.value)
    assert "inputs of shape (2, 64)" in text and "seq 64" in text and "--seq N" in text and "seq=N" in text
    assert "--batch" not in text  # run takes the plan's micro-batch: the batch is not the cause


def test_another_model_gets_no_shape_hint(seq16_plan):
    from types import SimpleNamespace as NS

    from hetpipe.plan.model_match import verify_model

    with pytest.raises(PlanError) as err:
        verify_model(seq16_plan, NS(fingerprint="ff", model_name="mlp-tiny", num_units=3, param_count=10,
                                    micro_batch_size=2))
    assert "--seq" not in str(err.value) and "re-plan it" in str(err.value)
