"""Issue 17 item 5: the Gantt has a headline and no near-empty rows; the demo's trace holds both timelines."""

from __future__ import annotations

from hetpipe.cli.timeline import LANE_MIN_SHARE, gantt_figure
from hetpipe.schedule.builders import one_f_one_b
from hetpipe.schedule.simulate import SimCosts, simulate


def _labels(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_yticklabels()]


def test_nearly_empty_link_rows_are_left_out_and_named_and_the_figure_has_a_headline() -> None:
    busy = simulate(one_f_one_b(2, 4), SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.5,)))
    quiet = simulate(one_f_one_b(2, 4), SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(1e-6,)))
    assert 8 * 1e-6 < LANE_MIN_SHARE * quiet.iteration_s  # both link rows are nearly empty
    fig = gantt_figure([("busy", busy)], labels=["a", "b"], suptitle="gpt on a + b: 1.5x")
    assert _labels(fig) == ["0: a", "1: b", "link 0->1", "link 1->0"] and fig._suptitle.get_text() == "gpt on a + b: 1.5x"
    fig = gantt_figure([("quiet", quiet)], labels=["a", "b"])
    assert _labels(fig) == ["0: a", "1: b"]
    assert "link 0->1" in fig.axes[0].get_title() and "not drawn" in fig.axes[0].get_title()


def test_demo_headline_names_model_cards_and_both_speedups() -> None:
    from hetpipe.cli.demo import gantt_suptitle
    from hetpipe.models import build
    from hetpipe.plan.build import partition

    model, inputs = build("mlp-tiny", device="meta", batch=2)
    plan = partition(model, "examples/clusters/homelab.yaml", example_inputs=inputs, global_batch=8)
    text = gantt_suptitle(plan)
    assert text.startswith(f"{plan.model.name} on ") and "T = " in text
    assert "best hand-tuned baseline" in text or "no baseline fits" in text
