"""Atomic file writes: a reader, or a run resumed after a kill, sees the old file or the whole new
one, never a prefix.

Every write that matters (checkpoints, exports, store shards and metadata, sample images, the
ADM ``.npz``, statistics, JSON reports) goes through :func:`atomic_write`: the bytes go to a
temporary file in the target's directory, are flushed and fsync'ed, the file is renamed over
the target (``os.replace``: atomic on POSIX and Windows) and the directory is fsync'ed so the
rename itself survives a power cut. Files get the permissions a plain ``open`` would give
(``0o666`` minus the process's umask, read once when this module is imported), not
``mkstemp``'s ``0o600``: checkpoints and stores are shared.

Whole directories (a diffusers export, a sharded checkpoint, a store) are replaced the same way by
:func:`replace_directory`: built beside the target, fsync'ed, renamed into place; an existing
target is first moved aside and deleted once its successor is in place. A kill between those two
renames leaves the old copy beside the missing target: :func:`recover_directory` (which every
replacement runs first) puts it back, so one complete copy always exists. Directories get the mode
of a plain ``mkdir`` (``0o777`` minus the umask), not ``mkdtemp``'s ``0o700``. Symbolic links are
re-pointed atomically by :func:`replace_symlink`. This module is the only one that renames paths.

Temporary files, links and directories are named ``.<name>.<8 random characters>.tmp``
(``mkstemp``'s names); :func:`remove_stale_temporaries` deletes those a killed process left
behind, and nothing else. A copy moved aside during a replacement is
``.<name>.<8 random characters>.old``: not a temporary (it may be the only complete copy), it is
left to :func:`recover_directory`.

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
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]

TMP_SUFFIX = ".tmp"
# what tempfile.mkstemp(prefix=".<name>.", suffix=".tmp") creates: 8 characters of [a-z0-9_]
_TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")
_RANDOM_CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789_"  # tempfile's alphabet
# a target moved aside by replace_directory until its successor is in place
OLD_SUFFIX = ".old"
_MOVED_ASIDE = re.compile(r"^\.(.+)\.[a-z0-9_]{8}\.old$")


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# what renaming a directory onto an existing entry raises (a non-empty directory, a file; on Windows any entry)
_TAKEN = (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR)


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


def out_of_space(path: PathLike, cause: OSError, creating: bool = False) -> OutOfSpaceError:
    """The error of a write of ``path`` (``creating``: of the directory ``path``) that ran out of
    space: where, how much is free, the fix."""
    target = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(target)
    while directory != os.path.dirname(directory) and not os.path.isdir(directory):
        directory = os.path.dirname(directory)  # the existing directory it would be created in
    what = "disk quota exceeded" if cause.errno == errno.EDQUOT else "no space left"
    if cause.errno == errno.EFBIG:
        what = "file too large for the file system (or the process's file size limit)"
    name = os.path.relpath(target, directory)
    doing = f"creating the directory {name}" if creating else f"writing {name}"
    kept = "" if creating else f" Nothing partial was left behind: {name} and the files written before are as they were"
    return OutOfSpaceError(
        cause.errno,
        f"{what} on {directory} while {doing} ({_human(_free_bytes(directory))} free): "
        f"free some space there or write to another disk.{kept}",
    )


def make_directory(path: PathLike) -> Path:
    """``os.makedirs(path, exist_ok=True)``; a full disk (a new directory needs a block) raises
    :class:`OutOfSpaceError` naming where, as a write does."""
    target = os.path.abspath(os.fspath(path))
    try:
        os.makedirs(target, exist_ok=True)
    except OSError as e:
        if e.errno not in _NO_SPACE:
            raise
        raise out_of_space(target, e, creating=True) from e
    return Path(target)


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


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


_MODE = 0o666 & ~_umask()  # a plain open's files
_DIR_MODE = 0o777 & ~_umask()  # a plain mkdir's directories


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
    make_directory(directory)
    try:
        fd, tmp = tempfile.mkstemp(prefix=temporary_name(target), suffix=TMP_SUFFIX, dir=directory)
    except OSError as e:  # a full directory block: no room for another entry
        if e.errno in _NO_SPACE:
            raise out_of_space(target, e) from e
        raise
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


def _fresh_name(path: str, suffix: str) -> str:
    """A name beside ``path`` that does not exist yet: ``.<name>.<8 random characters><suffix>``."""
    for _ in range(100):
        random_part = "".join(secrets.choice(_RANDOM_CHARACTERS) for _ in range(8))
        candidate = os.path.join(os.path.dirname(path), temporary_name(path) + random_part + suffix)
        if not os.path.lexists(candidate):
            return candidate
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside {path}")  # pragma: no cover


def _remove(path: str) -> None:
    """Delete a file, link or directory tree, as far as possible (what is left is a temporary)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _discard(aside: str, target: str) -> None:
    """Delete a copy moved aside for ``target``. It is renamed to a temporary name first, so that a
    deletion cut short never leaves a partial tree that looks like a complete old copy."""
    garbage = _fresh_name(target, TMP_SUFFIX)
    try:
        os.rename(aside, garbage)
    except OSError:
        garbage = aside
    _remove(garbage)


def _sync_tree(root: str) -> None:
    """fsync every file under ``root`` and every directory, deepest first, so that the tree is on
    disk before the rename that publishes it."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue  # the link's target is not ours to sync
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def staging_directory(target: PathLike) -> Path:
    """Create the empty directory in which the replacement of ``target`` is built: beside it (the
    same file system, so the final rename is atomic), named ``.<name>.<8 random characters>.tmp``,
    with the mode of a plain ``mkdir``. Publish it with :func:`commit_directory`; most writers
    want :func:`replace_directory`, which does both. A staging directory a killed writer left is
    removed by :func:`remove_stale_temporaries`."""
    path = os.path.abspath(os.fspath(target))
    parent = os.path.dirname(path)
    make_directory(parent)
    staging = tempfile.mkdtemp(prefix=temporary_name(path), suffix=TMP_SUFFIX, dir=parent)
    os.chmod(staging, _DIR_MODE)  # mkdtemp's 0o700 would hide an export from the rest of the team
    return Path(staging)


def commit_directory(staging: PathLike, target: PathLike, exist_ok: bool = True) -> Path:
    """Put the finished ``staging`` directory (from :func:`staging_directory`) in place of
    ``target``: its files and directories are fsync'ed, an existing ``target`` (directory, file
    or link) is moved aside as ``.<name>.<8 random characters>.old``, ``staging`` is renamed to
    ``target`` and the old copy deleted. ``exist_ok=False``: raise :class:`FileExistsError` instead
    of replacing an existing ``target`` (``staging`` is left to the caller)."""
    new = os.path.abspath(os.fspath(staging))
    path = os.path.abspath(os.fspath(target))
    parent = os.path.dirname(path)
    if os.path.dirname(new) != parent:
        raise ValueError(f"{new} must be beside {path} (in the same directory) to be renamed into place atomically")
    _sync_tree(new)
    aside: Optional[str] = None
    if os.path.lexists(path):
        if not exist_ok:
            raise FileExistsError(errno.EEXIST, f"{path} exists", path)
        aside = _fresh_name(path, OLD_SUFFIX)
        os.rename(path, aside)
    try:
        # Between the two renames the old copy is complete beside the missing target:
        # recover_directory puts it back if this process dies here. os.rename, not os.replace: an
        # entry that appeared meanwhile (another writer) makes it fail rather than be lost.
        os.rename(new, path)
    except BaseException as error:
        if aside is not None:
            with contextlib.suppress(OSError):
                os.rename(aside, path)
        if isinstance(error, OSError) and error.errno in _TAKEN and os.path.lexists(path):
            raise FileExistsError(
                errno.EEXIST, f"{path} appeared while its replacement was put in place", path
            ) from None
        raise
    fsync_dir(parent)
    if aside is not None:
        _discard(aside, path)
    return Path(path)


@contextlib.contextmanager
def replace_directory(target: PathLike, exist_ok: bool = True) -> Iterator[Path]:
    """``with replace_directory(target) as staging: <write the files into staging>``: ``target``
    becomes that directory, complete, when the block ends without an exception (see
    :func:`commit_directory`); when it raises, ``target`` is left as it was and ``staging`` is
    deleted. An interrupted earlier replacement of ``target`` is recovered first. One writer per
    target at a time: a second one may fail, never leave a mixture.

    ``exist_ok=False`` raises :class:`FileExistsError` (and writes nothing) when ``target`` exists
    when the block ends, e.g. because another process created it meanwhile."""
    path = os.path.abspath(os.fspath(target))
    recover_directory(path)
    staging = staging_directory(path)
    try:
        yield staging
        commit_directory(staging, path, exist_ok=exist_ok)
    except BaseException as error:
        _remove(os.fspath(staging))
        full = _no_space_cause(error)
        if full is not None and not isinstance(error, OutOfSpaceError):
            raise out_of_space(path, full) from error
        raise


def recover_directory(target: PathLike) -> bool:
    """Finish what a replacement of ``target`` killed between its two renames left: when
    ``target`` is missing, the old copy moved aside is put back (returns True); a copy moved
    aside whose successor is in place is deleted. Staging directories are not touched (a writer
    may be filling one right now): :func:`remove_stale_temporaries` removes those."""
    path = os.path.abspath(os.fspath(target))
    parent = os.path.dirname(path)
    mine = re.compile(re.escape(temporary_name(path)) + r"[a-z0-9_]{8}" + re.escape(OLD_SUFFIX) + "$")
    try:
        asides = [os.path.join(parent, n) for n in sorted(os.listdir(parent)) if mine.match(n)]
    except OSError:
        return False
    restored = False
    if asides and not os.path.lexists(path):
        # normally there is one; after several interruptions the one moved aside last is the newest copy
        newest = max(asides, key=lambda p: os.lstat(p).st_ctime)
        try:
            os.rename(newest, path)
        except OSError:
            if not os.path.lexists(path):
                raise
        else:
            fsync_dir(parent)
            restored = True
            asides.remove(newest)
    if os.path.lexists(path):
        for aside in asides:
            _discard(aside, path)
    return restored


def recover_directories(directory: PathLike) -> list[Path]:
    """:func:`recover_directory` for every target in ``directory`` that has a copy moved aside;
    returns the targets that were put back."""
    root = os.fspath(directory)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    targets = sorted({m.group(1) for m in map(_MOVED_ASIDE.match, names) if m})
    return [Path(root, t) for t in targets if recover_directory(os.path.join(root, t))]


def replace_symlink(link: PathLike, target: PathLike) -> Path:
    """Make ``link`` a symbolic link to ``target`` (stored as given: pass a relative path for a
    link that survives moving the tree), atomically: readers see the old link or the new one,
    never none. The new link is made under a temporary name beside ``link`` and renamed over it.
    Raises OSError where the file system has no symbolic links (or ``link`` is a directory)."""
    path = os.path.abspath(os.fspath(link))
    tmp = _fresh_name(path, TMP_SUFFIX)
    os.symlink(os.fspath(target), tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))
    return Path(path)


def _newest_mtime(path: str) -> float:
    """The last modification under a directory tree (a staging directory is written deep inside)."""
    newest = os.lstat(path).st_mtime
    for dirpath, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            with contextlib.suppress(OSError):
                newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
    return newest


def remove_stale_temporaries(directory: PathLike, older_than_s: float = 0.0, recursive: bool = False) -> list[str]:
    """Delete the temporaries that a killed process left in ``directory``: files of atomic writes,
    links of :func:`replace_symlink`, staging directories of :func:`replace_directory` (those last
    modified more than ``older_than_s`` seconds ago, anywhere inside for a directory); returns
    their paths. Copies moved aside (``.old``) are :func:`recover_directory`'s, not touched here.

    A temporary only exists while a write is in flight: pass a grace period when another
    process may be writing into the same directory right now.
    """
    root = os.fspath(directory)
    if not os.path.isdir(root):
        return []
    now = time.time()
    removed = []
    for dirpath, names in _listing(root, recursive):
        for name in names:
            if not _TEMPORARY.match(name):
                continue
            full = os.path.join(dirpath, name)
            try:
                mode = os.lstat(full).st_mode
                if stat.S_ISDIR(mode):
                    if now - _newest_mtime(full) >= older_than_s:
                        shutil.rmtree(full)
                        removed.append(full)
                elif (stat.S_ISREG(mode) or stat.S_ISLNK(mode)) and now - os.lstat(full).st_mtime >= older_than_s:
                    os.unlink(full)
                    removed.append(full)
            except OSError:
                continue
    return removed


def _listing(root: str, recursive: bool) -> Iterator[tuple[str, list[str]]]:
    """(directory, entry names) of ``root``, and of its subdirectories when ``recursive``; a
    temporary directory is listed as an entry (removed whole), never searched."""
    if not recursive:
        yield root, sorted(os.listdir(root))
        return
    for dirpath, dirs, files in os.walk(root):
        temporaries = [d for d in dirs if _TEMPORARY.match(d)]
        dirs[:] = [d for d in dirs if d not in temporaries]
        yield dirpath, sorted(files + temporaries)
