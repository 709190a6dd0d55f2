"""Counter-based random numbers: the draw for a sample is a pure function of integer keys.

Training draws its timesteps, noise and label dropout from (seed, optimizer step, sample
index) rather than from a stateful generator. That makes a run independent of its process
layout (2 ranks x 8 samples draw exactly what 1 process x 16 samples draws), and a resumed
run draws exactly what the uninterrupted run drew. Everything is vectorised int64 arithmetic
on the target device (splitmix64 hashing), so it costs a few elementwise kernels per step.
torch's own generators cannot do this: they are sequential streams, not keyed functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: Tensor) -> Tensor:
    """The splitmix64 finaliser: a bijective mixing of int64 values (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def sample_keys(index: Tensor, *keys: int) -> Tensor:
    """One int64 key per sample from its index and any number of scalar keys (seed, step...)."""
    h = torch.zeros_like(index, dtype=torch.int64)
    for k in keys:
        h = splitmix64(h ^ int(k))
    return splitmix64(h ^ index.to(torch.int64))


def _bits(keys: Tensor, n: int, stream: int) -> Tensor:
    counters = torch.arange(n, device=keys.device, dtype=torch.int64) + (stream << 40)
    return splitmix64(keys[:, None] ^ splitmix64(counters)[None, :])


def keyed_uniform(keys: Tensor, shape: Sequence[int] = (), stream: int = 0) -> Tensor:
    """Uniform floats in (0, 1) of shape (len(keys), *shape), float32."""
    n = math.prod(shape)
    u = (_shr(_bits(keys, max(n, 1), stream), 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return u.reshape(len(keys), *shape) if shape else u[:, 0]


def keyed_normal(keys: Tensor, shape: Sequence[int], stream: int = 0) -> Tensor:
    """Standard normal floats of shape (len(keys), *shape), float32 (Box-Muller)."""
    u1 = keyed_uniform(keys, shape, stream=2 * stream + 1)
    u2 = keyed_uniform(keys, shape, stream=2 * stream + 2)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


def keyed_randint(keys: Tensor, high: int, stream: int = 0) -> Tensor:
    """Integers uniform in [0, high), one per key."""
    return (keyed_uniform(keys, (), stream=stream) * high).long().clamp_(max=high - 1)
