"""Sample-file helpers (importable as tests.helpers.samples)."""

from __future__ import annotations

import numpy as np

# `sample` command settings for tiny models: few steps, no progress bar, on the CPU.
FAST = dict(num_steps=6, progress=False, device="cpu")


def read_npz(path):
    """The images of an ADM-format ``.npz`` (asserting it holds ``arr_0`` only)."""
    with np.load(path) as z:
        assert z.files == ["arr_0"]
        return z["arr_0"]
