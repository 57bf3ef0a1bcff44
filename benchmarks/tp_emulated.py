"""Issue 15: a tensor-parallel plan run, emulated on CPU ranks (one per card), against one device.

The planner's own plan: gpt-demo (micro-batch 2, sequence 128) on the mini home lab with
``--tensor-parallel auto`` (its 3090 and 4090 share a node: the solver puts the blocks and the head
on them as one group at uneven shares, the embedding on the 3060), 1F1B.  ``hetpipe run
--emulate`` trains it `STEPS` steps on 3 gloo ranks from seeded weights on seeded data, `REPEATS`
times; the same weights and data train in a plain single-device PyTorch loop (SGD with momentum,
micro-batches accumulated).  Reported: the largest relative loss difference; per member of the
group and per width-1 stage, the measured F and B (emulated seconds, median per micro-batch over
the steps after the first, median over repeats) beside that rank's own prediction; the measured
iteration (median over steps after the first and repeats) beside the plan's T.  Writes
benchmarks/results/tp_emulated.md.

With ``--model hf-llama-tiny`` (or ``hf-gpt2-tiny``; ``--seq``, default 64) the same for a Hugging
Face model, whose group members run re-exported graphs (`hetpipe.runtime.tp_export`); it writes
benchmarks/results/tp_emulated_<model>.md.

Usage:
    python benchmarks/tp_emulated.py [--model hf-llama-tiny --seq 64]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from hetpipe import models  # noqa: E402
from hetpipe.cost_models.cluster import load_cluster  # noqa: E402
from hetpipe.plan.build import capture_builtin, partition_graph  # noqa: E402
from hetpipe.runtime.run import run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL, MICRO_BATCH, SEQ, GLOBAL_BATCH = "gpt-demo", 2, 128, 8
STEPS, REPEATS = 4, 3
LR, MOMENTUM = 1e-2, 0.9  # the plan's optimizer "momentum" at the runtime's default rate (runtime/rank.py)


def reference_losses(model: torch.nn.Module, batches: list, microbatches: int, name: str = MODEL) -> list[float]:
    loss = models.loss_fn(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    out = []
    for (x,), y in batches:
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            value = loss(model(xs), ys)
            (value / microbatches).backward()
            total += float(value.detach())
        opt.step()
        out.append(total / microbatches)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--seq", type=int, default=None, help=f"default {SEQ} for {MODEL}, 64 otherwise")
    args = parser.parse_args()
    name, seq = args.model, args.seq or (SEQ if args.model == MODEL else 64)
    graph = capture_builtin(name, batch=MICRO_BATCH, seq=seq, optimizer="momentum")
    plan = partition_graph(graph, load_cluster(ROOT / "examples/clusters/homelab-mini.yaml"),
                           global_batch=GLOBAL_BATCH, tensor_parallel="auto", time_limit_s=4.0)
    m = plan.training.microbatches
    torch.manual_seed(0)
    resolved = models.resolve(name, device="cpu", batch=MICRO_BATCH, seq=seq)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        x = torch.randint(0, models.input_vocab(name) or 64, (GLOBAL_BATCH, seq), generator=gen)
        batches.append(((x,), models.example_targets(name, (x,))))
    ref = reference_losses(copy.deepcopy(resolved.model), batches, m, name)
    work = Path(tempfile.mkdtemp(prefix="tp-emulated-"))
    torch.save(resolved.model.state_dict(), work / "weights.pt")
    reports = [run(plan, model=name, steps=STEPS, seq=seq, data=batches, weights=work / "weights.pt",
                   emulate=True, run_dir=work / f"run{i}") for i in range(REPEATS)]
    loss_diff = max(abs(a - b) / abs(b) for r in reports for a, b in zip(r.losses, ref))
    rows = []
    first = reports[0]
    keys = [(r.stage, r.member) for r in first.members] + [(s.stage, 0) for s in first.stages
                                                           if not plan.stages[s.stage].group_devices]
    for stage, member in keys:
        recs = [next(x for x in (r.members if plan.stages[stage].group_devices else r.stages)
                     if (x.stage, x.member) == (stage, member)) for r in reports]
        f = statistics.median(x.fwd_emulated_s for x in recs)
        b = statistics.median(x.bwd_emulated_s for x in recs)
        share = plan.stages[stage].group_shares[member] if plan.stages[stage].group_devices else 1.0
        rows.append([stage, member, recs[0].device, f"{share:.3f}", f"{1e3 * recs[0].predicted_fwd_s:.3f}",
                     f"{1e3 * f:.3f}", f"{f / recs[0].predicted_fwd_s:.2f}", f"{1e3 * recs[0].predicted_bwd_s:.3f}",
                     f"{1e3 * b:.3f}", f"{b / recs[0].predicted_bwd_s:.2f}",
                     f"{recs[0].peak_bytes / recs[0].predicted_memory_bytes:.3f}"])
    measured = statistics.median(r.measured_emulated_iteration_s for r in reports)
    header = ["stage", "member", "card", "share", "F pred (ms)", "F meas (ms)", "F ratio", "B pred (ms)",
              "B meas (ms)", "B ratio", "peak / M_s"]
    intro = __doc__.split("\n\n")[1].replace("\n", " ")
    if name != MODEL:  # the same text, this model's plan (its group members run re-exported graphs)
        intro = (f"The planner's own plan: {name} (micro-batch {MICRO_BATCH}, sequence {seq}) on the mini home lab "
                 "with ``--tensor-parallel auto``; its group members run their re-exported graphs "
                 "(`runtime/tp_export.py`).  " + intro[intro.index("``hetpipe run --emulate``"):])
        intro = intro.replace("Writes benchmarks/results/tp_emulated.md.",
                              f"Writes benchmarks/results/tp_emulated_{name.replace('-', '_')}.md.")
    body = (intro + "\n\n"
            + f"Plan: {', '.join(describe(st) for st in plan.stages)}; {m} micro-batches.  "
            + f"Largest relative loss difference over {REPEATS} runs x {STEPS} steps: {loss_diff:.2e}.  "
            + f"Iteration: measured {1e3 * measured:.2f} ms (emulated) vs the plan's T "
            + f"{1e3 * plan.predicted.iteration_s:.2f} ms ({measured / plan.predicted.iteration_s:.3f}x).\n\n"
            + markdown_table(header, rows))
    print(body)
    write_result("tp_emulated" if name == MODEL else f"tp_emulated_{name.replace('-', '_')}",
                 f"A tensor-parallel plan of {name} run emulated on CPU ranks (issue 15)" if name != MODEL
                 else "A tensor-parallel plan run emulated on CPU ranks (issue 15)", body)


def describe(st) -> str:  # noqa: ANN001
    cards = "+".join(st.group_devices) if st.group_devices else st.device
    shares = f" ({'/'.join(f'{w:.2f}' for w in st.group_shares)})" if st.group_devices else ""
    return f"stage {st.index} on {cards}{shares}, units {st.first_unit}-{st.last_unit}"


if __name__ == "__main__":
    main()
