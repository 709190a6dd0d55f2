"""Running ``dit-lightning`` in subprocesses (importable as tests.helpers.cli): the demo config
shrunk for tests, the command lines of short ``fit`` runs, and callbacks the subprocesses load by
dotted path (``--trainer.callbacks+=tests.helpers.cli.KillAtStep``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import lightning as L

from tests.helpers.ports import with_master_port

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "demo.yaml")
# The demo's model and data shrunk so a fit takes seconds.
TINY = [
    "--model.depth", "2", "--model.hidden_size", "32", "--model.num_heads", "4",
    "--data.global_batch_size", "32", "--data.val_size", "64",
    "--trainer.callbacks=[]", "--trainer.log_every_n_steps", "1", "--trainer.enable_model_summary", "false",
    "--trainer.enable_progress_bar", "false", "--sample_grid.enabled", "false",
]  # fmt: skip


def run_cli(args, tmp_path, check=True):
    """``python -m dit_lightning.cli ARGS`` in ``tmp_path``; raises with the output's tail if it fails and ``check``."""
    env = with_master_port({**os.environ, "PYTHONPATH": str(ROOT)})  # for a run of several processes
    proc = subprocess.run(
        [sys.executable, "-m", "dit_lightning.cli", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def fit_args(tmp_path, name, steps, extra=()):
    """A ``fit`` of the shrunk demo on ``tmp_path/digits`` (the digits store, built there when missing)
    for ``steps`` steps, logging CSV and checkpointing every 4 steps under ``tmp_path/name``."""
    out = tmp_path / name
    return [
        "fit", "--config", DEMO, *TINY,
        "--data.path", str(tmp_path / "digits"), "--data.prepare", "digits",  # built there when missing
        "--trainer.max_steps", str(steps), "--trainer.val_check_interval", "1000",
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir", str(out), "--trainer.logger.name", "", "--trainer.logger.version", "",
        "--checkpoint.dirpath", str(out / "ckpt"), "--checkpoint.every_n_train_steps", "4",
        *extra,
    ]  # fmt: skip


class KillAtStep(L.Callback):
    """SIGKILL the process once the given optimiser step has finished: an unclean death,
    no checkpoint-on-exception, no teardown, like a pre-empted job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class SignalAtStep(L.Callback):
    """Send this process ``signum`` once the given optimiser step has finished (a real signal,
    delivered like one from ``kill``, at a reproducible point of the run); with ``rank``, only
    that rank's process gets it (like ``kill`` of the launching process)."""

    def __init__(self, step: int, signum: int = int(signal.SIGTERM), rank: Optional[int] = None) -> None:
        self.step, self.signum, self.rank, self.sent = step, signum, rank, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        mine = self.rank is None or trainer.global_rank == self.rank
        if trainer.global_step >= self.step and not self.sent and mine:
            self.sent = True
            os.kill(os.getpid(), self.signum)


class KillRankAtStep(L.Callback):
    """SIGKILL (or another signal, e.g. SIGSTOP: a frozen rank) the process of ``rank`` once the
    given optimiser step has finished: a rank lost in the middle of a multi-process run."""

    def __init__(self, rank: int, step: int, signum: int = int(signal.SIGKILL)) -> None:
        self.rank, self.step, self.signum = rank, step, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step >= self.step:
            print(f"rank {self.rank} (pid {os.getpid()}) gets signal {self.signum} now", flush=True)
            os.kill(os.getpid(), self.signum)


class PrintStep(L.Callback):
    """Print ``step N`` after each optimiser step (flushed), for tests that act on a live run."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        print(f"step {trainer.global_step}", flush=True)


class SignalAt(L.Callback):
    """Send this process ``signum`` (``times`` times in a row: a second signal too) from one hook:
    ``hook`` is ``on_train_batch_end`` or ``on_save_checkpoint`` (once ``global_step >= step``),
    ``on_validation_batch_end`` / ``on_test_batch_end`` / ``on_predict_batch_end`` (at batch
    ``batch``) or ``on_test_epoch_end`` (before ``GenerationMetrics`` samples: the CLI's callbacks
    run after those of ``--trainer.callbacks``). A real signal, delivered as from ``kill``, once."""

    def __init__(self, hook: str, signum: int = int(signal.SIGTERM), times: int = 1, step: int = 0, batch: int = 0):
        self.hook, self.signum, self.times, self.step, self.batch, self.sent = hook, signum, times, step, batch, False

    def _fire(self, hook: str, ready: bool = True) -> None:
        if hook == self.hook and ready and not self.sent:
            self.sent = True
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._fire("on_train_batch_end", trainer.global_step >= self.step)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._fire("on_save_checkpoint", trainer.global_step >= self.step)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._fire("on_validation_batch_end", batch_idx == self.batch)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._fire("on_test_batch_end", batch_idx == self.batch)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._fire("on_predict_batch_end", batch_idx == self.batch)

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self._fire("on_test_epoch_end")
