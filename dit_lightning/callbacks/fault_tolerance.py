"""Fail safe: nothing lost on signals, no non-finite weights saved, outputs checked before work, and a
lost rank named instead of a hang.

:class:`FaultTolerance` is on by default in the CLI (``--fault_tolerance.*``; add it to a
``Trainer`` by hand elsewhere). What it does:

- **Signals.** SIGTERM (``scancel``, pre-emption, Kubernetes), SIGINT (Ctrl-C) and SIGUSR1 let the
  optimiser step in progress finish; then every rank writes ``last.ckpt`` together through the
  checkpoint callback (atomically: :class:`~dit_lightning.plugins.AtomicCheckpointIO`), and the
  process exits with 128 + the signal's number (143, 130, 138). Resuming from it
  (``--ckpt_path last``) continues bit for bit. In ``validate`` / ``test`` / ``predict`` a signal
  stops the stage at the end of the batch in progress or at the next sampling step (of
  ``GenerationMetrics``, of ``predict``), writing nothing more. A second signal stops at once,
  with the same status (never Lightning's 0). Under SLURM with Lightning's auto-requeue, SIGUSR1
  stays Lightning's (an hpc checkpoint and ``scontrol requeue``). The mechanism is the one of every
  command, :mod:`dit_lightning.signals`.
- **Non-finite losses.** A NaN / inf training loss (on any rank) stops the run with a clear error
  after ``nonfinite_patience`` further such steps (default: at the first); and no checkpoint is
  ever written from weights holding NaN / inf, so a good ``last.ckpt`` is never overwritten.

The step is never stalled for these checks: the loss is watched on the device (no host read), and
what it saw is read once per ``check_every_n_steps`` optimiser steps (default: the Trainer's
``log_every_n_steps``, when Lightning reads its metrics anyway), before every checkpoint and at the
end; a NaN is reported at the step where it happened. A signal is seen at once by one process; in a
multi-process run the ranks agree on it in that same read (one small all-reduce), so they stop
together at most ``check_every_n_steps`` steps after it arrived.
- **Outputs.** Before the first step (or the first sample of ``test`` / ``predict``) every
  directory the run will write (checkpoints, logs, sample grid, metrics file, predictions) is
  created and tried with a temporary file: an unwritable one fails now, not at the first save.
- **Lost ranks.** In a multi-process run each rank beats a counter in the rendezvous store once
  per ``heartbeat_interval``; a rank whose process has exited (same host) or whose counter stops
  for ``peer_timeout`` seconds (a dead or frozen node) is named by the others, which then stop
  (in at most ``peer_timeout`` + 10 s, instead of hanging to the 30-minute collective timeout).
  A collective that fails because a peer died carries the same diagnosis in its error.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from ..atomic import NotWritableError, check_writable
from ..distributed.sharding import is_sharded
from ..signals import SIGNAL_NAMES, SignalExit, SignalGuard, signal_name
from .throughput import step_cadence

__all__ = ["FaultTolerance", "NonFiniteLossError", "NonFiniteWeightsError", "PeerWatchdog", "SignalExit"]


class NonFiniteLossError(RuntimeError):
    """The training loss was NaN / inf for more steps than allowed."""


class NonFiniteWeightsError(RuntimeError):
    """A checkpoint was about to be written from weights holding NaN / inf."""


def _is_step_end(trainer: L.Trainer) -> bool:
    """Whether the batch that just ended completed an optimiser step (not a gradient accumulation)."""
    loop = trainer.fit_loop.epoch_loop
    try:
        return not loop._should_accumulate()
    except Exception:  # a Lightning without the method: every batch counts
        return True


def _started_by_lightning(trainer: L.Trainer) -> bool:
    """Whether this process is a rank that Lightning's own launcher started (a child running the
    same command line as its parent, the rank-0 process)."""
    if not isinstance(getattr(trainer.strategy, "cluster_environment", None), LightningEnvironment):
        return False
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return False
    mine = sys.argv[1:]
    return len(parent) > len(mine) and parent[len(parent) - len(mine) :] == mine


def _leave_after_the_launcher(trainer: L.Trainer) -> None:
    """On a rank Lightning's launcher started, wait (up to a minute) for the launching process to
    exit first: when every rank stops together (a signal, a non-finite loss), its observer would
    otherwise take this rank's exit for a crash and kill it before it printed why."""
    if trainer.local_rank > 0 and _started_by_lightning(trainer):
        parent, deadline = os.getppid(), time.monotonic() + 60
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.1)


def _distributed(trainer: L.Trainer) -> bool:
    return trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


# --------------------------------------------------------------------------------------------
# Lost ranks
# --------------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """A process of this host that exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class PeerWatchdog(threading.Thread):
    """Heartbeats of the ranks of a process group, through its rendezvous store (see the module
    docstring). Each rank watches the next one (ring) and all read one shared "lost" record, so the
    store sees three small operations per rank and interval, whatever the world size."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        interval: float = 1.0,
        timeout: float = 120.0,
        grace: float = 10.0,
        exit_code: int = 1,
    ) -> None:
        super().__init__(name="dit-lightning-peer-watchdog", daemon=True)
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval, self.timeout, self.grace, self.exit_code = interval, timeout, grace, exit_code
        self.host = socket.gethostname()
        self.lost: Optional[str] = None
        self._stop_event = threading.Event()
        self._peers: dict[int, tuple[int, str]] = {}
        self._beats = 0

    # -- store helpers (non-blocking: add(key, 0) reads a counter, check() tests a key) --------
    def _info(self, rank: int) -> Optional[tuple[int, str]]:
        if rank not in self._peers:
            key = f"info/{rank}"
            if not self.store.check([key]):
                return None
            pid, _, host = self.store.get(key).decode().partition("@")
            self._peers[rank] = (int(pid), host)
        return self._peers[rank]

    def describe(self, rank: int) -> str:
        info = self._peers.get(rank)
        return f"rank {rank}" + (f" (pid {info[0]} on {info[1]})" if info else "")

    def _gone_locally(self, rank: int) -> bool:
        info = self._info(rank)
        return info is not None and info[1] == self.host and not _alive(info[0])

    def publish(self) -> None:
        self.store.set(f"info/{self.rank}", f"{os.getpid()}@{self.host}")

    def run(self) -> None:
        watched = (self.rank + 1) % self.world_size
        last_value, last_change = -1, time.monotonic()
        store_failed_since: Optional[float] = None
        try:
            self.publish()
        except Exception:
            return  # no usable store: nothing to watch with
        while not self._stop_event.wait(self.interval):
            now = time.monotonic()
            try:
                self._beats += 1
                self.store.add(f"beat/{self.rank}", 1)
                if self.store.add("lost/flag", 0):
                    self._report(self.store.get("lost/message").decode(), announce=False)
                    return
                value = int(self.store.add(f"beat/{watched}", 0))
                if value != last_value:
                    last_value, last_change = value, now
                if self._gone_locally(watched):
                    self._report(f"{self.describe(watched)} exited (killed or crashed)")
                    return
                if now - last_change > self.timeout:
                    self._report(f"{self.describe(watched)} sent no heartbeat for {now - last_change:.0f} s")
                    return
                store_failed_since = None
            except Exception as e:
                store_failed_since = store_failed_since or now
                if now - store_failed_since > min(self.timeout, 30.0):
                    self._report(f"the rendezvous store (hosted by rank 0 or the launcher) stopped answering ({e})")
                    return

    def start(self) -> None:
        super().start()
        # Joined before the interpreter exits, whatever ends the run: a daemon thread still inside a
        # store call then (C++, GIL released) is ended by pthread_exit as it takes the GIL back, which
        # unwinds through a noexcept destructor: "terminate called without an active exception", -6.
        atexit.register(self.close)

    def stop(self) -> None:
        self._stop_event.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop and wait for the thread (its store call in flight returns in milliseconds; a store
        that no longer answers is given ``timeout`` seconds)."""
        self.stop()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout)
        atexit.unregister(self.close)

    def _report(self, what: str, announce: bool = True) -> None:
        if self.lost is not None:
            return
        self.lost = what
        if announce:
            with contextlib.suppress(Exception):
                self.store.set("lost/message", what)
                self.store.add("lost/flag", 1)
        print(
            f"[rank {self.rank}] dit-lightning: lost {what}; stopping this rank too. Resume every rank from the last "
            "checkpoint (--ckpt_path last).",
            file=sys.stderr,
            flush=True,
        )
        # The main thread may be blocked in a collective that never returns (NCCL, a frozen peer):
        # give it a moment to fail by itself, then leave.
        if not self._stop_event.wait(self.grace):
            os._exit(self.exit_code)

    def diagnose(self, wait: Optional[float] = None) -> Optional[str]:
        """Which rank is gone, asked after a collective failed: the shared record, processes of this
        host that exited, or counters that stopped (watched for ``wait`` seconds)."""
        if self.lost is not None:
            return self.lost
        wait = 3 * self.interval + 1 if wait is None else wait
        try:
            if self.store.add("lost/flag", 0):
                return self.store.get("lost/message").decode()
            peers = [r for r in range(self.world_size) if r != self.rank]
            for r in peers:
                if self._gone_locally(r):
                    return f"{self.describe(r)} exited (killed or crashed)"
            before = {r: int(self.store.add(f"beat/{r}", 0)) for r in peers}
            time.sleep(wait)
            stalled = [r for r in peers if int(self.store.add(f"beat/{r}", 0)) == before[r]]
            for r in peers:
                if self._gone_locally(r):
                    return f"{self.describe(r)} exited (killed or crashed)"
            if stalled:
                return ", ".join(self.describe(r) for r in stalled) + " stopped sending heartbeats"
        except Exception:
            return "rank 0 (it hosts the rendezvous store, which no longer answers: its process is gone)"
        return None


def _watchdog_store(prefix: str) -> Any:
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import _get_default_store

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"dit_lightning/peers/{attempt}/{prefix}/", _get_default_store())


_COMMUNICATION_ERRORS = ("Connection reset", "Connection closed", "Broken pipe", "gloo", "NCCL", "timed out", "Timeout")


# --------------------------------------------------------------------------------------------
# The callback
# --------------------------------------------------------------------------------------------


class NonFiniteWatch:
    """Consecutive optimiser steps with a NaN / inf loss, counted on the loss's device without a
    host read: ``state()`` is (step at which the run exceeded the patience or -1, first step of that
    run, its length), read by :class:`FaultTolerance` at its cadence."""

    def __init__(self, device: torch.device, patience: int) -> None:
        self.patience = patience
        self._bad = torch.zeros((), dtype=torch.bool, device=device)  # a bad micro-batch in this step
        self._run = torch.zeros((), dtype=torch.long, device=device)  # bad steps in a row
        self._since = torch.zeros((), dtype=torch.long, device=device)
        self._stopped = torch.full((3,), -1, dtype=torch.long, device=device)

    def see(self, loss: Tensor) -> None:
        self._bad |= ~torch.isfinite(loss).all()

    def step_ended(self, step: int) -> None:
        bad = self._bad
        self._run = torch.where(bad, self._run + 1, torch.zeros_like(self._run))
        self._since = torch.where(bad & (self._run == 1), torch.full_like(self._since, step), self._since)
        tripped = (self._run > self.patience) & (self._stopped[0] < 0)
        now = torch.stack([torch.full_like(self._run, step), self._since, self._run])
        self._stopped = torch.where(tripped, now, self._stopped)
        self._bad = torch.zeros_like(bad)

    def state(self) -> Tensor:
        return self._stopped


class FaultTolerance(L.Callback):
    """Checkpoint on SIGTERM / SIGINT / SIGUSR1, stop on non-finite losses, never save non-finite
    weights, check every output location before work, and name a lost rank (module docstring).

    Args:
        signals: on SIGTERM, SIGINT and SIGUSR1, checkpoint (fit) or stop at the next batch or sampling
            step (validate, test, predict), and exit with 128 + the signal.
        nonfinite_patience: consecutive optimiser steps with a NaN / inf loss tolerated before the
            run stops (0: stop at the first; mixed precision with a loss scaler may want a few).
        check_outputs: create and try every output directory before the first step.
        peer_timeout: seconds without a heartbeat after which a rank counts as lost.
        heartbeat_interval: seconds between heartbeats (multi-process runs only; 0: no watchdog).
        check_every_n_steps: optimiser steps between the reads of the non-finite watch and (several
            ranks) the agreement on signals; None: the Trainer's ``log_every_n_steps``.
    """

    def __init__(
        self,
        signals: bool = True,
        nonfinite_patience: int = 0,
        check_outputs: bool = True,
        peer_timeout: float = 120.0,
        heartbeat_interval: float = 1.0,
        check_every_n_steps: Optional[int] = None,
    ) -> None:
        if nonfinite_patience < 0:
            raise ValueError(f"nonfinite_patience must be >= 0, got {nonfinite_patience}")
        if peer_timeout <= 0 or heartbeat_interval < 0:
            raise ValueError("peer_timeout must be > 0 and heartbeat_interval >= 0")
        if check_every_n_steps is not None and check_every_n_steps < 1:
            raise ValueError(
                f"check_every_n_steps must be >= 1 (or null: the logging cadence), got {check_every_n_steps}"
            )
        self.signals = signals
        self.nonfinite_patience = nonfinite_patience
        self.check_outputs = check_outputs
        self.peer_timeout = peer_timeout
        self.heartbeat_interval = heartbeat_interval
        self.check_every_n_steps = check_every_n_steps
        self._guard: Optional[SignalGuard] = None
        self._watch: Optional[NonFiniteWatch] = None
        self._watchdog: Optional[PeerWatchdog] = None
        self._checked: set[str] = set()
        self._generation = 0

    # ---- set-up ----------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._checked.clear()
        self._watch = None
        self._generation += 1
        if _distributed(trainer) and self.heartbeat_interval > 0 and self._watchdog is None:
            store = None
            with contextlib.suppress(Exception):  # a process group without a store: no watchdog
                store = _watchdog_store(f"{stage}-{self._generation}")
            if store is not None:
                self._watchdog = PeerWatchdog(
                    store,
                    trainer.global_rank,
                    trainer.world_size,
                    interval=self.heartbeat_interval,
                    timeout=self.peer_timeout,
                )
                self._watchdog.start()
        self._adopt_process_observer(trainer)

    def _adopt_process_observer(self, trainer: L.Trainer) -> None:
        """Lightning's launcher watches the ranks it started and, when one dies, kills them all and
        itself with SIGKILL, printing only a PID at info level: make it name the rank first."""
        procs = list(getattr(trainer.strategy.launcher, "procs", None) or [])
        observer = next((t for t in threading.enumerate() if t.name == "child-process-observer"), None)
        if not procs or observer is None or not hasattr(observer, "_terminate_all"):
            return
        first = trainer.node_rank * len([None, *procs])  # the global rank of this node's local rank 0
        rank = trainer.global_rank
        # The observer thread lives to interpreter exit: a strong reference to the trainer or to this
        # callback (which holds the module's bound methods) would keep the model, and through FSDP2's
        # DTensors and device mesh the gloo process groups, alive past close_process_group, whose
        # worker threads then still run at finalisation and may abort the process ("terminate called
        # without an active exception", -6, after a run that succeeded).
        trainer_ref, callback_ref = weakref.ref(trainer), weakref.ref(self)

        def name_then_terminate() -> None:
            for local, proc in enumerate(procs, start=1):
                if proc.returncode:
                    how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
                    what = f"rank {first + local} (pid {proc.pid} on {socket.gethostname()}) exited ({how})"
                    alive, callback = trainer_ref(), callback_ref()
                    watchdog = callback._watchdog if callback is not None else None
                    if watchdog is None or watchdog.lost is None:
                        where = f" at step {alive.global_step}" if alive is not None else ""
                        last = (
                            callback._last_good(alive)
                            if alive is not None and callback is not None
                            else "see the checkpoint directory"
                        )
                        print(
                            f"[rank {rank}] dit-lightning: lost {what}{where}; "
                            f"every rank stops. Resume all of them from the last checkpoint: --ckpt_path last "
                            f"({last}).",
                            file=sys.stderr,
                            flush=True,
                        )
                    break
            for proc in procs:
                with contextlib.suppress(Exception):
                    proc.kill()
            os._exit(1)  # as Lightning does (the main thread may be stuck in a collective), with status 1

        observer._terminate_all = name_then_terminate

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        self._uninstall_guard()

    # ---- outputs ---------------------------------------------------------------------------
    def output_locations(self, trainer: L.Trainer, stage: str) -> list[tuple[Path, str, str]]:
        """Every directory the run writes in ``stage``: (directory, what, the option that sets it)."""
        found: list[tuple[Path, str, str]] = []
        if stage == "fit":
            for cb in trainer.checkpoint_callbacks:
                if isinstance(cb, ModelCheckpoint) and cb.dirpath:
                    found.append((Path(cb.dirpath), "checkpoint directory", "--checkpoint.dirpath"))
        for logger in trainer.loggers:
            where = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
            if where and "://" not in str(where):
                found.append((Path(where), f"log directory of {type(logger).__name__}", "--trainer.logger.save_dir"))
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            locate = getattr(cb, "output_locations", None)
            if callable(locate) and cb is not self:
                found.extend(locate(trainer, stage))
        return found

    def _check_outputs(self, trainer: L.Trainer, stage: str) -> None:
        if not self.check_outputs or stage in self._checked:
            return
        self._checked.add(stage)
        problem: Optional[str] = None
        locations = self.output_locations(trainer, stage)  # on every rank: a {log_dir} is a broadcast
        if trainer.is_global_zero:
            for directory, what, option in locations:
                try:
                    check_writable(directory, what, f"Set {option} to a writable location.")
                except OSError as e:
                    problem = f"{e} (checked before the run started: nothing was lost)"
                    break
        ok = problem is None
        if trainer.world_size > 1:
            ok = trainer.strategy.reduce_boolean_decision(ok, all=True)
        if problem is not None:
            raise NotWritableError(problem)
        if not ok:
            raise NotWritableError("rank 0 found an output location it cannot write (see its message)")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_outputs(trainer, "fit")
        self._check_learning_rates(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._check_outputs(trainer, "validate")
            self._install_guard(trainer, "validate")

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_outputs(trainer, "test")
        self._install_guard(trainer, "test")

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_outputs(trainer, "predict")
        self._install_guard(trainer, "predict")

    @staticmethod
    def _check_learning_rates(trainer: L.Trainer) -> None:
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                lr = group.get("initial_lr", group.get("lr"))
                if isinstance(lr, (int, float)) and lr == 0 and any(p.requires_grad for p in group["params"]):
                    rank_zero_warn(
                        f"the learning rate of {type(optimizer).__name__} is 0: training computes losses but never "
                        "changes the weights. Set --model.optimizer.lr (e.g. 1e-4, the paper's) unless that is meant."
                    )
                    return

    # ---- signals ---------------------------------------------------------------------------
    def _handled_signals(self, trainer: L.Trainer) -> list[int]:
        env = trainer._accelerator_connector.cluster_environment
        slurm_requeue = isinstance(env, SLURMEnvironment) and env.auto_requeue
        return [s for s in SIGNAL_NAMES if not (s == signal.SIGUSR1 and slurm_requeue)]

    @property
    def _signum(self) -> Optional[int]:
        """The signal received (the first), if any."""
        return self._guard.signum if self._guard is not None else None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install_guard(trainer, "fit")

    def _install_guard(self, trainer: L.Trainer, stage: str) -> None:
        """Take the signals (after Lightning registered its own handlers, which would end the run with
        status 0 and, in fit, without a checkpoint): one :class:`~dit_lightning.signals.SignalGuard`.
        In ``fit`` a signal is only recorded (the run checkpoints and stops at the end of the step:
        :meth:`_check`); in ``validate`` / ``test`` / ``predict`` the whole stage is a block of safe
        points: it stops at the end of the batch in progress, or at the next sampling step of
        ``GenerationMetrics`` / ``predict``. A second signal stops at once."""
        if not self.signals or threading.current_thread() is not threading.main_thread():
            return
        self._uninstall_guard()
        fit = stage == "fit"

        def forward(signum: int) -> None:  # to the ranks this process started
            for proc in getattr(trainer.strategy.launcher, "procs", []) or []:
                with contextlib.suppress(Exception):
                    proc.send_signal(signum)

        self._guard = SignalGuard(
            f"dit-lightning {stage}",
            self._handled_signals(trainer),
            defer=fit,
            notice="finishing the current step, then saving last.ckpt" if fit else "stopping at the next safe point",
            prefix=f"[rank {trainer.global_rank}] dit-lightning" + ("" if fit else f" {stage}"),
            on_signal=forward,
        ).install()
        self._guard.enter_safe_points()  # (nothing for fit's deferring guard)

    def _uninstall_guard(self) -> None:
        if self._guard is not None:
            self._guard.uninstall()
            self._guard = None

    def _poll(self) -> None:
        if self._guard is not None:
            self._guard.poll()

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kw: Any) -> None:
        if trainer.state.fn == "validate":
            self._poll()

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kw: Any) -> None:
        self._poll()

    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kw: Any) -> None:
        self._poll()

    def _end_of_stage(self, trainer: L.Trainer) -> None:
        """The end of validate / test / predict: a signal received after the last safe point still
        ends the command with 128 + the signal (its work is complete)."""
        signum = self._signum
        if signum is not None:
            self._uninstall_guard()
            raise SignalExit(signum, detail="it had just finished: every output is written whole")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._end_of_stage(trainer)

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._end_of_stage(trainer)

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._end_of_stage(trainer)

    # ---- every optimiser step ----------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if isinstance(outputs, Mapping):  # a redoable step returns its loss apart ("loss" only reduces gradients)
            loss = outputs.get("step_loss", outputs.get("loss"))
        else:
            loss = outputs
        if torch.is_tensor(loss):
            if self._watch is None:
                self._watch = NonFiniteWatch(loss.device, self.nonfinite_patience)
            self._watch.see(loss.detach())
        if not _is_step_end(trainer):
            return
        if self._watch is not None:
            self._watch.step_ended(trainer.global_step)
        several = _distributed(trainer)
        every = self.check_every_n_steps or step_cadence(trainer)
        if trainer.global_step % every == 0 or (self._signum and not several):
            self._check(trainer, step_end=True)

    def _check(self, trainer: L.Trainer, step_end: bool = False) -> None:
        """Read the non-finite watch and (several ranks) agree on signals: the one host read of the step
        (``step_end``: at the end of a training step, whose metrics are not logged yet)."""
        watch = self._watch.state() if self._watch is not None else torch.full((3,), -1.0)
        flags = torch.cat([torch.tensor([float(self._signum or 0)], device=watch.device), watch.float()])
        if _distributed(trainer):  # every rank decides the same, or a collective would hang
            flags = flags.to(trainer.strategy.root_device)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        signum, stopped_at, since, run = (int(v) for v in flags.tolist())
        if stopped_at >= 0:
            raise NonFiniteLossError(self._nonfinite_message(trainer, stopped_at, since, run))
        if signum:
            self._save_and_exit(trainer, signum, step_end)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._watch is not None:  # a NaN in the steps since the last read
            self._check(trainer)

    def _last_good(self, trainer: L.Trainer) -> str:
        cb = trainer.checkpoint_callback
        path = getattr(cb, "last_model_path", "") or getattr(cb, "best_model_path", "")
        if path and os.path.exists(path):
            from ..checkpoints import read_training_state

            with contextlib.suppress(Exception):  # part of another error's message: the step is only a detail
                step = read_training_state(path).step  # a file, or a sharded directory's meta.pt
                return f"the last checkpoint, {path} (step {step}), was written before and is kept"
            return f"the last checkpoint, {path}, was written before and is kept"
        return "no checkpoint was written"

    def _nonfinite_message(self, trainer: L.Trainer, step: int, since: int, steps: int) -> str:
        lr = [g.get("lr") for o in trainer.optimizers for g in o.param_groups][:1]
        return (
            f"the training loss is NaN or inf at step {step}"
            + (f" ({steps} steps in a row, since step {since})" if steps > 1 else "")
            + f": training stopped; {self._last_good(trainer)}. Usual causes: non-finite values in the store "
            "(check it with `dit-lightning verify --path <data.path>`), a learning rate too high "
            f"(now {lr[0] if lr else '?'}), or fp16 overflow (bf16-mixed or 32-true avoid it). To tolerate a few such "
            "steps, set --fault_tolerance.nonfinite_patience N."
        )

    def _save_and_exit(self, trainer: L.Trainer, signum: int, step_end: bool = False) -> None:
        name = signal_name(signum)
        if step_end:  # Lightning logs a step's metrics after this hook: the step saved keeps its row (train/loss)
            trainer._logger_connector.update_train_step_metrics()
        cb = trainer.checkpoint_callback
        if isinstance(cb, ModelCheckpoint) and cb.dirpath:
            if cb.save_last:
                cb._save_last_checkpoint(trainer, cb._monitor_candidates(trainer))
                path = cb.last_model_path
            else:
                path = os.path.join(cb.dirpath, cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION)
                trainer.save_checkpoint(path)
            refresh = getattr(cb, "_refresh_link", None)
            if callable(refresh):
                refresh(trainer)
            done = f"saved {path} (step {trainer.global_step}); resume with --ckpt_path last or --ckpt_path {path}"
        else:
            done = "checkpointing is off (--trainer.enable_checkpointing false): nothing was saved"
        if trainer.is_global_zero:
            print(f"dit-lightning fit: stopped by {name} after step {trainer.global_step}: {done}.", flush=True)
        self._uninstall_guard()
        _leave_after_the_launcher(trainer)
        raise SignalExit(signum, detail=done, reported=True)

    def _report_stop(self, trainer: L.Trainer, stop: SystemExit) -> None:
        """The one line of a command a signal stopped (rank 0 prints it): what was stopped, what is
        kept, how to resume. Lightning's own SIGTERM exit (a signal before ours were in place)
        gets the status of a signal too, not 0."""
        stage = str(trainer.state.fn.value if trainer.state.fn is not None else "fit")
        if not isinstance(stop, SignalExit):
            stop.code = 128 + int(signal.SIGTERM)
            stop = SignalExit(int(signal.SIGTERM))
        if not stop.detail:
            stop.detail = self._stop_detail(trainer, stage)
        stop.report(f"dit-lightning {stage}", show=trainer.is_global_zero)

    def _stop_detail(self, trainer: L.Trainer, stage: str) -> str:
        if stage == "fit":
            last = self._last_good(trainer)
            resume = "; resume with --ckpt_path last" if last.startswith("the last checkpoint") else ""
            return f"at step {trainer.global_step}: {last}{resume}"
        if stage == "predict":
            where = []
            for cb in trainer.callbacks:  # type: ignore[attr-defined]
                locate = getattr(cb, "output_locations", None)
                if callable(locate) and cb is not self:
                    where += [str(directory) for directory, _, _ in locate(trainer, stage)]
            return (
                f"the images already in {', '.join(where) or 'the prediction directory'} are whole (each written "
                "atomically); run the same command again for all of them (it draws the same images)"
            )
        what = (
            "the held-out loss is logged once every batch is done"
            if stage == "validate"
            else "the metrics are logged and written once every batch and sample is done"
        )
        return f"nothing was logged or written ({what}); run the same command again"

    # ---- checkpoints -----------------------------------------------------------------------
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._watch is not None and trainer.state.fn == "fit":
            self._watch_before_save(trainer)
        checks = []
        for p in pl_module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p  # DTensor shards under FSDP2
            if local.is_floating_point() and local.numel():
                checks.append(torch.isfinite(local).all())
        finite = bool(torch.stack(checks).all()) if checks else True  # one read for all the weights
        if trainer.world_size > 1 and is_sharded(pl_module):  # shards differ; DDP replicas are equal
            finite = trainer.strategy.reduce_boolean_decision(finite, all=True)
        if not finite:
            raise NonFiniteWeightsError(
                f"the weights hold NaN or inf at step {trainer.global_step}: no checkpoint was written from them "
                f"({self._last_good(trainer)}). The run diverged: check the store with `dit-lightning verify`, "
                "lower the learning rate, or avoid fp16."
            )

    def _watch_before_save(self, trainer: L.Trainer) -> None:
        """A NaN loss since the last read stops the run before its checkpoint is written (the read
        costs nothing extra here: writing a checkpoint waits for the device anyway)."""
        assert self._watch is not None
        state = self._watch.state()
        if _distributed(trainer):
            state = state.float().to(trainer.strategy.root_device)
            torch.distributed.all_reduce(state, op=torch.distributed.ReduceOp.MAX)
        stopped_at, since, run = (int(v) for v in state.tolist())
        if stopped_at >= 0:
            raise NonFiniteLossError(self._nonfinite_message(trainer, stopped_at, since, run))

    # ---- a rank lost -----------------------------------------------------------------------
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # the stage's handlers go with it, whatever ended it (Lightning skips teardown hooks after an error)
        self._uninstall_guard()
        if isinstance(exception, (SignalExit, SIGTERMException)):
            if not getattr(exception, "reported", False):  # (a stop after a checkpoint reported itself)
                self._report_stop(trainer, exception)
                _leave_after_the_launcher(trainer)
            return
        if isinstance(exception, (NonFiniteLossError, NonFiniteWeightsError, NotWritableError)):
            _leave_after_the_launcher(trainer)  # raised on every rank together: rank 0 reports it
            return
        watchdog = self._watchdog
        if watchdog is None or isinstance(exception, (SystemExit, KeyboardInterrupt)):
            return
        text = f"{type(exception).__name__}: {exception}"
        if not any(marker in text for marker in _COMMUNICATION_ERRORS):
            return
        watchdog.stop()  # from here on this rank explains and exits; no forced exit meanwhile
        lost = watchdog.diagnose()
        if lost is None:
            return
        note = (
            f"rank {trainer.global_rank} lost {lost} at step {trainer.global_step}; every rank stops. "
            f"Resume all of them from the last checkpoint: --ckpt_path last ({self._last_good(trainer)})."
        )
        notes = list(getattr(exception, "__notes__", []) or [])
        with contextlib.suppress(Exception):
            exception.__notes__ = [*notes, note]  # type: ignore[attr-defined]
        print(f"[rank {trainer.global_rank}] dit-lightning: {note}", file=sys.stderr, flush=True)
