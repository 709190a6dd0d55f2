"""The foundation's device-memory helpers (dit_lightning/device_memory.py) and file hashes
(dit_lightning/hashing.py): one rule each, used by the training step, auto-fit, the store, the
REPA record and the Inception weights check."""

from __future__ import annotations

import hashlib

import torch

from dit_lightning.device_memory import forget_failed_pass, free_device_memory, is_out_of_memory
from dit_lightning.hashing import file_sha256, tree_sha256


def test_out_of_memory_errors_of_every_device_kind_and_nothing_else():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GB)"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not an error a device raises


def test_a_failed_pass_is_forgotten_and_memory_freed_on_the_cpu():
    def failing() -> None:
        activations = torch.ones(4)  # noqa: F841 - held by the frame the traceback keeps
        raise RuntimeError("CUDA out of memory")

    try:
        try:
            failing()
        except RuntimeError as inner:
            raise RuntimeError("CUDA out of memory (retry)") from inner
    except RuntimeError as error:
        assert error.__traceback__ is not None and error.__cause__ is not None
        forget_failed_pass(error)
        assert error.__traceback__ is None and error.__cause__ is None and error.__context__ is None
    free_device_memory(torch.device("cpu"))  # nothing to give back on the CPU: no error


def test_file_and_tree_hashes(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.bin").write_bytes(b"x" * (5 << 20))  # more than one 4 MiB block
    (tmp_path / "b" / "c.txt").write_bytes(b"c")
    assert file_sha256(tmp_path / "a.bin") == hashlib.sha256(b"x" * (5 << 20)).hexdigest()
    before = tree_sha256(tmp_path)
    assert tree_sha256(tmp_path) == before  # the walk's order is fixed
    (tmp_path / "b" / "c.txt").rename(tmp_path / "b" / "d.txt")  # same bytes, another name
    assert tree_sha256(tmp_path) != before
