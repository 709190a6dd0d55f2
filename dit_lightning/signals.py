"""Stopping on a signal, the same way in every command: SIGTERM (``scancel``, pre-emption,
Kubernetes, a supervisor), SIGINT (Ctrl-C) and, for ``fit``, SIGUSR1.

One :class:`SignalGuard` is in force while a command runs (the CLI's around every command;
``FaultTolerance``'s while Lightning runs a stage). What a signal does:

- **The first signal stops the work at a safe point.** Inside a :func:`safe_points` block (a
  loop: sampling, encoding shards, evaluation batches; an export between reading and writing) it
  is only recorded, and the work stops at the block's next :func:`stop_point` (the next denoising
  step, batch or shard) or when the block ends. Outside such a block it stops at once: every
  output is written atomically (:mod:`dit_lightning.atomic`: the complete file or nothing), so no
  partial output is left either way. A guard made with ``defer=True`` only records the signal
  for its owner, which stops at its own point (``fit``: the end of the optimiser step, after
  writing ``last.ckpt``).
- **A second signal stops at once**, wherever the work is.
- Either way the command ends with :class:`SignalExit`: exit status 128 + the signal's number
  (143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1, whatever Lightning or a tool would have
  returned) and one line saying what was stopped and how to resume, built by the :func:`on_stop`
  blocks the exception passed through.

Library code calls the module's functions (:func:`stop_point`, :func:`safe_points`,
:func:`on_stop`): they act on the guard in force and do nothing without one (a notebook, a test),
where Ctrl-C stays a plain ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any, Optional

# The signals that stop a command, and what a user reads for them.
SIGNAL_NAMES: dict[int, str] = {
    int(signal.SIGTERM): "SIGTERM",
    int(signal.SIGINT): "SIGINT (Ctrl-C)",
    int(signal.SIGUSR1): "SIGUSR1",
}
STOP_SIGNALS: tuple[int, ...] = (int(signal.SIGTERM), int(signal.SIGINT))
# What a stop without a more precise account leaves behind.
NOTHING_PARTIAL = "no output was left half-written (each is written whole or not at all)"


def signal_name(signum: int) -> str:
    return SIGNAL_NAMES.get(int(signum), f"signal {int(signum)}")


class SignalExit(SystemExit):
    """Ends a command stopped by a signal, with exit status 128 + the signal's number.

    ``detail`` says what was done and how to resume (set by :func:`on_stop`); ``at_once``: the
    second signal stopped it; ``reported``: its line was printed (:meth:`report` prints it once)."""

    def __init__(self, signum: int, detail: str = "", at_once: bool = False, reported: bool = False) -> None:
        super().__init__(128 + int(signum))
        self.signum = int(signum)
        self.detail = detail
        self.at_once = at_once
        self.reported = reported

    def __reduce__(self) -> Any:  # pickled across processes with its fields, not only the code
        return (type(self), (self.signum, self.detail, self.at_once, self.reported))

    def line(self, command: str) -> str:
        how = f"at once by a second {signal_name(self.signum)}" if self.at_once else f"by {signal_name(self.signum)}"
        return f"{command}: stopped {how}: {self.detail or NOTHING_PARTIAL}."

    def report(self, command: str, show: bool = True) -> None:
        """Print :meth:`line` to stdout unless it was printed already (``show=False``: only mark it
        printed, e.g. on ranks other than 0)."""
        if not self.reported and show:
            print(self.line(command), flush=True)
        self.reported = True


def signal_behind(error: BaseException) -> Optional[SignalExit]:
    """The :class:`SignalExit` that ``error`` was raised while handling, if any: a signal that stops
    at once can land inside a library's write, whose clean-up then fails on the half-written file
    (``torch.save``: "enforce fail at inline_container.cc ... unexpected pos") and hides the stop."""
    seen: set[int] = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        if isinstance(e, SignalExit):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


_guards: list[SignalGuard] = []  # those in force, innermost last


def active() -> Optional[SignalGuard]:
    """The guard in force (the innermost), or None."""
    return _guards[-1] if _guards else None


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, text.encode())  # not print(): a handler may interrupt a print in progress


class SignalGuard:
    """Handlers for ``signals`` that stop the work as the module docstring says; a context manager
    (or :meth:`install` / :meth:`uninstall`), effective in the main thread of the process that
    installed it (a forked child, e.g. a DataLoader worker, ignores them: that process stops it).

    Args:
        command: names the command in its lines (``dit-lightning sample``).
        signals: the signals handled (default SIGTERM and SIGINT).
        defer: the first signal never stops the work by itself: the owner reads :attr:`signum`.
        notice: what happens after the first signal, said when it is deferred.
        prefix: starts the notices (default ``command``; e.g. ``[rank 1] dit-lightning``).
        on_signal: called with each signal first (e.g. to forward it to processes this one started).
    """

    def __init__(
        self,
        command: str,
        signals: Iterable[int] = STOP_SIGNALS,
        *,
        defer: bool = False,
        notice: str = "stopping at the next safe point",
        prefix: Optional[str] = None,
        on_signal: Optional[Callable[[int], None]] = None,
    ) -> None:
        self.command = command
        self.signals = tuple(int(s) for s in signals)
        self.defer = defer
        self.notice = notice
        self.prefix = command if prefix is None else prefix
        self.on_signal = on_signal
        self.signum: Optional[int] = None  # the first signal received
        self.depth = 0  # safe_points blocks open
        self._previous: dict[int, Any] = {}
        self._pid: Optional[int] = None

    @property
    def installed(self) -> bool:
        return self in _guards

    def install(self) -> SignalGuard:
        if self.installed or threading.current_thread() is not threading.main_thread():
            return self  # Python runs handlers in the main thread only
        self.signum, self.depth, self._pid = None, 0, os.getpid()
        for signum in self.signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)
        _guards.append(self)
        return self

    def uninstall(self) -> None:
        if not self.installed:
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:  # not if someone installed theirs meanwhile
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        _guards.remove(self)
        self.depth = 0

    def __enter__(self) -> SignalGuard:
        return self.install()

    def __exit__(self, kind: Any, error: Optional[BaseException], tb: Any) -> None:
        self.uninstall()
        if isinstance(error, SignalExit):
            error.report(self.command)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if os.getpid() != self._pid:
            # A forked child (a DataLoader worker) inherited the handler, and gets the signal too when
            # it goes to the whole process group (Ctrl-C, scancel): it must keep serving until the
            # process that installed the guard stops at its safe point, and then shuts it down.
            return
        if self.on_signal is not None:
            self.on_signal(signum)
        name = signal_name(signum)
        if self.signum is not None:
            _say(f"{self.prefix}: {name} received again: stopping at once\n")
            raise SignalExit(signum, at_once=True)
        self.signum = signum
        if self.defer or self.depth > 0:
            _say(f"{self.prefix}: {name} received: {self.notice} (send it again to stop at once)\n")
            return
        raise SignalExit(signum)

    def enter_safe_points(self) -> None:
        """Open a :func:`safe_points` block (for owners whose block spans callbacks: close it with
        :meth:`exit_safe_points`)."""
        if not self.defer:
            self.depth += 1

    def exit_safe_points(self) -> None:
        """Close a block: the end of a block is a safe point too."""
        if self.defer or not self.depth:
            return
        self.depth -= 1
        if self.signum is not None:
            raise SignalExit(self.signum)

    def poll(self) -> None:
        """A safe point: raise :class:`SignalExit` if a signal was received inside a
        :func:`safe_points` block (never for a ``defer`` guard: its owner decides)."""
        if self.signum is not None and self.depth > 0 and not self.defer:
            raise SignalExit(self.signum)


def stop_point() -> None:
    """A safe point of a long loop (between denoising steps, batches, shards): stops the command
    here when a signal arrived meanwhile (:meth:`SignalGuard.poll`); nothing without a guard."""
    guard = active()
    if guard is not None:
        guard.poll()


@contextlib.contextmanager
def safe_points() -> Iterator[None]:
    """A block that stops only at its :func:`stop_point` calls, or when it ends, after a first signal
    (outside such blocks the first signal stops the work at once). Blocks nest."""
    guard = active()
    if guard is None or guard.defer:
        yield
        return
    guard.enter_safe_points()
    try:
        yield
    except BaseException:
        guard.depth = max(0, guard.depth - 1)
        raise
    guard.exit_safe_points()


@contextlib.contextmanager
def on_stop(describe: Callable[[], str]) -> Iterator[None]:
    """A signal that stops the work inside this block is reported with ``describe()``: what is done
    and how to resume (the innermost block that has something to say wins)."""
    try:
        yield
    except SignalExit as stop:
        if not stop.detail:
            try:
                stop.detail = describe()
            except Exception as e:  # the account of a stop must not hide the stop
                print(f"(could not describe what was done: {e})", file=sys.stderr)
        raise
