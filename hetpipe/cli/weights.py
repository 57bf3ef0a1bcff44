"""``hetpipe init-weights MODEL -o DIR``: the initial weights of a run, written to a folder.

Example:
    $ hetpipe init-weights gpt-demo -o init --seed 0            # what `hetpipe run --seed 0` starts from
    $ hetpipe init-weights gpt-demo -o init --init model       # the model's own init, torch.manual_seed(0)
    $ hetpipe run plan.json --model gpt-demo --steps 10 --weights init
"""

from __future__ import annotations

import argparse
from typing import Any

from hetpipe.cli.checks import path_arg


def add_init_weights_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``hetpipe init-weights`` to the CLI's subparsers."""
    p = subparsers.add_parser("init-weights", help="write a model's initial weights (seeded or its own init) to a "
                                                   "safetensors folder usable with `hetpipe run --weights`")
    p.add_argument("model", help="built-in name or package.module:factory")
    # dest out_dir: a folder, not a file (the CLI's generic --output check wants a file)
    p.add_argument("-o", "--output", dest="out_dir", type=path_arg, required=True,
                   help="folder to write model.safetensors into (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="the seed (as `hetpipe run --seed`; default 0)")
    p.add_argument("--init", choices=("seeded", "model"), default="seeded",
                   help="seeded: what `hetpipe run` uses without --weights (default); model: the model's own "
                        "initialisation after torch.manual_seed(seed) (builds the whole model on the CPU once)")
    p.add_argument("--seq", type=int, default=None, help="sequence length of a built-in LM's example (default: its own)")
    return p


def cmd_init_weights(args: argparse.Namespace, console: Any) -> int:
    from hetpipe.runtime.stage.initial import write_initial_weights

    path = write_initial_weights(args.model, args.out_dir, seed=args.seed, init=args.init, seq=args.seq)
    console.print(f"wrote {path} ({args.init} init, seed {args.seed})")
    return 0
