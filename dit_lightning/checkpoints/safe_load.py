"""Reading checkpoint files without running code from them, with errors that say what the file is.

- :func:`load_file` is the one ``torch.load`` of checkpoint files: ``weights_only=True`` on the CPU,
  memory-mapped on request, and what it raises turned into one message by :func:`load_error`.
- :func:`load_error` turns what ``torch.load(weights_only=True)`` raises into one message: an empty
  file, a file that is not a PyTorch checkpoint (random bytes, a truncated download), or a pickle
  naming code (refused: unpickling it could run anything). It never suggests
  ``weights_only=False``, which is how such a file would run its code. :func:`unreadable_reason`
  says the same in a few words, for weights files that are not checkpoints (Inception's).
- :func:`check_dcp_metadata` vets the ``.metadata`` file of a sharded checkpoint directory
  (``torch.distributed.checkpoint``), which torch itself reads with a plain ``pickle.load``:
  every class it names must be one of the checkpoint metadata's own data classes, checked by a
  restricted unpickler before torch (or Lightning, on resume) opens the directory.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any, Optional, Union

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


class UnsafeCheckpointError(ValueError):
    """A checkpoint file names code to run when unpickled; it is refused."""


def _size(path: Union[str, Path]) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _refused_code(text: str) -> Optional[str]:
    """The global a weights-only unpickler refused (the code a pickle names), if that is the error."""
    blocked = re.search(r"GLOBAL ([\w.]+)", text)
    return blocked.group(1) if "Weights only load failed" in text and blocked else None


def _truncated(error: BaseException) -> bool:
    text = str(error)
    return "central directory" in text or "zip archive" in text or isinstance(error, (EOFError, pickle.UnpicklingError))


def unreadable_reason(path: Union[str, Path], error: BaseException) -> str:
    """What ``torch.load(weights_only=True)``'s ``error`` says about the file ``path``, as the end of
    a sentence that starts with its name ("... is empty (0 bytes)"): never torch's paragraph, never a
    suggestion of ``weights_only=False``. For the weights files that are not checkpoints (Inception's)."""
    size, text = _size(path), str(error)
    code = _refused_code(text)
    if size == 0:
        return "is empty (0 bytes)"
    if code:
        return f"names code ({code}) that unpickling it would run: refused"
    if "Weights only load failed" in text:
        return (
            f"({size:,} bytes) holds more than plain tensors, or is not a PyTorch file: not loaded (it could run code)"
        )
    if _truncated(error):
        return f"({size:,} bytes) is truncated or corrupt"
    first = text.splitlines()[0] if text else ""
    return f"({size:,} bytes) could not be read ({type(error).__name__}: {first})"


def load_error(path: Union[str, Path], error: BaseException) -> str:
    """One message for a checkpoint that ``torch.load(weights_only=True)`` could not read."""
    path = str(path)
    size, text = _size(path), str(error)
    code = _refused_code(text)
    if size == 0:
        return (
            f"checkpoint '{path}' is empty (0 bytes): its write was cut short (a kill or a full disk while it "
            "was written by a tool that does not write atomically). Use another checkpoint, e.g. the previous one."
        )
    if code:
        return (
            f"checkpoint '{path}' names code ({code}) that unpickling it would run: refused. Only "
            "tensors and plain containers are loaded from checkpoints (torch.load weights_only=True). If you wrote "
            "this file yourself, save its weights as a plain state dict (torch.save(model.state_dict(), ...))."
        )
    if "Weights only load failed" in text:
        return (
            f"checkpoint '{path}' ({size:,} bytes) is not a PyTorch checkpoint that holds only tensors: it is another "
            "kind of file, a truncated one, or a pickle of objects, which is not loaded (it could run code). Check "
            "the path, or copy / download the file again."
        )
    if _truncated(error):
        return (
            f"checkpoint '{path}' ({size:,} bytes) is truncated or corrupt: not a complete file written by "
            "torch.save. Copy / download it again, or use another checkpoint."
        )
    first = text.splitlines()[0] if text else ""
    return f"could not read checkpoint '{path}' ({size:,} bytes): {type(error).__name__}: {first}"


def load_file(path: Union[str, Path], *, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU (the reference scripts' ``argparse.Namespace``
    allowed), raising a ``ValueError`` with :func:`load_error`'s message for what cannot be read.

    ``mmap``: map the tensors instead of reading them, so reading a checkpoint's step or settings
    costs no memory for its weights (zip-format files only: an older ``torch.save`` file is read;
    a truncated zip is read too, so that its error says "truncated" rather than torch's mmap error).
    """
    import argparse
    import warnings
    import zipfile

    import torch

    mmap = mmap and zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals([argparse.Namespace]), warnings.catch_warnings():
            # a pickle of another protocol is refused below with a clearer message than this warning
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint '{path}' does not exist") from None
    except Exception as e:  # empty or truncated file, pickle of arbitrary objects, not a torch file...
        raise ValueError(load_error(path, e)) from None


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
