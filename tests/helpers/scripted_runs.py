"""The ``main`` of the multi-process run scripts (tests/distributed/parity.py, comm_runs.py).

Each script is started once per node (as a plain script or under ``torchrun``); its first
``Trainer(devices=2)`` makes Lightning re-run it as the second rank, and the later runs reuse both
processes and their process group. ``main`` runs the runs named by ``--runs`` in order, marks
``OUT/done`` from the first rank, and destroys the process group so that the interpreter never exits
with gloo still holding a collective (see ``dit_lightning.ranks.close_process_group``).
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Optional

import torch

from dit_lightning.ranks import close_process_group, resolve_rank

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*predefined device mesh.*")

Run = Callable[[argparse.Namespace], None]


def run_main(
    doc: Optional[str],
    runs: Mapping[str, Run],
    default_runs: str,
    argv: Optional[list[str]] = None,
    add_arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None,
) -> None:
    """``--data D --out O [--runs a,b]`` (and the script's own arguments): run them, mark ``O/done``."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--runs", default=default_runs)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # a tiny model: more threads only spin on a shared 2-core machine
    for name in args.runs.split(","):
        runs[name](args)
    first = resolve_rank()[0] == 0  # the global rank, asked of the group before it closes
    close_process_group()
    if first:
        (args.out / "done").write_text(args.runs)
