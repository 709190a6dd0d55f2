"""What the tools check about the file they are asked to write, before any work."""

from __future__ import annotations

import os

from ..atomic import check_writable


def check_new_output(output: str, overwrite: bool, directory: bool = False) -> None:
    """``output`` must not exist (unless ``overwrite``), must be a file (a directory when
    ``directory``), and its parent must be writable; raises with the fix otherwise."""
    if os.path.isdir(output) and not directory:
        raise IsADirectoryError(f"--output {output} is a directory: give the path of the file to write")
    if os.path.exists(output) and not overwrite:
        raise FileExistsError(
            f"--output {output} already exists and was left as it is: pass --overwrite true to replace it "
            "(atomically), or choose another file name"
        )
    check_writable(os.path.dirname(os.path.abspath(output)), "output directory", "Choose another --output.")
