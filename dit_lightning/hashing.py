"""File hashes: the sha256 of a file's bytes and of a directory tree. One rule for every record
that identifies a file by its content (store shards and their commit records, REPA encoder
weights, InceptionV3 weights)."""

from __future__ import annotations

import hashlib
import os
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]


def file_sha256(path: PathLike) -> str:
    """The sha256 of a file's bytes, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def tree_sha256(root: PathLike) -> str:
    """The sha256 of a directory: each file's path (relative, sorted) and the sha256 of its bytes."""
    h = hashlib.sha256()
    for dirpath, dirnames, files in os.walk(root):
        dirnames.sort()  # os.walk descends in this order
        for name in sorted(files):
            full = os.path.join(dirpath, name)
            h.update(f"{os.path.relpath(full, root)}\0{file_sha256(full)}\n".encode())
    return h.hexdigest()
