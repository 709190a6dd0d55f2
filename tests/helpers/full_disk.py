"""Run ``dit-lightning`` on a simulated full disk (no root, no loop device, no LD_PRELOAD):

    python -m tests.helpers.full_disk DIR FILES[:BYTES] -- fit --config ...

Files opened for writing under ``DIR`` (through ``open``, ``io.open`` or ``os.fdopen``, which is
what every writer of the project and of torch / numpy / PIL uses on Python file objects) fill a
disk that has room for ``FILES`` complete files: the next file gets ``BYTES`` (default 64 KiB)
written, then its ``write`` raises ``OSError(ENOSPC)`` as the kernel would, and so does every later
write under ``DIR``: the disk stays full. Once it is full, creating a directory under ``DIR``
(``os.mkdir``, under ``os.makedirs`` and ``tempfile.mkdtemp``) fails with ``ENOSPC`` too, as a new
directory needs a block; an empty file can still be created.

In a test, ``with full_disk(DIR, FILES, BYTES): main([...])`` does the same in this process (and
puts everything back afterwards).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import sys
from collections.abc import Iterator
from typing import Any

_PARTIAL = 64 * 1024


class _Disk:
    def __init__(self, root: str, files: int, room: int = _PARTIAL) -> None:
        self.root, self.files_left, self.room, self.full = os.path.realpath(root), files, room, False

    def covers(self, path: str) -> bool:
        real = os.path.realpath(path)
        return real == self.root or real.startswith(self.root + os.sep)


class _FullDiskFile:
    """A writable file of the simulated disk: delegates everything, limits ``write``."""

    def __init__(self, f: Any, disk: _Disk) -> None:
        self._f, self._disk = f, disk
        self._budget = None if disk.files_left > 0 else disk.room
        if disk.files_left > 0:
            disk.files_left -= 1

    def write(self, data: Any) -> int:
        n = len(memoryview(data).cast("B")) if not isinstance(data, str) else len(data.encode())
        if self._disk.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self._budget is not None:
            if n > self._budget or (n and not self._budget):
                if self._budget:
                    head = data[: self._budget] if isinstance(data, str) else memoryview(data).cast("B")[: self._budget]
                    self._f.write(head)
                self._budget, self._disk.full = 0, True
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self._budget -= n
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _FullDiskFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.__exit__(*exc)

    def __iter__(self) -> Any:
        return iter(self._f)


def install(root: str, files: int, room: int = _PARTIAL) -> None:
    disk = _Disk(root, files, room)
    real_open, real_fdopen = builtins.open, os.fdopen

    def writing(mode: str) -> bool:
        return any(c in mode for c in "wax+")

    def patched_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, mode, *args, **kwargs)
        if writing(mode) and isinstance(file, (str, bytes, os.PathLike)) and disk.covers(os.fsdecode(file)):
            return _FullDiskFile(f, disk)
        return f

    def patched_fdopen(fd: int, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_fdopen(fd, mode, *args, **kwargs)
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return f
        return _FullDiskFile(f, disk) if writing(mode) and disk.covers(path) else f

    real_mkdir = os.mkdir

    def patched_mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if disk.full and disk.covers(os.fsdecode(path)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fsdecode(path))
        real_mkdir(path, *args, **kwargs)

    builtins.open = patched_open
    io.open = patched_open
    os.fdopen = patched_fdopen
    os.mkdir = patched_mkdir


@contextlib.contextmanager
def full_disk(root: str, files: int, room: int = _PARTIAL) -> Iterator[None]:
    """:func:`install` for the block only (in-process tests)."""
    saved = builtins.open, io.open, os.fdopen, os.mkdir
    install(root, files, room)
    try:
        yield
    finally:
        builtins.open, io.open, os.fdopen, os.mkdir = saved


if __name__ == "__main__":
    root, files, sep, *args = sys.argv[1:]
    assert sep == "--", "usage: python -m tests.helpers.full_disk DIR FILES -- COMMAND ARGS"
    count, _, room = files.partition(":")
    install(root, int(count), int(room) if room else _PARTIAL)
    from dit_lightning.cli import main

    main(args)
