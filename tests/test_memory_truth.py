"""Memory truth: each stage's measured peak held bytes (the run report, the executor's ledger) never
exceeds the plan's M_s, and is within 5% of it for language models (GPT with a tied head, a bigger GPT).

Also, in one process: M_s counts what the runtime holds beyond saved activations -- every
in-flight micro-batch's received input and output, the receive buffers posted ahead, an unreleased
send, and the first stage's warm-up sends -- and the ledger counts activation sends, which it did not.

Known and left as is (asserted, so a change shows): a model whose units save the tensors that cross
their boundaries (U-Net skips: a conv output saved by the next ReLU and the next unit's conv) is
over-predicted, because the capture costs each unit on its own and counts such a storage in every
unit that saves it, while a stage holds it once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetpipe.cost_models.stage_memory import RECV_PREFETCH, pipeline_stage_bytes
from hetpipe.models import build, training_loss
from hetpipe.partitioner.capture.capture import capture
from hetpipe.partitioner.problem import Problem, Stage, DeviceSlot, evaluate
from tests.runtime_plans import plan_for
from tests.synthetic import synthetic_cluster

MICROBATCHES = 4
TOLERANCE = 0.05  # the acceptance: within 5%, never above


def test_stage_memory_counts_inflight_cuts_receive_buffers_and_first_stage_sends():
    prob = Problem(fwd_s={"a": (1.0,) * 3}, bwd_s={"a": (1.0,) * 3}, state_bytes=(1000, 1000, 1000),
                   activation_bytes=(100, 100, 100), boundary_bytes=(10, 20, 0),
                   devices=tuple(DeviceSlot(f"d{i}", "a", "n", 10**6) for i in range(3)),
                   bandwidth_bytes_s=((1.0,) * 3,) * 3, latency_s=((0.0,) * 3,) * 3, microbatches=4)
    ev = evaluate(prob, (Stage(0, 0, 0), Stage(1, 1, 1), Stage(2, 2, 2)))
    d = RECV_PREFETCH + 1
    assert [s.memory_bytes for s in ev.stages] == [
        1000 + 3 * (100 + 10) + d * 10 + 2 * 10,  # first: 3 in flight, its 2 extra warm-up sends
        1000 + 2 * (100 + 10 + 20) + d * 20,      # middle: in and out per micro-batch, the larger cut buffered
        1000 + 1 * (100 + 20) + d * 20,           # last: its input, no output
    ]
    assert ev.stages[1].memory_bytes == pipeline_stage_bytes(state_bytes=1000, activation_bytes=100, in_bytes=10,
                                                             out_bytes=20, inflight=2, first=False)


def _plan(model: str, batch: int, seq: int | None, folder: Path) -> Path:
    meta, inputs = build(model, device="meta", batch=batch, seq=seq)
    fn, targets = training_loss(model, inputs)  # as `hetpipe plan` does: the loss's saved tensors counted
    graph = capture(meta, inputs, name=model, loss_fn=fn, targets=targets)
    n = graph.num_units
    stages = (Stage(0, 0, n // 3 - 1), Stage(1, n // 3, 2 * n // 3 - 1), Stage(2, 2 * n // 3, n - 1))
    path = folder / f"{model}.json"
    plan_for(graph, synthetic_cluster(), stages, microbatches=MICROBATCHES).save(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("model, batch, seq, lowest", [
    ("gpt-tiny", 2, 16, 1 - TOLERANCE),    # GPT, tied embedding / head
    ("gpt-demo", 2, 32, 1 - TOLERANCE),    # the demo GPT
    ("unet-tiny", 4, None, 0.70),          # skip connections: over-predicted (module docstring)
    # HF Llama (rotary tables, GQA): the middle stage within 5%; the embedding-only first stage (150 kB,
    # 40% of it communication buffers) 0.84: the formula keeps the warm-up sends and the gradients at
    # once, while the runtime frees gradients between steps (zero_grad(set_to_none=True)).
    ("hf-llama-tiny", 2, 32, 0.80),
])
def test_measured_peak_is_never_above_the_plan_and_close_for_lms(tmp_path, model, batch, seq, lowest):
    from hetpipe.plan.schema import Plan
    from hetpipe.runtime.run import run

    path = _plan(model, batch, seq, tmp_path)
    report = run(path, model=model, steps=2, seq=seq, timeout_s=60.0)
    plan = Plan.load(path)
    for st, planned in zip(report.stages, plan.stages):
        ratio = st.peak_bytes / planned.memory_bytes
        assert st.predicted_memory_bytes == planned.memory_bytes
        assert ratio <= 1.0, (st.stage, st.peak_bytes, planned.memory_bytes, dict(st.peak_breakdown))
        assert ratio >= lowest, (st.stage, ratio, dict(st.peak_breakdown))
