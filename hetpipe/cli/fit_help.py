"""``hetpipe plan`` when nothing fits: the error line grows the flags that would make it fit.

Example:
    $ hetpipe plan gpt2-xl --cluster examples/clusters/homelab.yaml
    error: no plan fits in memory: ... These settings fit: --batch 2 (fullest stage 7.60 GiB of 10.00 GiB on shelf:0), ...
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from hetpipe.cost_models.devices import Cluster
from hetpipe.errors import InfeasibleError


def _current(args: argparse.Namespace, graph: Any) -> tuple[Any, Any]:
    """(the `Settings` the graph was captured with, the built-in model's spec or None)."""
    from hetpipe import models
    from hetpipe.plan.fit_hints import Settings

    spec = next((s for s in models.list_models() if s.name == args.model), None)
    seq = args.seq if args.seq is not None else (spec.default_seq if spec else None)
    return Settings(batch=graph.micro_batch_size, seq=seq, precision=args.precision, optimizer=args.optimizer,
                    recompute=getattr(args, "recompute", "auto"), offload=getattr(args, "offload", "never")), spec


def with_fit_hints(err: InfeasibleError, args: argparse.Namespace, graph: Any, cluster: Cluster,
                   capture_args: Callable[[argparse.Namespace], Any]) -> InfeasibleError:
    """``err`` plus which of ``--batch/--precision/--optimizer/--seq`` would fit, each with its fullest stage."""
    from hetpipe.plan.build import build_problem, microbatches_for
    from hetpipe.plan.fit_hints import alternatives, fit_hint, fit_options
    from hetpipe.partitioner.solvers.infeasible import least_memory_fit

    current, spec = _current(args, graph)

    def capture(s: Any) -> Any:
        changed = {"batch": s.batch if spec else args.batch, "seq": s.seq if spec else args.seq,
                   "precision": s.precision, "optimizer": s.optimizer, "recompute": s.recompute}
        return capture_args(argparse.Namespace(**{**vars(args), **changed}))

    options = fit_options(alternatives(current, builtin=spec is not None, lm=spec is not None and spec.task == "lm"),
                          capture=capture, cluster=cluster, global_batch=args.global_batch)
    _, m = microbatches_for(graph, args.global_batch, len(cluster.devices))
    hint = fit_hint(options, current=least_memory_fit(build_problem(graph, cluster, microbatches=m,
                                                                    recompute=current.recompute,
                                                                    offload=current.offload)))
    return InfeasibleError(f"{str(err).rstrip('.')}. {hint}" if hint else str(err))
