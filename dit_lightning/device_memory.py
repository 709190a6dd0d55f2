"""Device memory after a failure: recognising an out-of-memory error, and giving the failed pass's
memory back before the step is redone. Pure PyTorch (foundation layer): the training step
(``DiTModule``) and auto-fit use the same rule for what counts as out of memory.
"""

from __future__ import annotations

import gc
import re
import traceback

import torch

_OOM_TEXT = re.compile(r"out of memory|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED", re.I)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a device out-of-memory error (CUDA, MPS, or the allocator failures of
    cuBLAS / cuDNN), as opposed to any other failure of a step."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and bool(_OOM_TEXT.search(str(error)))


def forget_failed_pass(error: BaseException) -> None:
    """Drop what an out-of-memory exception keeps alive: the frames of the failed forward / backward
    pass hold its activations (clearing them frees the memory before the step is redone)."""
    tb = error.__traceback__
    if tb is not None:
        traceback.clear_frames(tb)
    error.__traceback__ = None
    error.__context__ = error.__cause__ = None


def free_device_memory(device: torch.device) -> None:
    """Return the failed pass's cached blocks to the device, so that a safer split allocates anew."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "mps" and hasattr(torch, "mps"):
        torch.mps.empty_cache()
