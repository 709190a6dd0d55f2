"""Checkpoints that keep every run's record: one directory per run, and a ``last.ckpt`` link to
the last checkpoint of the newest run that has saved one.

With the logger's directories (``outputs/demo/version_N``) each ``fit`` writes its checkpoints
to ``outputs/demo/version_N/checkpoints``, so a second run never overwrites (or sits beside as
``last-v1.ckpt``) the first run's files, and ``outputs/demo/last.ckpt`` points at the ``last.ckpt``
of the newest run that has saved: configs and commands that name it (``--ckpt_path last``, a
teacher, ``init_from``) read that run. Only writing a checkpoint moves the link, atomically: a run
takes it when it saves for the first time (a resumed run too, not when it starts; it says so when
the link was another run's), and ``validate`` / ``test`` / ``predict`` never move it. The link is
shared by every run of a config: a script that must read the run it started (``make demo``'s test
step) takes the path the run wrote to ``last_path_file`` instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..atomic import recover_directories, remove_stale_temporaries, replace_symlink, write_text

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


_LAST_VERSION = re.compile(r"^last(-v\d+)?\.ckpt$")


def newest_last_checkpoint(dirpath: Union[str, Path]) -> Optional[Path]:
    """The newest ``last.ckpt`` (or ``last-vN.ckpt``, a second run's into the same directory) in a
    checkpoint directory, by modification time; None if there is none."""
    directory = Path(dirpath)
    if not directory.is_dir():
        return None
    found = [p for p in directory.iterdir() if _LAST_VERSION.match(p.name) and p.exists()]
    return max(found, key=lambda p: p.stat().st_mtime).resolve() if found else None


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


def _update_link(link: Path, target: Path) -> Optional[str]:
    """Point ``link`` at ``target`` (relative), atomically: readers see the old or the new link.
    Returns what the link pointed at before (None: no link)."""
    rel = os.path.relpath(target, link.parent)
    try:
        before: Optional[str] = os.readlink(link)
    except OSError:
        before = None
    try:
        replace_symlink(link, rel)
    except OSError as e:  # no symlinks on this file system: the runs' own files are still complete
        rank_zero_warn(f"could not link {link} -> {rel} ({e}); use --ckpt_path {target}")
    return before


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
    checkpoints``, Lightning's default) and ``<logger>/last.ckpt`` links to the ``last.ckpt`` of
    the newest run that has saved (only a write moves it). ``last.ckpt`` holds the final step,
    also when the run ends between two periodic saves. Temporary files left by a killed save are
    removed when a run starts.

    Args:
        latest_link: maintain the ``last.ckpt`` link in the logger's directory.
        last_path_file: a file that gets the path of this run's last checkpoint each time it is
            written (atomically): what a script evaluates next, e.g. ``make demo``'s test step,
            instead of the shared link another run may have moved.
        **kwargs: :class:`ModelCheckpoint`'s arguments.
    """

    def __init__(
        self, *args: Any, latest_link: bool = True, last_path_file: Optional[str] = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.latest_link = latest_link
        self.last_path_file = last_path_file
        self._user_dirpath = self.dirpath is not None
        self._linked: Optional[str] = None
        # the checkpoint a fit resumes (set by the CLI; the Trainer knows it only after ``setup``)
        self.resumed_from: Optional[str] = None
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

    def _ModelCheckpoint__warn_if_dir_not_empty(self, dirpath: Any) -> None:
        # Lightning warns "Checkpoint directory ... exists and is not empty" on every fit into a used
        # directory: not for a run resuming its own checkpoint there (every documented resume)
        resumed = self.resumed_from
        if resumed and dirpath and Path(resumed).resolve().parent == Path(dirpath).resolve():
            return
        ModelCheckpoint._ModelCheckpoint__warn_if_dir_not_empty(self, dirpath)  # type: ignore[attr-defined]

    def _refresh_link(self, trainer: L.Trainer) -> None:
        """This run has just written its last checkpoint (``last_model_path``): record its path in
        ``last_path_file`` and point the ``last.ckpt`` link at it, the first time this run writes it
        (so the link belongs to the newest run that has saved). Called after each write, never
        otherwise: a checkpoint path restored from a resumed or evaluated checkpoint moves nothing."""
        if not (trainer.is_global_zero and self.last_model_path):
            return
        if self.last_model_path == self._linked or not os.path.exists(self.last_model_path):
            return
        self._linked = self.last_model_path
        if self.last_path_file:
            write_text(self.last_path_file, os.path.abspath(self.last_model_path) + "\n")
        root = self.run_root
        if root is None or not self.latest_link:
            return
        link = root / LATEST
        before = _update_link(link, Path(self.last_model_path))
        run = run_directory_of(self.last_model_path, root)
        previous = run_directory_of(root / before, root) if before is not None else None
        if previous is not None and run is not None and previous != run:  # another run's: say so, once
            step = trainer.global_step
            rank_zero_info(f"{link} now points at this run's last checkpoint ({run}, step {step}), not {previous}'s")

    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, Any]) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._refresh_link(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        # Lightning saves last.ckpt at the end only when no checkpoint was saved during the run: a
        # run of 8 steps checkpointing every 5 would end with last.ckpt at step 5. The last
        # checkpoint holds the final weights.
        if self.save_last and self._last_global_step_saved != trainer.global_step and trainer.global_step > 0:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
