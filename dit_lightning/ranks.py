"""Which share of the work this process does: rank, world size and device, from explicit
arguments, an initialised process group, or torchrun's environment. Used by the tools that
shard work without Lightning (``extract``, ``sample``, ``evaluate``)."""

from __future__ import annotations

import os
from typing import Optional

import torch


def resolve_rank(rank: Optional[int] = None, world_size: Optional[int] = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the arguments, torch.distributed, or torchrun's env."""
    dist = torch.distributed
    if rank is None or world_size is None:
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        else:
            rank = int(os.environ.get("RANK", 0)) if rank is None else rank
            world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    return rank, world_size, int(os.environ.get("LOCAL_RANK", rank))


def resolve_device(device: str, local_rank: int) -> torch.device:
    """``"auto"`` is the local rank's GPU when there is one, else the CPU; ``"cuda"`` gets the local rank's index."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return dev


def join_torchrun_group(world_size: int, explicit: bool, device: torch.device) -> bool:
    """Join torchrun's process group (for a final barrier) when launched by it; True if we did."""
    dist = torch.distributed
    if explicit or world_size == 1 or not dist.is_available() or dist.is_initialized():
        return False
    if "MASTER_ADDR" not in os.environ:
        return False
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return True


def rank_indices(num_samples: int, rank: int, world_size: int) -> range:
    """Strided shares: rank r gets r, r+W, r+2W... (disjoint, together exactly 0..N-1)."""
    return range(rank, num_samples, world_size)


def close_process_group() -> None:
    """Destroy the process group a finished run leaves behind (Lightning keeps it for another fit).

    Left to interpreter exit, gloo's worker thread may still hold the run's last collective (a
    broadcast just before exit): freeing its tensors needs the GIL, which a finalising interpreter
    refuses by ending the thread, and the C++ runtime aborts ("terminate called without an active
    exception", exit -6, after a run that succeeded). Destroying the group first waits for that work."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
