"""Reading checkpoint files without running code from them, with errors that say what the file is.

- :func:`load_file` reads every checkpoint file: ``weights_only=True`` on the CPU, memory-mapped on
  request, through the package's one ``torch.load`` of foreign files
  (:func:`dit_lightning.safe_read.read_weights`, which REPA encoder weights share), and what it
  raises turned into one message by :func:`load_error`.
- :func:`load_error` (from :mod:`dit_lightning.safe_read`) turns what ``torch.load(weights_only=True)``
  raises into one message: an empty file, a file that is not a PyTorch checkpoint (random bytes, a
  truncated download), or a pickle naming code (refused: unpickling it could run anything). It never
  suggests ``weights_only=False``, which is how such a file would run its code.
  :func:`unreadable_reason` says the same in a few words, for weights files that are not
  checkpoints (Inception's).
- :func:`check_dcp_metadata` vets the ``.metadata`` file of a sharded checkpoint directory
  (``torch.distributed.checkpoint``), which torch itself reads with a plain ``pickle.load``:
  every class it names must be one of the checkpoint metadata's own data classes, checked by a
  restricted unpickler before torch (or Lightning, on resume) opens the directory.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Union

from ..safe_read import CHECKPOINT, UnsafeFileError, load_error, read_weights, unreadable_reason

__all__ = ["UnsafeCheckpointError", "check_dcp_metadata", "load_error", "load_file", "unreadable_reason"]

# What a torch.distributed.checkpoint .metadata pickle may name: the classes of its metadata module,
# the file system reader's record, torch's sizes / dtypes / layouts / memory formats, and paths.
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a layout by name (in torch's own weights-only allow-list)
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointError(UnsafeFileError):
    """A checkpoint file names code to run when unpickled; it is refused."""


def load_file(path: Union[str, Path], *, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` of a checkpoint, on the CPU: the foundation's
    :func:`~dit_lightning.safe_read.read_weights` with the checkpoint's messages (a ``ValueError``
    with :func:`load_error`'s message for what cannot be read, :class:`UnsafeFileError` for a pickle
    naming code). ``mmap``: map the tensors instead of reading them (zip-format files only)."""
    return read_weights(path, CHECKPOINT, mmap=mmap)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == _DCP_METADATA_MODULE or module == "torch":
            obj = super().find_class(module, name)  # importing these modules runs nothing of the file's
            if module == "torch" and isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
            if module == _DCP_METADATA_MODULE and isinstance(obj, type) and obj.__module__ == module:
                return obj  # its dataclasses and enums
        raise UnsafeCheckpointError(f"{module}.{name}")


def check_dcp_metadata(directory: Union[str, Path]) -> None:
    """Raise :class:`UnsafeCheckpointError` unless the ``.metadata`` of a sharded checkpoint
    directory names only checkpoint-metadata classes (it is unpickled here with a restricted
    unpickler: nothing outside that list is imported or called)."""
    path = Path(directory) / ".metadata"
    data = path.read_bytes()
    try:
        _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(
            f"the sharded checkpoint '{directory}' has a {path.name} file naming code ({e}) that torch would run when "
            "it reads the directory: refused. Sharded checkpoints written by dit-lightning name only "
            "torch.distributed.checkpoint's metadata classes."
        ) from None
    except Exception as e:
        raise ValueError(
            f"the sharded checkpoint '{directory}' has an unreadable {path.name} file ({type(e).__name__}: {e}): "
            "it is truncated or corrupt; use another checkpoint"
        ) from None
