"""Reading files the project did not write without running code from them: the one home of the
weights-only reading of foreign files and of the classes a file may name.

- :func:`read_weights` is the one ``torch.load`` of weights files read by the network and library
  layers: checkpoints (through :mod:`dit_lightning.checkpoints.safe_load`) and REPA encoder weights
  (:mod:`dit_lightning.models.encoders`). ``weights_only=True`` on the CPU, memory-mapped on
  request; what torch raises becomes one message naming the file and the fix (:func:`load_error`):
  an empty file, a truncated one, a file that is not a PyTorch file, or a pickle naming code
  (:class:`UnsafeFileError`). It never suggests ``weights_only=False``, which is how such a file
  would run its code. :func:`read_safetensors` reads a ``.safetensors`` file (no pickle at all) with
  the same messages, and :func:`read_state_dict` picks between the two by the file's name.
- :func:`resolve_class_path` imports the class a name gives only when the name is trusted: typed
  by the user, or read from a file (a checkpoint's hyper-parameters, a store's record) and
  allowed by :func:`class_path_allowed` (this package's classes, and the prefixes the user lists in
  ``DIT_LIGHTNING_TRUSTED_CLASSES``). Importing a module runs its code, so a name read from a file
  is checked before anything is imported (:class:`UntrustedClassError`).
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
from pathlib import Path
from typing import Any, NamedTuple, Union

PathLike = Union[str, Path]

# Classes a file may name: this package's, and the prefixes a user trusts (comma-separated).
TRUSTED_CLASSES_ENV = "DIT_LIGHTNING_TRUSTED_CLASSES"
PACKAGE = __name__.split(".")[0]
_CLASS_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


class UnsafeFileError(ValueError):
    """A file names code to run when unpickled; it is refused."""


class UntrustedClassError(ValueError):
    """A file names a class outside the allowlist: importing it would run its module; refused."""


class FileKind(NamedTuple):
    """How messages name a kind of file: ``label`` before its path ("checkpoint 'x.ckpt'"), ``noun``
    for what it should be ("is not a PyTorch checkpoint..."), ``fix`` for an empty or cut file."""

    label: str
    noun: str
    fix: str


CHECKPOINT = FileKind("checkpoint", "checkpoint", "Use another checkpoint, e.g. the previous one.")


def _size(path: PathLike) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _refused_code(text: str) -> Union[str, None]:
    """The global a weights-only unpickler refused (the code a pickle names), if that is the error."""
    blocked = re.search(r"GLOBAL ([\w.]+)", text)
    return blocked.group(1) if "Weights only load failed" in text and blocked else None


def _truncated(error: BaseException) -> bool:
    text = str(error)
    return "central directory" in text or "zip archive" in text or isinstance(error, (EOFError, pickle.UnpicklingError))


def unreadable_reason(path: PathLike, error: BaseException) -> str:
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


def load_error(path: PathLike, error: BaseException, kind: FileKind = CHECKPOINT) -> str:
    """One message for a file that ``torch.load(weights_only=True)`` could not read."""
    path = str(path)
    size, text = _size(path), str(error)
    code = _refused_code(text)
    if size == 0:
        return (
            f"{kind.label} '{path}' is empty (0 bytes): its write was cut short (a kill or a full disk while it "
            f"was written by a tool that does not write atomically, or an interrupted copy). {kind.fix}"
        )
    if code:
        return (
            f"{kind.label} '{path}' names code ({code}) that unpickling it would run: refused. Only tensors and "
            "plain containers are loaded from weights files (torch.load weights_only=True). If you wrote this file "
            "yourself, save its weights as a plain state dict (torch.save(model.state_dict(), ...)) or as safetensors."
        )
    if "Weights only load failed" in text:
        return (
            f"{kind.label} '{path}' ({size:,} bytes) is not a PyTorch {kind.noun} that holds only tensors: it is "
            "another kind of file, a truncated one, or a pickle of objects, which is not loaded (it could run code). "
            "Check the path, or copy / download the file again."
        )
    if _truncated(error):
        return (
            f"{kind.label} '{path}' ({size:,} bytes) is truncated or corrupt: not a complete file written by "
            f"torch.save. Copy / download it again. {kind.fix}"
        )
    first = text.splitlines()[0] if text else ""
    return f"could not read {kind.label} '{path}' ({size:,} bytes): {type(error).__name__}: {first}"


def read_weights(path: PathLike, kind: FileKind = CHECKPOINT, *, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU (the reference scripts' ``argparse.Namespace``
    allowed): ``FileNotFoundError`` naming the file when it is missing, :class:`UnsafeFileError` for a
    pickle naming code, ``ValueError`` with :func:`load_error`'s message for anything else unreadable.

    ``mmap``: map the tensors instead of reading them, so reading a checkpoint's step or settings
    costs no memory for its weights (zip-format files only: an older ``torch.save`` file is read;
    a truncated zip is read too, so that its error says "truncated" rather than torch's mmap error).
    """
    import argparse
    import warnings
    import zipfile

    import torch

    if not os.path.exists(path):
        raise FileNotFoundError(f"{kind.label} '{path}' does not exist")
    mmap = mmap and zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals([argparse.Namespace]), warnings.catch_warnings():
            # a pickle of another protocol is refused below with a clearer message than this warning
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise FileNotFoundError(f"{kind.label} '{path}' does not exist") from None
    except Exception as e:  # empty or truncated file, pickle of arbitrary objects, not a torch file...
        error = UnsafeFileError if _refused_code(str(e)) else ValueError
        raise error(load_error(path, e, kind)) from None


def read_safetensors(path: PathLike, kind: FileKind = CHECKPOINT) -> dict[str, Any]:
    """The tensors of a ``.safetensors`` file (no pickle: nothing in it can run), on the CPU; a
    ``ValueError`` naming the file for an empty, truncated or corrupt one."""
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise FileNotFoundError(f"{kind.label} '{path}' does not exist")
    size = _size(path)
    if size == 0:
        raise ValueError(f"{kind.label} '{path}' is empty (0 bytes): its write or copy was cut short. {kind.fix}")
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(
            f"{kind.label} '{path}' ({size:,} bytes) is truncated or corrupt: not a complete safetensors file "
            f"({first}). Copy / download it again. {kind.fix}"
        ) from None


def read_state_dict(path: PathLike, kind: FileKind = CHECKPOINT) -> Any:
    """A weights file's content: a ``.safetensors`` file with safetensors (preferred: it holds no
    code), anything else with :func:`read_weights` (weights only)."""
    if str(path).endswith(".safetensors"):
        return read_safetensors(path, kind)
    return read_weights(path, kind)


def trusted_prefixes() -> tuple[str, ...]:
    """The module prefixes whose classes a file may name: this package and ``DIT_LIGHTNING_TRUSTED_CLASSES``."""
    extra = (p.strip().rstrip(".") for p in os.environ.get(TRUSTED_CLASSES_ENV, "").split(","))
    return (PACKAGE, *(p for p in extra if p))


def class_path_allowed(name: str) -> bool:
    """Whether a class path read from a file may be imported (decided from the name alone)."""
    return any(name.startswith(prefix + ".") for prefix in trusted_prefixes())


def is_class_path_syntax(name: str) -> bool:
    """``package.module.Class`` in form (dotted identifiers): decided without importing anything."""
    return bool(_CLASS_PATH.fullmatch(name))


def resolve_class_path(name: str, *, trusted: bool, option: str, source: str = "a file") -> Any:
    """The object ``name`` (``package.module.Class``) names, importing its module.

    ``trusted``: the user typed the name (the command line, a config of theirs): imported as given.
    Otherwise (a name read from ``source``: a checkpoint, a store, an export's record) only
    :func:`class_path_allowed` names are imported, and anything else raises
    :class:`UntrustedClassError` before any import. ``option`` is the setting the name was given as,
    for the messages."""
    if not is_class_path_syntax(name):
        raise ValueError(f"{option} {name!r} is not a class path (package.module.Class)")
    module, _, attr = name.rpartition(".")
    if not trusted and not class_path_allowed(name):
        raise UntrustedClassError(
            f"{option} {name!r}, read from {source}, names a class outside {PACKAGE}: importing it would run the "
            f"module {module}, so it is refused. If you trust it, give it on the command line ({option} {name}) "
            f"or set {TRUSTED_CLASSES_ENV}={module}"
        )
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{option} {name!r}: cannot import {module} ({e})") from None
    if not hasattr(found, attr):
        raise ValueError(f"{option} {name!r}: the module {module} has no {attr}")
    return getattr(found, attr)


def read_json_object(path: Union[str, os.PathLike[str]], fix: str = "", context: str = "") -> dict[str, Any]:
    """A JSON object from a foreign file (a config of a model directory): a file that cannot be read or
    does not hold an object raises a ValueError naming it, ``context`` first and ``fix`` last."""
    import json

    prefix = f"{context}: " if context else ""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{prefix}cannot read {path} ({type(e).__name__}: {e}){fix and ': ' + fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{prefix}{path} holds a {type(data).__name__}, not a JSON object")
    return data
