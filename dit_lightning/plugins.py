"""Lightning plugins of the project: checkpoint I/O that never leaves a truncated file behind, and a
CSV logger that never deletes a run's earlier metrics."""

from __future__ import annotations

import csv
from typing import Any, Optional

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.plugins.io import TorchCheckpointIO

from .atomic import atomic_open, save_torch


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint I/O, but each file is written to a temporary name,
    fsync'ed and renamed into place: ``last.ckpt`` is always a complete checkpoint, even
    when the process is killed in the middle of saving (Lightning writes in place)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        save_torch(checkpoint, path)


class _AppendingExperimentWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
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
    fit, or ``test`` / ``validate`` / ``predict`` of a run's checkpoint, which log in the run's
    directory) its rows are appended to the run's, where Lightning's deletes the file first.

    The CLI uses it in place of ``lightning.pytorch.loggers.CSVLogger`` when it continues a run."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if not isinstance(self._experiment, ExperimentWriter):
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingExperimentWriter(log_dir=self.log_dir)
        return self._experiment
