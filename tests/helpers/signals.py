"""``dit-lightning`` with real signals sent at a deterministic point of the work, for the tools that
have no callbacks: ``python -m tests.helpers.signals N SIG[,SIG...] ARGS...`` runs
``dit-lightning ARGS`` and, when it reaches its N-th safe point (the N-th
``SignalGuard.poll``: a denoising step, a batch of ``extract``, an export between reading and
writing), sends itself the signals (``TERM``, ``INT``; two: the second stops at once), delivered
as from ``kill``. ``N`` may also be ``write:NAME``: the signals arrive in the middle of the first
atomic write of a file named ``NAME`` (inside ``torch.save`` for a checkpoint), after its first
bytes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_signalled(at: int | str, signals: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``dit-lightning ARGS`` in a subprocess, signalled with ``signals`` at its ``at``-th safe point."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "tests.helpers.signals", str(at), signals, *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


class _SignallingFile:
    """A file whose third ``write`` first sends the signals (a write in progress, some bytes written)."""

    def __init__(self, file: Any, signums: list[int]) -> None:
        self._file, self._signums, self._writes = file, signums, 0

    def write(self, data: Any) -> int:
        self._writes += 1
        if self._writes == 3:
            for signum in self._signums:
                os.kill(os.getpid(), signum)
        return self._file.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def _signal_during_write(name: str, signums: list[int]) -> None:
    from dit_lightning import atomic

    atomic_open = atomic.atomic_open
    sent = False

    @contextlib.contextmanager
    def signalling_open(path: Any, mode: str = "wb") -> Any:
        nonlocal sent
        with atomic_open(path, mode) as f:
            if sent or os.path.basename(os.fspath(path)) != name:
                yield f
            else:
                sent = True
                yield _SignallingFile(f, signums)

    atomic.atomic_open = signalling_open


def main(argv: list[str]) -> None:
    from dit_lightning import signals
    from dit_lightning.cli import main as cli

    names, args = [getattr(signal, f"SIG{n}") for n in argv[1].split(",")], argv[2:]
    if argv[0].startswith("write:"):
        _signal_during_write(argv[0].removeprefix("write:"), names)
        cli(args)
        return
    at = int(argv[0])
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
