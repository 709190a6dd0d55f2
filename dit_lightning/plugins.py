"""Lightning plugins of the project: checkpoint I/O that never leaves a truncated file behind."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.plugins.io import TorchCheckpointIO

from .atomic import save_torch


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint I/O, but each file is written to a temporary name,
    fsync'ed and renamed into place: ``last.ckpt`` is always a complete checkpoint, even
    when the process is killed in the middle of saving (Lightning writes in place)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        save_torch(checkpoint, path)
