"""``dit-lightning`` with real signals sent at a deterministic point of the work, for the tools that
have no callbacks: ``python -m tests.helpers.signals N SIG[,SIG...] ARGS...`` runs
``dit-lightning ARGS`` and, when it reaches its N-th safe point (the N-th
``SignalGuard.poll``: a denoising step, a batch of ``extract``, an export between reading and
writing), sends itself the signals (``TERM``, ``INT``; two: the second stops at once), delivered
as from ``kill``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_signalled(at: int, signals: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``dit-lightning ARGS`` in a subprocess, signalled with ``signals`` at its ``at``-th safe point."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "tests.helpers.signals", str(at), signals, *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def main(argv: list[str]) -> None:
    from dit_lightning import signals
    from dit_lightning.cli import main as cli

    at, names, args = int(argv[0]), [getattr(signal, f"SIG{n}") for n in argv[1].split(",")], argv[2:]
    poll = signals.SignalGuard.poll
    seen = 0

    def counting_poll(self: Any) -> None:
        nonlocal seen
        seen += 1
        if seen == at:
            for signum in names:
                os.kill(os.getpid(), signum)
        poll(self)

    signals.SignalGuard.poll = counting_poll  # type: ignore[method-assign]
    cli(args)


if __name__ == "__main__":
    main(sys.argv[1:])
