"""Atomic file writes: a reader, or a run resumed after a kill, sees the old file or the whole new
one, never a prefix.

Every write that matters (checkpoints, exports, store shards and metadata, sample images, the
ADM ``.npz``, statistics, JSON reports) goes through :func:`atomic_write`: the bytes go to a
temporary file in the target's directory, are flushed and fsync'ed, the file is renamed over
the target (``os.replace``: atomic on POSIX and Windows) and the directory is fsync'ed so the
rename itself survives a power cut. Files get the permissions a plain ``open`` would give
(``0o666`` minus the process's umask, read once when this module is imported), not
``mkstemp``'s ``0o600``: checkpoints and stores are shared.

Temporary files are named ``.<name>.<8 random characters>.tmp`` (``mkstemp``'s names);
:func:`remove_stale_temporaries` deletes those a killed process left behind, and nothing else.

A write that fails because the disk (or the quota) is full raises :class:`OutOfSpaceError` naming
the directory, the free space and the fix, whatever library was writing (``torch.save`` reports
it as ``unexpected pos``); the target keeps its previous content. :func:`check_writable` tries a
directory before long work starts, so an unwritable output fails at once, not hours later.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Union

PathLike = Union[str, "os.PathLike[str]"]

TMP_SUFFIX = ".tmp"
# what tempfile.mkstemp(prefix=".<name>.", suffix=".tmp") creates: 8 characters of [a-z0-9_]
_TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class OutOfSpaceError(OSError):
    """A write failed because the file system (or the user's quota) is full."""

    def __str__(self) -> str:
        return str(self.strerror)


class NotWritableError(OSError):
    """An output location cannot be written (found before any work, by :func:`check_writable`)."""

    def __str__(self) -> str:
        if self.strerror is not None:
            return str(self.strerror)
        return str(self.args[0]) if self.args else "an output location cannot be written"


def _no_space_cause(error: BaseException) -> Any:
    """The out-of-space OSError behind ``error`` (itself, its cause or context), if any."""
    seen: set[int] = set()
    e: Any = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return e
        e = e.__cause__ or e.__context__
    return None


def _free_bytes(directory: str) -> Any:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _human(n: Any) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def out_of_space(path: PathLike, cause: OSError) -> OutOfSpaceError:
    """The error of a write of ``path`` that ran out of space: where, how much is free, the fix."""
    target = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(target)
    what = "disk quota exceeded" if cause.errno == errno.EDQUOT else "no space left"
    if cause.errno == errno.EFBIG:
        what = "file too large for the file system (or the process's file size limit)"
    return OutOfSpaceError(
        cause.errno,
        f"{what} on {directory} while writing {os.path.basename(target)} ({_human(_free_bytes(directory))} free): "
        "free some space there or write to another disk. Nothing partial was left behind: "
        f"{os.path.basename(target)} and the files written before are as they were",
    )


def check_writable(directory: PathLike, what: str = "output directory", fix: str = "") -> Path:
    """Prove that files can be written in ``directory`` (a temporary file, removed at once) without
    creating it: a directory that does not exist yet is probed through its nearest existing
    ancestor, which must be a writable directory. Raises :class:`NotWritableError` naming ``what``, the reason
    and ``fix`` otherwise."""
    d = os.path.abspath(os.fspath(directory))
    existing = next((p for p in [d, *map(str, Path(d).parents)] if os.path.lexists(p)), "/")
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, f"{existing} is a file, not a directory")
        fd, tmp = tempfile.mkstemp(prefix=".write-test.", suffix=TMP_SUFFIX, dir=existing)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        reason = e.strerror or str(e)
        if e.errno in _NO_SPACE:
            reason = f"no space left ({_human(_free_bytes(existing))} free)"
        elif existing != d and e.errno != errno.ENOTDIR:
            reason = f"{reason} (in {existing}, where it would be created)"
        raise NotWritableError(
            e.errno, f"cannot write the {what} {d}: {reason}. " + (fix or "Choose a writable location.")
        ) from None
    return Path(d)


def _file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


_MODE = _file_mode()


def fsync_dir(path: PathLike) -> None:
    """fsync a directory, so that a rename inside it is durable (a no-op where unsupported)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temporary_name(path: PathLike) -> str:
    """The prefix of the temporary files of ``path`` (in the same directory)."""
    return "." + os.path.basename(os.fspath(path)) + "."


@contextlib.contextmanager
def atomic_open(path: PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """``with atomic_open(path) as f: f.write(...)``: ``path`` appears complete when the block
    ends without an exception, and is left untouched (no temporary file either) when it raises."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open writes whole files: mode 'wb' or 'w', got {mode!r}")
    target = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temporary_name(target), suffix=TMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _MODE)
        os.replace(tmp, target)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        full = _no_space_cause(error)
        if full is not None and not isinstance(error, OutOfSpaceError):
            raise out_of_space(target, full) from error
        raise
    fsync_dir(directory)


def atomic_write(path: PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Write ``path`` through ``write(binary_file)`` atomically; returns the path."""
    with atomic_open(path, "wb") as f:
        write(f)
    return Path(path)


def write_bytes(path: PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def write_text(path: PathLike, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: PathLike, obj: Any, indent: int = 2) -> Path:
    """``obj`` as key-sorted JSON (deterministic bytes) ending in a newline."""
    return write_text(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n")


def save_torch(obj: Any, path: PathLike) -> Path:
    """``torch.save`` that leaves the complete file at ``path`` or nothing new."""
    import torch

    return atomic_write(path, lambda f: torch.save(obj, f))


def save_npy(path: PathLike, array: Any) -> Path:
    """A ``.npy`` file (no pickles)."""
    import numpy as np

    return atomic_write(path, lambda f: np.save(f, np.ascontiguousarray(array), allow_pickle=False))


def save_npz(path: PathLike, **arrays: Any) -> Path:
    """An uncompressed ``.npz`` of ``arrays``."""
    import numpy as np

    return atomic_write(path, lambda f: np.savez(f, **arrays))


def save_image(path: PathLike, image: Any, format: str = "PNG") -> Path:
    """A PIL image (or a uint8 (H, W) / (H, W, C) array) as ``format``."""
    if not hasattr(image, "save"):
        from PIL import Image

        image = Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[-1] == 1 else image)
    return atomic_write(path, lambda f: image.save(f, format=format))


def remove_stale_temporaries(directory: PathLike, older_than_s: float = 0.0, recursive: bool = False) -> list[str]:
    """Delete the temporary files of atomic writes that a killed process left in ``directory``
    (those last modified more than ``older_than_s`` seconds ago); returns their paths.

    A temporary file only exists while a write is in flight: pass a grace period when another
    process may be writing into the same directory right now.
    """
    root = os.fspath(directory)
    if not os.path.isdir(root):
        return []
    now = time.time()
    removed = []
    walker = os.walk(root) if recursive else [(root, [], os.listdir(root))]
    for dirpath, _, names in walker:
        for name in names:
            if not _TEMPORARY.match(name):
                continue
            full = os.path.join(dirpath, name)
            try:
                if os.path.isfile(full) and now - os.path.getmtime(full) >= older_than_s:
                    os.unlink(full)
                    removed.append(full)
            except OSError:
                continue
    return removed
