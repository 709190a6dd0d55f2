"""The latent transform: what turns a VAE's raw latents into the values the DiT trains on, and back.

One object, :class:`LatentTransform`, of three kinds (docs/data.md, "Latent transforms"):

* ``pixels``: the store holds pixels in [-1, 1] (``vae: none/pixels``); identity.
* ``scale``: diffusers' ``scaling_factor`` and ``shift_factor`` as diffusers applies them,
  ``z = (x - shift) * scale``, decoded ``x = z / scale + shift`` (DiT's SD-VAE: scale 0.18215,
  no shift; SD3 / FLUX's 16-channel VAEs: with a shift).
* ``channel_stats``: LightningDiT's per-channel normalisation, ``z = (x - mean) / std * multiplier``,
  with the mean and (unbiased) standard deviation of every channel measured over the store
  (:func:`channel_statistics`).

Every kind is an affine map per channel, ``z = a * x + b``; its record (a plain JSON dict) travels
in the store's ``meta.json`` / ``plan.json`` and in every checkpoint (the module's
``latent_transform`` hyper-parameter). Records written before it existed read through
:func:`legacy_transform`: pixel stores as ``pixels``, VAE stores as ``scale`` with their
``scale_factor``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import Tensor

TransformKind = Literal["pixels", "scale", "channel_stats"]
KINDS: tuple[str, ...] = ("pixels", "scale", "channel_stats")
# LightningDiT's rule (datasets/img_latent_dataset.py): statistics over at most this many samples
STATS_MAX_SAMPLES = 10_000
STATS_SEED = 0  # the seed of the random subset of a larger store (a store's numbers never change)
_REL_TOL = 1e-6  # records are compared up to float32 rounding (a JSON round trip is exact anyway)


@dataclass(frozen=True)
class LatentTransform:
    """Raw VAE latents <-> model latents (``forward`` / ``inverse``) on ``(N, C, H, W)`` tensors.

    Build one with :meth:`pixels`, :meth:`scaled`, :meth:`channel_stats` or :meth:`from_record`.
    A ``channel_stats`` transform planned but not measured yet (``mean``/``std`` None) has a record
    but no map: :attr:`measured` is False and :meth:`forward` refuses.
    """

    kind: TransformKind
    scale: float = 1.0
    shift: float = 0.0
    mean: Optional[tuple[float, ...]] = None
    std: Optional[tuple[float, ...]] = None
    multiplier: float = 1.0
    samples: Optional[int] = None  # how many latents the statistics were measured over (information)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"latent transform kind {self.kind!r}: use one of {', '.join(KINDS)}")
        if self.kind == "scale" and not (math.isfinite(self.scale) and self.scale > 0 and math.isfinite(self.shift)):
            raise ValueError(f"latent transform 'scale': scale must be positive and finite, got {self.scale}")
        if self.kind == "channel_stats":
            if not (math.isfinite(self.multiplier) and self.multiplier > 0):
                raise ValueError(
                    f"latent transform 'channel_stats': multiplier must be positive, got {self.multiplier}"
                )
            if (self.mean is None) != (self.std is None):
                raise ValueError("latent transform 'channel_stats': give both mean and std, or neither (not measured)")
            if self.mean is not None and self.std is not None:
                if len(self.mean) != len(self.std) or not self.mean:
                    raise ValueError(
                        f"latent transform 'channel_stats': {len(self.mean)} means for {len(self.std)} stds"
                    )
                if not all(math.isfinite(m) for m in self.mean) or not all(
                    s > 0 and math.isfinite(s) for s in self.std
                ):
                    raise ValueError(
                        "latent transform 'channel_stats': every std must be positive and every statistic finite "
                        "(a channel the VAE never varies cannot be normalised: use --latent_norm scale)"
                    )

    # -- construction -----------------------------------------------------------------

    @classmethod
    def pixels(cls) -> LatentTransform:
        return cls("pixels")

    @classmethod
    def scaled(cls, scale: float, shift: Optional[float] = None) -> LatentTransform:
        """diffusers' ``scaling_factor`` / ``shift_factor`` (a missing shift is 0)."""
        return cls("scale", scale=float(scale), shift=float(shift or 0.0))

    @classmethod
    def channel_stats(
        cls,
        mean: Optional[Sequence[float]] = None,
        std: Optional[Sequence[float]] = None,
        multiplier: float = 1.0,
        samples: Optional[int] = None,
    ) -> LatentTransform:
        """LightningDiT's normalisation; without ``mean``/``std``: planned, to be measured."""
        return cls(
            "channel_stats",
            mean=tuple(float(v) for v in mean) if mean is not None else None,
            std=tuple(float(v) for v in std) if std is not None else None,
            multiplier=float(multiplier),
            samples=int(samples) if samples is not None else None,
        )

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> LatentTransform:
        """The transform a record (:meth:`record`) describes; a bad record raises ValueError naming it."""
        if not isinstance(record, Mapping) or record.get("kind") not in KINDS:
            raise ValueError(f"not a latent transform record (kind one of {', '.join(KINDS)}): {record!r}")
        kind = record["kind"]
        if kind == "pixels":
            return cls.pixels()
        if kind == "scale":
            return cls.scaled(float(record.get("scale", 1.0)), record.get("shift"))
        return cls.channel_stats(
            record.get("mean"), record.get("std"), float(record.get("multiplier", 1.0)), record.get("samples")
        )

    def record(self) -> dict[str, Any]:
        """A plain JSON-able dict: the store's and the checkpoint's record."""
        if self.kind == "pixels":
            return {"kind": "pixels"}
        if self.kind == "scale":
            return {"kind": "scale", "scale": self.scale, "shift": self.shift}
        out: dict[str, Any] = {"kind": "channel_stats", "multiplier": self.multiplier}
        if self.mean is not None and self.std is not None:
            out.update(mean=list(self.mean), std=list(self.std), samples=self.samples)
        return out

    # -- the map ----------------------------------------------------------------------

    @property
    def measured(self) -> bool:
        """Whether the map is known (False only for a ``channel_stats`` plan not measured yet)."""
        return self.kind != "channel_stats" or self.mean is not None

    @property
    def channels(self) -> Optional[int]:
        """The channels a ``channel_stats`` transform is for (None: any)."""
        return len(self.mean) if self.mean is not None else None

    def coefficients(self, channels: int) -> tuple[list[float], list[float]]:
        """``(a, b)`` per channel with ``model = a * raw + b`` (the reader's fused form)."""
        self._check(channels)
        if self.kind == "pixels":
            return [1.0] * channels, [0.0] * channels
        if self.kind == "scale":
            return [self.scale] * channels, [-self.shift * self.scale] * channels
        assert self.mean is not None and self.std is not None
        a = [self.multiplier / s for s in self.std]
        return a, [-m * k for m, k in zip(self.mean, a)]

    def inverse_coefficients(self, channels: int) -> tuple[list[float], list[float]]:
        """``(a, c)`` per channel with ``raw = a * model + c`` (folded into an exported VAE's decoder)."""
        self._check(channels)
        if self.kind == "pixels":
            return [1.0] * channels, [0.0] * channels
        if self.kind == "scale":
            return [1.0 / self.scale] * channels, [self.shift] * channels
        assert self.mean is not None and self.std is not None
        return [s / self.multiplier for s in self.std], list(self.mean)

    def forward(self, x: Tensor) -> Tensor:
        """Raw VAE latents (N, C, H, W) -> the model's latents, in ``x``'s dtype and device."""
        self._check(x.shape[1])
        if self.kind == "pixels":
            return x
        if self.kind == "scale":
            return (x - self.shift) * self.scale
        mean, std = self._stats(x)
        return (x - mean) / std * self.multiplier

    def inverse(self, z: Tensor) -> Tensor:
        """The model's latents (N, C, H, W) -> raw VAE latents: the exact inverse of :meth:`forward`."""
        self._check(z.shape[1])
        if self.kind == "pixels":
            return z
        if self.kind == "scale":
            return z / self.scale + self.shift
        mean, std = self._stats(z)
        return z / self.multiplier * std + mean  # LightningDiT's inference.py

    def _stats(self, x: Tensor) -> tuple[Tensor, Tensor]:
        assert self.mean is not None and self.std is not None
        shape = (1, len(self.mean), 1, 1)
        mean = torch.tensor(self.mean, dtype=torch.float64).to(x.device, x.dtype).view(shape)
        std = torch.tensor(self.std, dtype=torch.float64).to(x.device, x.dtype).view(shape)
        return mean, std

    def _check(self, channels: int) -> None:
        if not self.measured:
            raise ValueError(
                "the latent transform 'channel_stats' has no statistics yet: the store's extraction has not "
                "finished (rerun the same `dit-lightning extract` command to measure them)"
            )
        if self.channels is not None and int(channels) != self.channels:
            raise ValueError(
                f"the latent transform's statistics are for {self.channels} channels, the latents have {channels}"
            )

    # -- comparison -------------------------------------------------------------------

    def describe(self) -> str:
        """The transform in words, for messages."""
        if self.kind == "pixels":
            return "pixels in [-1, 1] (no VAE)"
        if self.kind == "scale":
            return f"scale {self.scale:g}" + (f", shift {self.shift:g}" if self.shift else "")
        if self.mean is None or self.std is None:
            return f"per-channel statistics (not measured), multiplier {self.multiplier:g}"
        means = ", ".join(f"{v:.4g}" for v in self.mean[:3]) + (", ..." if len(self.mean) > 3 else "")
        stds = ", ".join(f"{v:.4g}" for v in self.std[:3]) + (", ..." if len(self.std) > 3 else "")
        channels = len(self.mean)
        return f"per-channel statistics of {channels} channels (mean {means}; std {stds}), x {self.multiplier:g}"

    def difference(self, other: LatentTransform) -> Optional[str]:
        """Why latents made with ``other`` are not this transform's (None: the same map)."""
        if self.kind != other.kind:
            return f"{self.describe()} vs {other.describe()}"
        if self.kind == "scale" and not (_close(self.scale, other.scale) and _close(self.shift, other.shift)):
            return f"{self.describe()} vs {other.describe()}"
        if self.kind == "channel_stats":
            unmeasured = self.mean is None and other.mean is None  # the same plan
            same = _close(self.multiplier, other.multiplier) and (
                unmeasured
                or (
                    self.mean is not None
                    and other.mean is not None
                    and self.std is not None
                    and other.std is not None
                    and len(self.mean) == len(other.mean)
                    and all(_close(a, b) for a, b in zip(self.mean + self.std, other.mean + other.std))
                )
            )
            if not same:
                return f"{self.describe()} vs {other.describe()}"
        return None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _REL_TOL * max(abs(a), abs(b), 1e-12)


def legacy_transform(vae: Optional[str], scale_factor: Optional[float]) -> LatentTransform:
    """The transform of a store or checkpoint written before transforms were recorded: ``pixels`` for
    a pixel store (``vae`` empty or ``none/...``), else ``scale`` with its ``scale_factor``."""
    if not vae or vae.startswith("none"):
        return LatentTransform.pixels()
    return LatentTransform.scaled(float(scale_factor) if scale_factor is not None else 0.18215)


def transform_of(settings: Mapping[str, Any]) -> Optional[LatentTransform]:
    """The transform a record of settings (a store's ``meta.json``, a checkpoint's hyper-parameters)
    holds: its ``latent_transform`` record, else the legacy reading of its ``vae`` / ``scale_factor``;
    None when it does not say (a released raw state dict, a run that named no VAE, a VAE without its
    ``scale_factor``: the caller falls back to what it knows, the store's or the default factor)."""
    record = settings.get("latent_transform")
    if isinstance(record, Mapping):
        return LatentTransform.from_record(record)
    vae = settings.get("vae")
    if not isinstance(vae, str) or not vae:
        return None  # a run that named no VAE: its data said what it was, the record does not
    if vae.startswith("none"):
        return LatentTransform.pixels()  # a pixel store has no factor to record
    scale = settings.get("scale_factor")
    if scale is None and vae in ("ema", "mse"):
        scale = 0.18215  # the reference DiT's args (--vae ema|mse): its SD VAEs at its fixed factor
    return LatentTransform.scaled(float(scale)) if scale is not None else None


def stats_indices(count: int, max_samples: int = STATS_MAX_SAMPLES, seed: int = STATS_SEED) -> list[int]:
    """The samples of a store of ``count`` the statistics are measured over: all of them up to
    ``max_samples``, else a seeded random ``max_samples`` (without replacement), sorted."""
    if count <= max_samples:
        return list(range(count))
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(count, generator=g)[:max_samples].tolist())


class ChannelMoments:
    """Per-channel mean and unbiased standard deviation of latents fed in chunks of (N, C, H, W),
    in float64 with Chan's pairwise merge (exact to rounding, whatever the chunking): the numbers
    of LightningDiT's ``latents.mean / std(dim=[0, 2, 3])`` over the same latents."""

    def __init__(self) -> None:
        self.n = 0
        self.mean: Optional[Tensor] = None
        self.m2: Optional[Tensor] = None

    def update(self, x: Tensor) -> None:
        x = x.to(torch.float64)
        flat = x.transpose(0, 1).reshape(x.shape[1], -1)  # (C, N*H*W)
        k = flat.shape[1]
        if k == 0:
            return
        mean = flat.mean(dim=1)
        m2 = ((flat - mean[:, None]) ** 2).sum(dim=1)
        if self.mean is None or self.m2 is None:
            self.n, self.mean, self.m2 = k, mean, m2
            return
        n = self.n + k
        delta = mean - self.mean
        self.mean = self.mean + delta * (k / n)
        self.m2 = self.m2 + m2 + delta**2 * (self.n * k / n)
        self.n = n

    def result(self) -> tuple[list[float], list[float]]:
        """(mean, std) per channel; needs at least two values per channel."""
        if self.mean is None or self.m2 is None or self.n < 2:
            raise ValueError("channel statistics need at least two latent values per channel")
        return self.mean.tolist(), (self.m2 / (self.n - 1)).sqrt().tolist()


def channel_statistics(latents: Tensor) -> tuple[list[float], list[float]]:
    """Per-channel mean and unbiased std of (N, C, H, W) latents (one chunk of :class:`ChannelMoments`)."""
    moments = ChannelMoments()
    moments.update(latents)
    return moments.result()
