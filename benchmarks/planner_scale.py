"""Issue 12, item 3: no size at which the planner's answer falls off a cliff (gap <= 2% up to 1,024 cards).

Models: the built-in `gpt2-xl` (micro-batch 4, seq 1024) and `llama-7b` (micro-batch 1,
seq 4096), captured on meta, bf16-mixed with Adam.  Clusters: 16 to 1,024 cards, 8 per
node, eight kinds (node i holds kind i mod 8: A100 80GB, V100 32GB, RTX 3090, RTX 4090,
A6000, A5000, L4, RTX 4080), PCIe through the host inside a node, 25 Gbit/s and 10 us
between nodes.  Two micro-batches per card per iteration.  The CLI's default time limit, auto
(`solvers/time_budget.py`: a first solve of 10 s, and one of 60 s more only where that answer is over 2% from its
bound and its search used its time; the limit column says which), seed 0.

Columns: the solver that answered and its status, then two objectives.  **Estimate**: the
H-1F1B estimate the solvers search exactly (`solve_estimate`): its T, its proven lower bound
and the gap (T - bound) / T.  **Schedule** (issue 17, the plan's T since version 4): the same
answer priced by the replayed 1F1B schedule with each stage's optimizer step, improved by
`verify`'s local search (from it and the pace walks' placements), and `verify`'s lower bound on
the schedule optimum; each limit split as `solve` splits it (`solve.SCHEDULE_SHARE`: 60% for the
estimate's search, the rest for `verify`).  Wall: seconds of the whole `solve`, both solves where two ran (one run: the gaps,
not the time, are the claim here; `planner_speed.py` has the timing medians).

Usage:
    python benchmarks/planner_scale.py [--devices 16 64 256 1024] [--models gpt2-xl llama-7b]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from hetpipe.cost_models.cluster import Cluster, cluster_from_dict  # noqa: E402
from hetpipe.models import build  # noqa: E402
from hetpipe.partitioner.capture.capture import capture  # noqa: E402
from hetpipe.partitioner.solvers.dp import device_classes  # noqa: E402
from hetpipe.partitioner.problem import Problem  # noqa: E402
from hetpipe.partitioner.solvers.solve import SCHEDULE_SHARE, Solution, solve_estimate  # noqa: E402
from hetpipe.partitioner.solvers.time_budget import time_budget, wants_more  # noqa: E402
from hetpipe.partitioner.solvers.verify import Verified, verify  # noqa: E402
from hetpipe.plan.build import build_problem  # noqa: E402

#: Node i holds kind KINDS[i % 8] (all in hetpipe/cost_models/catalog.json).
KINDS = ("a100-80gb", "v100-32gb", "rtx3090", "rtx4090", "a6000", "a5000", "l4", "rtx4080")
PER_NODE = 8
TIME_LIMIT = "auto"  # `hetpipe plan --time-limit` default (`solvers/time_budget.py`)
#: Micro-batch size per model (the built-in defaults of `hetpipe models`).
BATCH = {"gpt2-xl": 4, "llama-7b": 1}


def eight_kind_cluster(devices: int) -> Cluster:
    """`devices` cards, 8 per node, node i of kind KINDS[i % 8], 25 Gbit/s between nodes."""
    nodes = [{"name": f"n{i}", "intra": "pcie-host", "network": {"bandwidth": "25Gbit/s", "latency": "10us"},
              "devices": [{"gpu": KINDS[i % len(KINDS)], "count": PER_NODE}]} for i in range(devices // PER_NODE)]
    return cluster_from_dict({"name": f"eight-kinds-{devices}", "nodes": nodes}, source=f"eight-kinds-{devices}")


def run_case(model_name: str, devices: int, time_limit: float | str = TIME_LIMIT) -> list[object]:
    """One row: under ``auto`` the first solve, and the second where `time_budget.wants_more` (as `solve_for_plan`:
    the faster answer, the larger bound, the walls summed)."""
    model, inputs = build(model_name, device="meta", batch=BATCH[model_name])
    graph = capture(model, inputs, name=model_name, precision="bf16-mixed")
    problem = build_problem(graph, eight_kind_cluster(devices), microbatches=2 * devices)
    budget = time_budget(time_limit)
    est, sched, wall = _solve_steps(problem, budget.first_s)
    bound_s, limit = sched.bound_s, f"{budget.first_s:g}"
    if wants_more(budget, iteration_s=sched.iteration_s, bound_s=sched.bound_s, wall_s=wall):
        est2, sched2, wall2 = _solve_steps(problem, budget.more_s)
        bound_s, wall, limit = max(bound_s, sched2.bound_s), wall + wall2, f"{limit}+{budget.more_s:g}"
        if sched2.iteration_s < sched.iteration_s:
            est, sched = est2, sched2
    bound_s = min(bound_s, sched.iteration_s)
    gap = (sched.iteration_s - bound_s) / sched.iteration_s
    return [model_name, devices, len(device_classes(problem)), len(sched.stages), est.solver, est.status,
            f"{est.iteration_s:.3f}", f"{est.bound_s:.3f}", f"{est.gap:.2%}",
            f"{sched.iteration_s:.3f}", f"{bound_s:.3f}", f"{gap:.2%}", limit, f"{wall:.1f}"]


def _solve_steps(problem: Problem, time_limit_s: float) -> tuple[Solution, Verified, float]:
    """`solve` step by step (solvers/solve.py), to keep the estimate's figures beside the schedule's:
    (the estimate's answer, `verify`'s, the wall in seconds)."""
    start = time.perf_counter()
    verify_s = SCHEDULE_SHARE * time_limit_s
    est = solve_estimate(problem, time_limit_s=time_limit_s - verify_s, seed=0)
    left_s = max(time_limit_s - (time.perf_counter() - start), 0.0)  # as `solve` since session 15: no floor
    sched = verify(problem, [est.stages, *est.alternatives], limit_s=left_s)
    return est, sched, time.perf_counter() - start


#: What earlier sessions found (kept with the table it explains).
SESSION_7 = (
    'Session 7 (issue 12, branch `regress`).  (1) The regression at the merged head (gpt2-xl on 256 cards'
    ": estimate T = 14.26 s, 46% gap) is fixed: since the offload merge the DP's classes also split on ho"
    "st figures, so the relaxation's merged kind (whose members sit behind different host links: the V100"
    "'s PCIe 3) stayed several classes, its DP outgrew the budget and `relaxed_bound` returned no bound a"
    "nd no placement (the heuristic's 50-stage answer was left).  Relaxed and merged kinds now take their"
    ' best host figures: 7.647 s (0.23%) again, with a 10, 30 or 60 s limit.  (2) Every DP pass now gives'
    ' up at its deadline (`cap_walk.DeadlineReached`), so the limit holds; `planner_scale` runs `solve_es'
    'timate` (10 s) and `verify` (2 s) one after the other, hence walls up to 14 s at 1,024 cards.  (3) S'
    'chedule bound: `verify` adds the pace bound of `solvers/schedule_bound.py` (T >= R_0 + max_s max(q_s'
    ' R_s, m W_s - R_s) + S_0, minimised over placements by the DP under caps).  Schedule gaps before -> '
    'after: gpt2-xl 32.5 -> 16.8% (16 cards), 71.5 -> 30.7% (64), 62.7 -> 62.7% (256), 62.8 -> 62.8% (1,0'
    '24); llama-7b 27.8 -> 17.1% (16; T 7.183 -> 7.111 s, a walk placement), 58.2 -> 53.6% (64), 24.4 -> '
    '2.3% (256), 23.0 -> 23.0% (1,024).  At 256 and 1,024 cards the pace bound needs the coarse relaxatio'
    "n's DP, whose pass (about 1.5 s under load) does not fit in `verify`'s share of the 10 s limit; give"
    "n 6 s it gives 7.63 s for gpt2-xl on 256 cards (gap 20%, against 63%), and on the estimate's placeme"
    'nt itself R_0 + G + S_0 = 9.55 s against the replayed 9.569 s (the round trip of the last two stages'
    ", across a node boundary, sets the pace): the remaining gap is the relaxation's (merged kinds at the"
    "ir fastest member's speed) and the search's (the estimate-optimal placement puts a slow cut where fe"
    "w micro-batches are in flight).  Issue 12 item 3's 2% is not met under the schedule objective.")
#: What session 8 changed (figures from the table above, one run each).
SESSION_8 = (
    "Session 8 (issue 12 item 3, branch `gap`).  The pace bound became the search's objective too.  (1) E"
    "ach stage's G_s is the longest of its rank's chains B(0) -> B(m - 1): q_s round trips R_s plus r_s s"
    'ingle steps of W_s, all single steps ((m - k_s) W_s + (k_s - 1) B_s), or the old work term; the DP f'
    "ilters suffixes on the first two exactly (`dp.PaceRule`: both grow with R_s and W_s), so the walk's "
    'argmin meets its cap and the walk ends on the pace optimum (brute force: tests/test_pace_walk.py).  '
    '(2) Beyond the count DP (64 cards and up) a node-run relaxation (`solvers/pace_runs.py`: kinds exact'
    ', card counts dropped, runs of consecutive stages on one node, the fastest same-node link inside a r'
    'un and the fastest cross-node link between runs) keeps the node boundaries the coarse relaxation dro'
    'pped, in about 1 s at 256-1,024 cards; its placements, realised on real nodes, start the local searc'
    "h.  (3) `solve` keeps 40% of its limit for `verify` plus whatever the estimate's search leaves, and "
    'the walks end by 70% of that.  (4) The 1F1B program is compiled from integer lists (50 stages x 2,04'
    "8 micro-batches: 1.8 s instead of 11.5 s under load), so verify's pricing no longer overruns the lim"
    "it by seconds at 1,024 cards.  (5) `solve` also hands `verify` the heuristic's and the relaxation's "
    'placements (`Solution.alternatives`): an estimate-worse placement can be schedule-better (gpt2-xl on'
    " 1,024 cards: the heuristic's 50 stages replay in 29.47 s, the estimate-optimal placement's walk-imp"
    'roved best in 31.6 s).  Schedule gaps before -> after: gpt2-xl 16.8 -> 3.7% (16 cards), 30.7 -> 26.3'
    '% (64), 62.7 -> 5.5% (256), 62.8 -> 0.3% (1,024); llama-7b 17.1 -> 1.8%, 53.6 -> 2.8%, 2.3 -> 1.6%, '
    "23.0 -> 5.3% (walls up to 10.6 s).  The estimate's search now has 6 of the 10 s: its gpt2-xl gap at "
    "1,024 cards is 0.56% (0.28% with 10 s), and its answer there is the heuristic's.  Left: (a) the pace"
    ' leaves out the zigzags through windows of neighbouring ranks (`schedule_bound` docstring): on gpt2-'
    "xl at 256 cards the node-run walk's best placement replays in 8.19 s against its pace 7.66 s (stages"
    ' of 6.6-13.3 ms, cuts of 1.3 ms: four neighbours take 15.3 ms per micro-batch against the largest W '
    "of 14.2 ms); the next stage's length in the node-run DP's state (pairs only) raised the bound to 7.6"
    '8 s in ten times the time and was left out; (b) at 64 cards the relaxations drop either the card cou'
    'nts (node runs: 2.27 s for gpt2-xl) or the slow kinds (merged: 2.65 s) while the answer (3.60 s) run'
    's on every kind: a Lagrangian price on the counts inside the node-run DP, as `lagrange.py` does for '
    "the estimate, is the next step.  Issue 12 item 3's 2% is met for gpt2-xl on 1,024 cards and llama-7b"
    ' on 16 and 256 cards only.')
#: What session 9 changed (figures: the table above and one-off runs, as stated).
SESSION_9 = (
    "Session 9 (issue 12 item 3, branch `gap`).  Diagnosis: the answers' own replays were 1.8-11% above "
    "their pace R_0 + G + S_0 because 1F1B does not hide a cut between two neighbours (rank s: B(i), "
    "F(i + k_s), on s + 1 F then B(i + 2), back to s: two micro-batches per W_s + W_{s+1} + 2 C_s; "
    "llama-7b on 64 cards: a 4090 stage of 87 ms and an A6000 one of 95 ms across a 10.7 ms cut take "
    "101.5 ms per micro-batch against the largest W of 94.5 ms; gpt2-xl on 64 cards 22.7 ms against "
    "18.7 ms).  (1) The pair chain (x pairs, y single steps, one round trip: `schedule_bound.pair_chain`) "
    "joins G_s; the count DP and the node-run DP filter on it with, beside each state's least R, the least "
    "x W_front + R of its suffixes (`solvers/pace_rule.py`; a relaxation: the bound stays valid, checked "
    "per placement against the replay and against enumeration).  The answers' pace is now within 0.1% of "
    "their replay at 64 cards (gpt2-xl 3.602 against 3.604 s, llama-7b 15.31 against 15.33 s).  (2) The "
    "walks stop once their bound is within 0.5% of the candidates' own pace (`verify.ENOUGH_GAP`), probe "
    "1% under the first cap (`PROBE`), and where card counts bind (a kind has fewer cards than half the "
    "stages: 64 cards) the count relaxation walks first with 65% of the time (`verify.counts_bind`).  "
    "(3) The walks keep eight distinct placements and `verify` ranks them by their pace on real cards (the "
    "node-run relaxation's best at 256 cards put 33 stages on 32 A100s and realised at 18.5 s).  Given "
    "40 s the merged walk proves 15.26 s for llama-7b on 64 cards (0.5%).  Left: gpt2-xl on 64 cards "
    "(the bound needs the card counts priced inside the node-run DP; the answer 3.60 s is a local optimum "
    "of `verify`'s moves, a walk placement replays 3.576 s) and at 256 cards (windows of three or more "
    "ranks).  Schedule gaps before -> after (the table, load 11-16): gpt2-xl 3.7 -> 1.0% (16 cards), "
    "0.3 -> 0.4% (1,024); llama-7b 1.8 -> 1.6%, 1.6 -> 0.4% (256), 5.3 -> 0.3% (1,024).  At load ~9 (one "
    "run each, same code): llama-7b on 64 cards 0.56% (bound 15.249 s), gpt2-xl 26.4% (64) and 17.3% (256: "
    "the node-run walk's pair-aware placements put 33 stages on 32 A100s and realise slower, 9.28 s against "
    "session 8's 8.11 s).  Under the table's load the walks at 64 and 256 cards (gpt2-xl) finish no pass in "
    "the limit and the bound falls back to the fill: these gaps depend on the load.  A second run right after "
    "(load 9.2 / 9.4 / 12.8) gave the same figures but for llama-7b on 1,024 cards (bound 91.0 s, 23%: its "
    "node-run walk finished no pass) and on 64 (6.4%), gpt2-xl on 64 cards 26.7%: at 256-1,024 cards a "
    "walk's first pass (its tables included) takes most of `verify`'s 2-3 s under such load."
    "  The table above is the lead's rerun of this code at load 3.9 / 3.7 / 7.1 (main before this branch, same hour, load 3.1: 3.69 / 26.34 / 5.50 / 0.22% and 1.79 / 2.73 / 1.60 / 5.34%): gpt2-xl 1.00 / 25.21 / 7.48 / 0.40%, llama-7b 1.59 / 0.56 / 0.40 / 0.25% at 16 / 64 / 256 / 1,024 cards, so <= 2% in 6 of 8; the answers are as good or better everywhere but gpt2-xl on 256 cards, 8.296 s against 8.110 s (+2.3%: the local search there gets little time).")

#: What session 10 changed (figures: the table above, main's same-hour run and one-off runs, as stated).
SESSION_10 = (
    "Session 10 (issue 12 item 3, branch `gap`).  (1) gpt2-xl on 64 cards, which side is weak: a local "
    "search without move or time limits from the 10 s answer (3.5505 s) stops at a local optimum of "
    "3.5482 s after 7.5 s (-0.06%), and a prototype of the Lagrangian on per-kind card counts inside the "
    "node-run DP (a price per kind on every stage, Kelley's cutting planes as `lagrange.py`, the pace "
    "filters on each state's least R so the bound stays valid) raised the node-run bound from 2.28 s to "
    "2.85-2.94 s only, after 35-210 s (about 0.1-0.2 s per priced pass at load ~10, up to 12 price steps "
    "per cap; its argmins keep a ninth stage on the 8 A100s: a duality gap), still 17-20% below the answer "
    "and far past the limit: not merged.  No placement below 3.548 s was found; whether the optimum is "
    "lower is open.  (2) gpt2-xl on 256 cards: the node-run walk's pair filter is a relaxation whose "
    "argmins break it, so its placements realise at 9.28 s; the same walk without the pair filter gives "
    "placements that replay in 8.19 s (session 8's) at a bound 0.15% lower (7.662 against 7.674 s).  "
    "`verify` now runs both on the node runs (`verify._runs_walk`: the pair-aware one with half the time, "
    "for the bound: llama-7b on 1,024 cards 118.08 s against 111.79 s without it), so the answer there "
    "is 8.11-8.32 s again.  (3) Fewer passes per walk: below the hints' G the walk probed in 1% steps "
    "(22 passes, 8.4 s at load 10, to reach the node-run optimum 20% below); now one probe, then "
    "bisection (a cap nothing meets costs ~1 ms in the node-run DP; the count DP also stops at its first "
    "empty level): the same 7.674 s in 15 passes, 1.9 s.  The band above the hints is closed by one cap at "
    "enough - R_0(inf) instead of doublings (llama-7b on 64 cards: the 0.5% target in 4 passes, was 12), "
    "and the relaxations' walks stop on a band narrower than 1e-4 of the bound.  (4) Fixed costs before "
    "any pass at 1,024 cards (load ~14): the least-bottleneck copy of the problem (p^2 link tuples) and "
    "`device_classes` took 1.3 s of verify's 2.5 s before the DP refused; a count over kinds now refuses "
    "first (`dp.check_kinds_fit`, 0.02 s), and the node-run DP's tables use one card per kind (1.6 -> "
    "0.9 s).  The table above ran at load 14-16, with main (before this branch) in the same hour at the "
    "same load: gpt2-xl 1.00 / 61.90 / 59.73 / 0.56% and llama-7b 1.59 / 6.37 / 0.40 / 0.25% against this "
    "branch's 1.00 / 31.51 / 7.97 / 0.50% and 1.59 / 6.37 / 0.46 / 0.25% at 16 / 64 / 256 / 1,024 cards "
    "(gpt2-xl on 64 cards: bound 2.47 s against main's 1.37 s, both short of the 2.65 s of load 4; single runs: "
    "an earlier run of this branch at load ~15 gave llama-7b on 1,024 cards 22.95%, no walk pass).  Left: gpt2-xl on "
    "64 cards (the bound, see (1)); gpt2-xl on 256 cards 5-8% (the answer's own pace is 7.885 s against "
    "its replay 8.19 s: windows of three or more ranks; the node-run bound 7.67 s); and the load: under "
    "load ~15 the estimate's search overruns its 6 s (7.5 s at 1,024 cards), `verify` gets little more than its floor "
    "(a quarter of its 4 s share), and the count relaxation's passes at 64 cards take 1-1.5 s each (llama-7b "
    "6.4% at load 16; 0.56% at load 4 in session 9's table).")


#: What session 11 found and changed (figures: one-off runs and the side-by-side table run, loads as stated).
SESSION_11 = (
    'Session 11 (issue 12 item 3, branch `gap`).  Which side is weak, measured: (1) the pace leaves out '
    "1F1B's window chains (rank s, B(i), F(i + k_s) down ranks s..s + w - 1, B(i + w) back up: w micro-"
    "batches per the window's W and 2 C; the pair is w = 2, the round trip w = k_s; "
    '`schedule_bound.window_pace`, checked against the replay on random pipelines of up to 9 stages); '
    "with them the pace of gpt2-xl's placements is within 0.2% of their replay (256 cards: the answer "
    '8.189 s against 8.192 s, 7.885 s without windows; 64 cards: 3.443-3.462 s against 3.447-3.468 s, '
    '3.337-3.363 s without).  (2) An annealing on that pace (150 s, load ~10) finds placements that '
    'replay in 3.447 s at 64 cards and 7.964 s at 256, 2.8% under the answers (3.548 s, 8.11-8.19 s): the'
    " optimum is at most that, so at 64 cards 23 of the 25 points of gap are the bound's.  And the bound "
    'cannot close them without the windows: a placement found there paces 3.337 s without windows, so no '
    "bound of the pace's form (the DPs keep pairs and round trips only) certifies better than 3.2% "
    'against 3.447 s; at 256 cards the bound 7.675 s is R_0 plus 511 round trips of the head alone on an '
    "A100 (14.16 ms), which a placement meets only if every window's W and 2 C average at most 14.16 ms, "
    'while two neighbouring two-block A100 stages take 14.6 ms.  (3) In the product: `verify` anneals on '
    'the windowed pace (`solvers/pace_search.py`: cut, swap-anywhere, move, split and merge moves priced '
    'from prefix sums, a new best checked to fit; 75% of the time the walks leave, which now end by 60% '
    "of verify's time instead of 70%; skipped where the bound is within 0.5% of the answer) and ranks the"
    " walks' placements by the windowed pace.  `verify` alone on the answers, 4 s: at load 8.5-10 (three "
    'runs; main 3.604 s and 8.192 s), 64 cards 3.604 -> 3.511-3.590 s and 256 cards 8.192 -> 8.110-8.118 '
    "s (the annealing's gain grows with the 0.5-1.1 s it gets); at load 17-22 (two runs each, main the "
    "same hour) 64 cards 3.604 s both, 256 cards 8.118 / 8.192 s against main's 8.192 / 8.192 s.  The "
    'whole table at load 15-22, this branch and main run side by side: the same T and bounds in all 8 '
    'rows (gpt2-xl 1.00 / 71.5 / 74.9 / 53.2%, llama-7b 1.59 / 58.2 / 1.06 / 22.95% at 16 / 64 / 256 / '
    "1,024 cards: at that load the estimate's search takes the whole limit, walls 10-28 s in both, and "
    '`verify` runs on its floor), so the table above (load ~2) stands.  Not done: the counting bound of '
    'the brief (card counts exact, order dropped) is not built; the 2% at 64 cards needs window chains '
    "inside the DPs' filters (the bound), not only a better search.  The table above is the lead's rerun of "
    "the merged head at load 1.2 (23:03 UTC): gpt2-xl 3.550 s (25.21%) at 64 cards and 8.110 s (5.37%) at 256, "
    "the figures before this branch: inside the full 10 s solve the annealing found nothing better there.")

#: What session 14 changed (figures from `verify` run on the saved problems with CPU seconds for wall).
SESSION_14 = (
    "Session 14 (issue 12 item 3, branch `gap`).  The node-run walk's argmin at 256 cards (gpt2-xl) puts 33 "
    "stages on the 32 A100s: `solvers/pace_prices.py` prices the overused kinds' stages on the walk's weakest "
    "bands (a Lagrangian on the card counts, cutting planes on the price; `benchmarks/results/pace_prices.md`), "
    "where counts do not bind: bound 7.675 -> 7.681 s, gap 2.02 -> 1.94% at T 7.833 s; the other rows unchanged "
    "(each row's `verify` on the estimate's candidates with 10 s less the estimate's CPU seconds, CPU seconds "
    "for wall, this branch and main side by side, load 7-11).  Left: windows of three ranks at the A100 node "
    "boundaries (the bound's pipelines hold a block more per A100 node than any real placement) and gpt2-xl on "
    "64 cards (8.66%: the count relaxation's 3.07 s; pricing the node runs there gives 2.51 s).")

#: What session 15 found (walks to their end, CPU seconds; benchmarks/results/pace_windows.md).
SESSION_18 = (
    "Session 18 (issue 12 item 3).  The default limit is now `auto` (`solvers/time_budget.py`): the one row over 2% "
    "at 10 s, gpt2-xl on 64 cards (5.58%: one annealing pass fits and the finer kind cut's walk, forecast 11.9 s, "
    "does not), takes a second solve of 60 s, where the annealing's passes reach 3.253 s and the walk proves "
    "3.190 s (benchmarks/results/finer_walk.md); the other seven rows end within 2% in the first 10 s and take no "
    "second solve.  `hetpipe plan` with a number still gets that number as a hard deadline "
    "(results/planner_scale_60s.md: every row within 2% at 60 s).")


SESSION_15 = (
    "Session 15 (issue 12 item 3, branch `bound64`).  Window chains of three or more ranks in the count DP's "
    "filters (`pace_rule.WindowCompanions`, a relaxation like the pair filter; `tests/test_pace_windows.py`), "
    "raised into the plain walk's staircase in the time it leaves (`solvers/pace_windows.py`).  gpt2-xl on 64 "
    "cards, the default count relaxation: 3.070 s (pairs) -> 3.110 s (three ranks) -> 3.126 s (four), 8.5-15 "
    "CPU s against 5; its argmin paces 3.17 s with every window, so the 3.27 s a 2% gap needs is out of this "
    "relaxation's reach.  Finer cuts of the kinds: A100 / 4090 / A6000 / V100 / the rest (5.3e7 DP rows) 3.171 s "
    "with pairs in 245 s, 3.211 s with windows of three in 399 s, 3.227 s with windows of four in 833 s; A100 / 4090 A6000 / V100 / the rest with windows "
    "of four 3.198 s in 130 s.  The fine cut's plain argmin on real cards replays in 3.308 s (the best known was "
    "3.335 s), `verify` from it in 3.296 s.  Against the best known since (3.253 s, ans64) 3.211 s and 3.198 s "
    "are 1.3% and 1.7% gaps, in minutes; the 10 s bound 3.070 s is 5.6% below it.  In the 10 s "
    "solve the plain walk does not finish at 64 cards: the rows are unchanged (64 cards 3.04-3.07 s over four "
    "runs of each, main the same; llama-7b 64 and gpt2-xl 256 cards identical).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--models", nargs="+", default=["gpt2-xl", "llama-7b"])
    ap.add_argument("--time-limit", default=TIME_LIMIT,
                    help="the solve's limit (s) or auto; other than the default, the table goes to planner_scale_<N>s.md")
    args = ap.parse_args(argv)
    header = ["model", "devices", "classes", "stages", "solver", "status", "estimate T (s)", "estimate bound (s)",
              "estimate gap", "schedule T (s)", "schedule bound (s)", "schedule gap", "limit (s)", "wall (s)"]
    rows = []
    for model_name in args.models:
        for devices in args.devices:
            rows.append(run_case(model_name, devices, args.time_limit))
            print(" | ".join(map(str, rows[-1])), flush=True)
    table = markdown_table(header, rows)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    if args.time_limit != TIME_LIMIT:
        return _write_limit(float(args.time_limit), table, load)
    body = (f"{__doc__.split('Usage:')[0].strip()}\n\nLoad average (1/5/15 min) when the table was written: "
            f"{load} (the machine's 2 cores are shared; wall times grow with it, and since session 9 the gaps at 64-1,024 cards too: see below).\n\n{table}\n\n"
            "Before session 5's fix (llama-7b): 64 cards `cpsat` FEASIBLE T = 17.04 s, "
            "bound 7.82 s; 256 cards `cpsat`/heuristic T = 46.33 s, bound 25.06 s (the relaxation was too "
            "large for its DP and only the trivial bound was left).  Since then the node-free relaxation merges its "
            "slowest kinds until its DP fits (`relax.aggregate_kinds`) and the DP counts only reachable "
            "device-count vectors (`solvers/counts.py`).\n\n"
            "After the memory-model-2 and recomputation merges gpt2-xl regressed (64 cards 21.2% gap; 256 and "
            "1,024 cards 1.06% in 22 s and 0.28% in 92 s, past the 10 s limit).  Causes: (1) the memory model's "
            "moments (`schedule/held.py`) rebuilt every rank's 1F1B list at every pipeline length, with a "
            "quadratic receive scan (thousands of micro-batches at 1,024 cards), and O(n^2) Python loops over "
            "card pairs ran outside any time check; the 64-card heuristic alone took 7.8 s of the 10, so CP-SAT, "
            "which used to prove that optimum, no longer ran; (2) the bound itself was always weak there: the "
            "merged kinds (fastest member's times) let 48 cards run at the speed of the best of six kinds, "
            "while gpt2-xl puts one block per card and the slowest kind used sets the bottleneck (bound "
            "2.48 s against T = 3.14 s; `recompute` is `none` here, so the merged kinds' unlimited memory "
            "under `auto` was not the cause).  Fixes: the moments in linear time, replayed over one rank "
            "and a bounded number of 1F1B repetitions (`steady_microbatches`), numpy link tables, and a "
            "Lagrangian bound that keeps every kind exact and prices the card counts "
            "(`solvers/lagrange.py`).\n\n"
            "Since issue 17 the plan's T is the schedule's.  The search stays exact for the estimate (gaps "
            "above), but `verify`'s lower bound on the schedule optimum (the bottleneck stage's m micro-batches "
            "and a fill term) is far from the answer at these sizes: the schedule gap is what a plan made here "
            "records.\n\n" + SESSION_7 + "\n\n" + SESSION_8 + "\n\n" + SESSION_9 + "\n\n" + SESSION_10 + "\n\n" + SESSION_11 + "\n\n" + SESSION_14 + "\n\n" + SESSION_15 + "\n\n" + SESSION_18 + "\n")
    path = write_result("planner_scale", "Planner at scale: gap up to 1,024 cards (issue 12)", body)
    print(table)
    print(f"wrote {path}")
    return 0


def _write_limit(limit_s: float, table: str, load: str) -> int:
    """The same rows at a stated `--time-limit` other than the default (issue 12 item 3 at a longer limit)."""
    body = (f"The rows of planner_scale.md (same models, clusters and columns; see it for what they mean) with "
            f"`--time-limit {limit_s:g}` (a hard deadline) instead of the default auto (10 s, and 60 s more where the "
            "first answer is over 2% from its bound and used its time: `solvers/time_budget.py`).  A solve ends "
            "before its limit once its walks and annealing have nothing left to do (wall column).\n\n"
            f"Load average (1/5/15 min) when the table was written: {load}.\n\n{table}\n")
    path = write_result(f"planner_scale_{limit_s:g}s", f"Planner at scale with --time-limit {limit_s:g} (issue 12)", body)
    print(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
