"""Checkpoints that keep every run's record: one directory per run, and a ``last.ckpt`` link to
the newest run's last checkpoint.

With the logger's directories (``outputs/demo/version_N``) each ``fit`` writes its checkpoints
to ``outputs/demo/version_N/checkpoints``, so a second run never overwrites (or sits beside as
``last-v1.ckpt``) the first run's files, and ``outputs/demo/last.ckpt`` always points at the
newest run's ``last.ckpt``: configs and commands that name it (``--ckpt_path last``, a teacher,
``init_from``) read the run that just finished.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ..atomic import recover_directories, remove_stale_temporaries, replace_symlink

LATEST = "last.ckpt"
_VERSION = re.compile(r"^version_(\d+)$")


def newest_run_checkpoint(root: Union[str, Path]) -> Optional[Path]:
    """The newest run's last checkpoint under a logger root: the ``last.ckpt`` link, else the
    ``version_N/checkpoints/last.ckpt`` of the highest N that has one."""
    root = Path(root)
    link = root / LATEST
    if link.exists():
        return link.resolve()
    versions = []
    for entry in root.glob("version_*"):
        m = _VERSION.match(entry.name)
        if m and (entry / "checkpoints" / LATEST).exists():
            versions.append((int(m.group(1)), entry / "checkpoints" / LATEST))
    return max(versions)[1] if versions else None


def run_directory_of(checkpoint: Union[str, Path], root: Union[str, Path]) -> Optional[str]:
    """The version (run directory name) under ``root`` that holds ``checkpoint``, if any."""
    try:
        rel = Path(checkpoint).resolve().relative_to(Path(root).resolve())
    except ValueError:
        return None
    parts = rel.parts
    if len(parts) >= 3 and parts[1] == "checkpoints":
        return parts[0]
    return None


def run_path(template: str, trainer: L.Trainer, **fields: str) -> Path:
    """An output path of a run: ``{log_dir}`` becomes the run's directory (``trainer.log_dir``, or
    the default root without a logger) and other ``{name}`` fields the given values."""
    log_dir = trainer.log_dir or trainer.default_root_dir
    return Path(template.format(log_dir=log_dir, **fields))


def _update_link(link: Path, target: Path) -> None:
    """Point ``link`` at ``target`` (relative), atomically: readers see the old or the new link."""
    rel = os.path.relpath(target, link.parent)
    try:
        replace_symlink(link, rel)
    except OSError as e:  # no symlinks on this file system: the runs' own files are still complete
        rank_zero_warn(f"could not link {link} -> {rel} ({e}); use --ckpt_path {target}")


def _clean_up_interrupted_saves(directory: Path) -> None:
    """What a killed save left in ``directory``: a checkpoint (a sharded one: a directory) whose
    replacement stopped between its two renames is put back; temporary files and the staging
    directories of sharded saves are removed."""
    for target in recover_directories(directory):
        rank_zero_warn(f"restored {target} from the copy its interrupted replacement had moved aside")
    for path in remove_stale_temporaries(directory, older_than_s=0.0):
        rank_zero_warn(f"removed {path}, left by a checkpoint save that was interrupted")


class DiTModelCheckpoint(ModelCheckpoint):
    """:class:`ModelCheckpoint` with the run-directory layout of this module.

    Without a ``dirpath`` the checkpoints go to the run's directory (``<logger>/version_N/
    checkpoints``, Lightning's default) and ``<logger>/last.ckpt`` links to the newest run's
    ``last.ckpt``. ``last.ckpt`` holds the final step, also when the run ends between two periodic
    saves. Temporary files left by a killed save are removed when a run starts.

    Args:
        latest_link: maintain the ``last.ckpt`` link in the logger's directory.
        **kwargs: :class:`ModelCheckpoint`'s arguments.
    """

    def __init__(self, *args: Any, latest_link: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.latest_link = latest_link
        self._user_dirpath = self.dirpath is not None
        self._linked: Optional[str] = None
        self.run_root: Optional[Path] = None  # <logger>, when checkpoints live in <logger>/version_N/checkpoints

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.run_root = None
        if not self._user_dirpath and self.dirpath and trainer.loggers:
            logger = trainer.loggers[0]
            root = Path(logger.save_dir or trainer.default_root_dir) / (logger.name or "")
            if Path(self.dirpath).parent.parent.resolve() == root.resolve():
                self.run_root = root
        if trainer.is_global_zero and self.dirpath:
            # a save killed half-way leaves a temporary as large as a checkpoint, or the previous one aside
            _clean_up_interrupted_saves(Path(self.dirpath))

    def _refresh_link(self, trainer: L.Trainer) -> None:
        if not (self.latest_link and trainer.is_global_zero and self.last_model_path):
            return
        if self.last_model_path == self._linked or not os.path.exists(self.last_model_path):
            return
        root = self.run_root
        if root is None:
            return
        _update_link(root / LATEST, Path(self.last_model_path))
        self._linked = self.last_model_path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, *args, **kwargs)
        self._refresh_link(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self._refresh_link(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        self._refresh_link(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        # Lightning saves last.ckpt at the end only when no checkpoint was saved during the run: a
        # run of 8 steps checkpointing every 5 would end with last.ckpt at step 5. The last
        # checkpoint holds the final weights.
        if self.save_last and self._last_global_step_saved != trainer.global_step and trainer.global_step > 0:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        self._refresh_link(trainer)
