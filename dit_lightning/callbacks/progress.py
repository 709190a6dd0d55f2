"""Progress of a whole run: a rich bar in a terminal, plain lines in batch logs (SLURM, nohup, CI).

Lightning's bars count batches of the current epoch ("Epoch 83/-2" when training by ``max_steps``)
and print nothing to a file until the end. DiT runs are counted in optimiser steps: this bar
shows step / max_steps, the metrics of the progress bar (loss, images/s) and an ETA for the
whole run, and when stdout is not a terminal it prints one line every few percent (or at least
every ``interval_s`` seconds) that reads well in a log file; ``predict``, ``test`` and ``validate``
print the same lines, counted in batches.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks.progress import ProgressBar
from lightning.pytorch.trainer.states import TrainerFn


def _duration(seconds: float) -> str:
    seconds = int(round(max(0.0, seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _format_metrics(metrics: dict[str, Any]) -> str:
    parts = []
    for key, value in metrics.items():
        if key == "v_num":
            continue
        if isinstance(value, float):
            value = f"{value:.4g}"
        parts.append(f"{key} {value}")
    return " | ".join(parts)


class DiTProgressBar(ProgressBar):
    """Run-level progress in optimiser steps, interactive or as plain lines.

    Args:
        plain: ``None`` chooses by stdout (a terminal gets the rich bar), ``True`` always prints lines.
        every_percent: in plain mode, a line every this many percent of the run's steps.
        interval_s: in plain mode, a line at least this often (seconds) however slow the steps.
        refresh_rate: in the rich bar, update every this many optimiser steps.
    """

    def __init__(
        self, plain: Optional[bool] = None, every_percent: float = 5.0, interval_s: float = 60.0, refresh_rate: int = 1
    ) -> None:
        super().__init__()
        self.plain = plain
        self.every_percent = every_percent
        self.interval_s = interval_s
        self.refresh_rate = max(1, refresh_rate)
        self._enabled = True
        self._progress: Any = None  # rich.progress.Progress while a bar is shown
        self._task: Any = None
        self._eval_task: Any = None
        self._t0 = 0.0
        self._step0 = 0
        self._last_line = 0.0
        self._last_step = -1
        self._eval_t0 = self._eval_last = 0.0  # plain lines of validate / test / predict
        self._eval_total: Optional[int] = None
        self._eval_done = 0

    # ---- ProgressBar API ----------------------------------------------------------------------
    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.trainer.is_global_zero

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self._progress is not None:
            self._progress.console.print(*args, **kwargs)
        else:
            print(*args, **kwargs)

    # ---- helpers ------------------------------------------------------------------------------
    def _is_plain(self) -> bool:
        return self.plain if self.plain is not None else not sys.stdout.isatty()

    def _total(self, trainer: L.Trainer) -> Optional[int]:
        if trainer.max_steps and trainer.max_steps > 0:
            return int(trainer.max_steps)
        total = trainer.estimated_stepping_batches
        return int(total) if total != float("inf") else None

    def _start_rich(self) -> Any:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            auto_refresh=True,
        )
        self._progress.start()
        return self._progress

    def _stop_rich(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
            self._task = self._eval_task = None

    def _line(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, total: Optional[int]) -> str:
        done = step - self._step0
        elapsed = time.perf_counter() - self._t0
        parts = [f"step {step}/{total}" if total else f"step {step}"]
        if total:
            parts.append(f"{100.0 * step / total:.1f}%")
        metrics = _format_metrics(self.get_metrics(trainer, pl_module))
        if metrics:
            parts.append(metrics)
        parts.append(f"elapsed {_duration(elapsed)}")
        if total and done > 0:
            parts.append(f"ETA {_duration(elapsed / done * (total - step))}")
        return "fit: " + " | ".join(parts)

    # ---- training -----------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = self._last_line = time.perf_counter()
        self._step0 = self._last_step = trainer.global_step
        if not self.is_enabled:
            return
        total = self._total(trainer)
        if self._is_plain():
            print(
                f"fit: training from step {trainer.global_step} to {total if total else 'the end of the data'}",
                flush=True,
            )
            return
        self._start_rich()
        self._task = self._progress.add_task("fit", total=total, completed=trainer.global_step, metrics="")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if not self.is_enabled or step == self._last_step:
            return  # an accumulation micro-batch: the step has not advanced
        self._last_step = step
        total = self._total(trainer)
        if self._progress is not None and self._task is not None:
            if step % self.refresh_rate == 0 or step == total:
                metrics = _format_metrics(self.get_metrics(trainer, pl_module))
                self._progress.update(self._task, completed=step, metrics=metrics)
            return
        if not self._is_plain():
            return
        now = time.perf_counter()
        every = max(1, int(total * self.every_percent / 100)) if total else None
        if (every and step % every == 0) or step == total or now - self._last_line >= self.interval_s:
            self._last_line = now
            print(self._line(trainer, pl_module, step, total), flush=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.is_enabled:
            return
        if self._progress is not None:
            self._stop_rich()
        elapsed = time.perf_counter() - self._t0
        print(f"fit: done at step {trainer.global_step} in {_duration(elapsed)}", flush=True)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop_rich()

    # ---- evaluation and prediction ------------------------------------------------------------
    @staticmethod
    def _eval_lines(trainer: L.Trainer, description: str) -> bool:
        """Whether a plain log gets progress lines of this loop: ``predict``, ``test`` and a
        ``validate`` run do; validation inside fit prints its one result line instead."""
        return description != "validation" or trainer.state.fn != TrainerFn.FITTING

    def _eval_start(self, trainer: L.Trainer, description: str, total: Any) -> None:
        if not self.is_enabled or trainer.sanity_checking:
            return
        total = int(total) if total != float("inf") else None
        if self._progress is not None:  # validation inside fit: a transient second bar
            self._eval_task = self._progress.add_task(description, total=total, metrics="")
        elif not self._is_plain():
            self._progress = self._start_rich()
            self._eval_task = self._progress.add_task(description, total=total, metrics="")
        elif self._eval_lines(trainer, description):
            self._eval_total, self._eval_done = total, 0
            self._eval_t0 = self._eval_last = time.perf_counter()
            print(f"{description}: {total} batches" if total is not None else f"{description}: started", flush=True)

    def _eval_batch(self, trainer: L.Trainer, description: str) -> None:
        if self._progress is not None and self._eval_task is not None:
            self._progress.advance(self._eval_task)
            return
        if not self.is_enabled or trainer.sanity_checking or not self._is_plain():
            return
        if not self._eval_lines(trainer, description):
            return
        self._eval_done += 1
        done, total, now = self._eval_done, self._eval_total, time.perf_counter()
        every = max(1, int(total * self.every_percent / 100)) if total else None
        if not ((every and done % every == 0) or done == total or now - self._eval_last >= self.interval_s):
            return
        self._eval_last = now
        elapsed = now - self._eval_t0
        parts = [f"batch {done}/{total}", f"{100.0 * done / total:.1f}%"] if total else [f"batch {done}"]
        parts.append(f"elapsed {_duration(elapsed)}")
        if total:
            parts.append(f"ETA {_duration(elapsed / done * (total - done))}")
        print(f"{description}: " + " | ".join(parts), flush=True)

    def _eval_end(self, trainer: L.Trainer, pl_module: L.LightningModule, description: str) -> None:
        if not self.is_enabled or trainer.sanity_checking:
            return
        if self._progress is not None and self._eval_task is not None:
            self._progress.remove_task(self._eval_task)
            self._eval_task = None
            if self._task is None:
                self._stop_rich()
        if not self._is_plain():
            return
        if self._eval_lines(trainer, description):
            elapsed = time.perf_counter() - self._eval_t0
            print(f"{description}: done, {self._eval_done} batches in {_duration(elapsed)}", flush=True)
        if description == "validation":
            metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k.startswith("val")}
            print(f"validation at step {trainer.global_step}: {_format_metrics(metrics)}", flush=True)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._eval_start(trainer, "validation", self.total_val_batches)

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self._eval_batch(trainer, "validation")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._eval_end(trainer, pl_module, "validation")

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._eval_start(trainer, "test", sum(trainer.num_test_batches))

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        self._eval_batch(trainer, "test")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._eval_end(trainer, pl_module, "test")

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._eval_start(trainer, "predict", sum(trainer.num_predict_batches))

    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        self._eval_batch(trainer, "predict")

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._eval_end(trainer, pl_module, "predict")
