"""Counter-based random numbers: pure functions of (seed, epoch, sample index, element).

Why not ``torch.Generator``/``np.random.Generator``: the augmentation of sample ``i`` in epoch
``e`` must not depend on which process, worker or batch reads it (so 2 DDP ranks see exactly
what 1 process sees with the doubled batch), and one generator per sample is far too slow.
A counter-based generator maps the coordinates straight to random bits, vectorised in numpy:

* ``key(seed, epoch, i) = mix64(mix64(mix64(seed + G) + epoch) + (i + 1) * G)`` where ``mix64`` is
  the splitmix64 finaliser and ``G = 0x9E3779B97F4A7C15`` (the golden-ratio increment),
* word ``m`` of sample ``i`` is ``mix64(key + (m + 1) * G)`` (a splitmix64 stream seeded by the key);
  word 0 decides the flip, words ``1..P`` feed the Gaussian noise,
* each noise word gives two 23-bit uniforms (its high and low halves, turned into floats by
  bit-casting into [1, 2)), and Box-Muller turns them into two standard normals: the first half
  of the ``E`` noise elements are the cosines, the second half the sines (``P = ceil(E / 2)``).

All arithmetic is modulo 2**64, so results are identical on every platform. The work is done
in chunks that stay in the CPU cache, with preallocated buffers (``NoiseKernel``), because a
naive implementation spends most of its time allocating and page-faulting temporaries.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

_U64 = np.uint64
GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def mix64_int(z: int) -> int:
    """splitmix64 finaliser on a Python int (used for the scalar seed/epoch part)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def mix64_(z: np.ndarray, tmp: Optional[np.ndarray] = None) -> np.ndarray:
    """splitmix64 finaliser applied in place to a uint64 array (wraps modulo 2**64)."""
    if tmp is None:
        tmp = np.empty_like(z)
    np.right_shift(z, _U64(30), out=tmp)
    np.bitwise_xor(z, tmp, out=z)
    np.multiply(z, _U64(_M1), out=z)
    np.right_shift(z, _U64(27), out=tmp)
    np.bitwise_xor(z, tmp, out=z)
    np.multiply(z, _U64(_M2), out=z)
    np.right_shift(z, _U64(31), out=tmp)
    np.bitwise_xor(z, tmp, out=z)
    return z


def epoch_key(seed: int, epoch: int) -> int:
    """The scalar key shared by all samples of one (seed, epoch)."""
    return mix64_int(mix64_int(int(seed) + GOLDEN) + int(epoch))


def sample_keys(seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """Per-sample 64-bit keys (uint64 array shaped like ``indices``)."""
    idx = np.asarray(indices).astype(np.uint64)
    keys = (idx + _U64(1)) * _U64(GOLDEN) + _U64(epoch_key(seed, epoch))
    return mix64_(keys)


def flip_bits(seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """0/1 flip decision per sample (int64), word 0 of each sample's stream."""
    w = sample_keys(seed, epoch, indices) + _U64(GOLDEN)
    mix64_(w)
    return (w >> _U64(63)).astype(np.int64)


class NoiseKernel:
    """Generates standard normal noise ``(B, E)`` for given sample indices, chunk by chunk.

    Reusable buffers make repeated calls (one per batch) cheap; one instance per worker.
    """

    def __init__(self, num_elements: int, chunk_pairs: int = 1 << 16) -> None:
        self.E = int(num_elements)
        self.P = (self.E + 1) // 2
        # samples per chunk: keep the uint64 working set around 256 KiB so it stays in L2
        self.chunk = max(1, chunk_pairs // self.P)
        n = self.chunk * self.P
        self._z = np.empty(n, np.uint64)
        self._t = np.empty(n, np.uint64)
        self._counters = (np.arange(self.P, dtype=np.uint64) + _U64(2)) * _U64(GOLDEN)
        self._std: Optional[np.ndarray] = None  # posterior_sample's scratch, allocated on first use

    def _normals_chunk(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Box-Muller inputs for ``len(keys)`` samples: (radius, angle), each (c, P) float32 views.

        Word ``p`` of a sample holds 64 random bits; seen as 2P 32-bit halves per sample, the
        first P halves give u1 (radius) and the last P give u2 (angle). Working on the halves
        as one contiguous array keeps every pass a plain SIMD loop.
        """
        c, P = len(keys), self.P
        z, t = self._z[: c * P].reshape(c, P), self._t[: c * P]
        np.add(keys[:, None], self._counters[None, :], out=z)
        mix64_(z.reshape(-1), t)
        w = z.view(np.uint32)  # (c, 2P)
        # 23 random bits | exponent of 1.0 -> a float uniform in [1, 2), no int->float conversion
        np.right_shift(w, np.uint32(9), out=w)
        np.bitwise_or(w, np.uint32(0x3F800000), out=w)
        f = w.view(np.float32)
        r, ang = f[:, :P], f[:, P:]
        np.subtract(np.float32(2.0), r, out=r)  # (0, 1]: log is finite
        np.log(r, out=r)
        np.multiply(r, np.float32(-2.0), out=r)
        np.sqrt(r, out=r)
        # angle 2*pi*u with u in [1, 2): the same cos/sin as [0, 2*pi), one pass fewer
        np.multiply(ang, np.float32(2.0 * math.pi), out=ang)
        return r, ang

    def normal(self, seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
        """Standard normal noise of shape (len(indices), E), float32."""
        keys = sample_keys(seed, epoch, indices)
        out = np.empty((len(keys), self.E), np.float32)
        for s in range(0, len(keys), self.chunk):
            self._fill(out[s : s + self.chunk], keys[s : s + self.chunk])
        return out

    def _fill(self, out: np.ndarray, keys: np.ndarray) -> None:
        r, ang = self._normals_chunk(keys)
        P, E = self.P, self.E
        np.cos(ang, out=out[:, :P])
        out[:, :P] *= r
        np.sin(ang[:, : E - P], out=out[:, P:])
        out[:, P:] *= r[:, : E - P]

    def posterior_sample(
        self,
        mean: np.ndarray,
        logvar: np.ndarray,
        seed: int,
        epoch: int,
        indices: np.ndarray,
        scale: float,
        out: Optional[np.ndarray] = None,
    ) -> np.ndarray:
        """``(mean + exp(0.5 * logvar) * eps) * scale`` as float32 (B, E), fused per chunk.

        ``mean``/``logvar`` are (B, E) float32, float16 or uint16 (raw bfloat16 bits).
        """
        B = len(indices)
        if out is None:
            out = np.empty((B, self.E), np.float32)
        keys = sample_keys(seed, epoch, indices)
        c = self.chunk
        if self._std is None:
            self._std = np.empty((c, self.E), np.float32)
        std = self._std
        for s in range(0, B, c):
            e = min(B, s + c)
            o = out[s:e]
            sd = std[: e - s]
            self._fill(o, keys[s:e])  # o = eps
            to_float32(logvar[s:e], out=sd)
            sd *= np.float32(0.5)
            np.exp(sd, out=sd)
            o *= sd
            to_float32(mean[s:e], out=sd)
            o += sd
            if scale != 1.0:
                o *= np.float32(scale)
        return out


# Below this many elements torch copies on the calling thread; above it, it wakes its intra-op
# pool, which on a busy 2-core host costs far more than the copy itself.
_SERIAL_PIECE = 16384


def to_float32(a: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """float16/float32, or uint16 holding raw bfloat16 bits, -> float32 (strided input is fine).

    The conversion goes through torch because numpy's float16 cast is scalar code (~20x
    slower than torch's F16C/AVX path), which would dominate the loader. It is done in
    pieces below torch's parallel grain size so that it stays on the calling thread.
    """
    if out is None:
        out = np.empty(a.shape, np.float32)
    src = torch.from_numpy(a) if a.flags.writeable else torch.from_numpy(a.copy())
    if a.dtype == np.uint16:
        src = src.view(torch.bfloat16)
    dst = torch.from_numpy(out)
    if src.dim() == 0 or torch.get_num_threads() == 1:  # e.g. in DataLoader workers
        dst.copy_(src)
        return out
    rows = max(1, _SERIAL_PIECE // max(1, src[0].numel()))
    for s in range(0, src.shape[0], rows):
        dst[s : s + rows].copy_(src[s : s + rows])
    return out
