"""Lightning plugins of the project: checkpoint I/O that never leaves a truncated file behind, and a
CSV logger that never deletes a run's earlier metrics."""

from __future__ import annotations

import contextlib
import csv
import os
from typing import Any, Optional, Union

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from .atomic import TMP_SUFFIX, atomic_open, save_torch, temporary_name
from .signals import signal_behind


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint I/O, but each file is written to a temporary name,
    fsync'ed and renamed into place: ``last.ckpt`` is always a complete checkpoint, even
    when the process is killed in the middle of saving (Lightning writes in place)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        try:
            save_torch(checkpoint, path)
        except Exception as error:
            # A second signal stops at once, also inside torch.save, whose zip writer then fails on
            # the half-written record ("enforce fail at inline_container.cc"): the stop is what happened
            stop = signal_behind(error)
            if stop is None:
                raise
            raise stop from None


def _remove_stale_rewrites(metrics_file: str) -> list[str]:
    """What rewrites of ``metrics_file`` killed half-way left (``.metrics.csv.<8 characters>.tmp``): its
    own temporaries only, the run's directory holds other writers' (as the checkpoint directory's
    are removed when a run starts)."""
    directory, prefix = os.path.dirname(metrics_file), temporary_name(metrics_file)
    removed = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        path = os.path.join(directory, name)
        if name.startswith(prefix) and name.endswith(TMP_SUFFIX) and os.path.isfile(path):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    return removed


class _AppendingExperimentWriter(ExperimentWriter):
    def __init__(self, log_dir: str, append: bool = True) -> None:
        self.append = append
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        if _is_local_file_protocol(self.metrics_file_path):
            for path in _remove_stale_rewrites(self.metrics_file_path):
                rank_zero_warn(f"removed {path}, left by a rewrite of {self.NAME_METRICS_FILE} that was interrupted")
        if not self.append:  # a new run in this directory: Lightning's behaviour (it warns, then starts the file anew)
            return super()._check_log_dir_exists()
        # Lightning deletes the directory's metrics.csv here; keep it, and know its columns so that
        # new rows append under them (a new column rewrites the file, every earlier row kept).
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = list(csv.DictReader(f).fieldnames or [])

    def _record_new_keys(self) -> set[str]:
        # The file's columns keep their order (Lightning re-sorts them all, which would put appended
        # values under another column of a file it did not write); new ones go at the end.
        new = set().union(*self.metrics) - set(self.metrics_keys)
        self.metrics_keys.extend(sorted(new))
        return new

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        if not _is_local_file_protocol(self.metrics_file_path):  # Lightning's own test, remote logs as it writes them
            return super()._rewrite_with_new_header(fieldnames)
        # the whole history is rewritten: atomically, so a kill or a full disk leaves the old file
        with open(self.metrics_file_path, newline="") as f:
            rows = list(csv.DictReader(f))
        with atomic_open(self.metrics_file_path, "w") as f:
            writer = csv.DictWriter(f, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows(rows)


class RunCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger``, but in a directory that already has a ``metrics.csv`` (a resumed
    fit, or ``test`` / ``validate`` / ``predict``, which may log in a run's directory) its rows are
    appended to the file's, where Lightning's deletes the file first; whatever the layout
    (``<root>/version_K``, a named or empty version, checkpoints elsewhere). Rewrites of the file
    (a new column) are atomic, and the temporary of one that was killed is removed by the next run.

    The CLI uses it in place of ``lightning.pytorch.loggers.CSVLogger`` everywhere: ``append`` is
    off only for a new ``fit`` (no ``--ckpt_path``), which starts the directory's file anew as
    Lightning's does (and says so).

    Args:
        append: keep an existing ``metrics.csv`` and append to it.
        save_dir, name, version, prefix, flush_logs_every_n_steps: as ``CSVLogger``'s.
    """

    def __init__(
        self,
        save_dir: _PATH,
        name: Optional[str] = "lightning_logs",
        version: Optional[Union[int, str]] = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
        append: bool = True,
    ) -> None:
        super().__init__(
            save_dir, name=name, version=version, prefix=prefix, flush_logs_every_n_steps=flush_logs_every_n_steps
        )
        self.append = append

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if not isinstance(self._experiment, ExperimentWriter):
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingExperimentWriter(log_dir=self.log_dir, append=self.append)
        return self._experiment
