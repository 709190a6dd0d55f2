"""Log-likelihood pieces of the variational bound: Gaussian KL and the discretized decoder.

Standalone functions on tensors (no diffusion state), as in Ho et al. 2020 and Nichol &
Dhariwal 2021. Everything is in nats; callers divide by ``log(2)`` for bits.
"""

from __future__ import annotations

import math
from typing import Union

import torch
from torch import Tensor

TensorOrFloat = Union[Tensor, float]


def mean_flat(x: Tensor) -> Tensor:
    """Mean over every dimension but the batch one: (N, ...) -> (N,)."""
    return x.mean(dim=tuple(range(1, x.ndim))) if x.ndim > 1 else x


def normal_kl(mean1: TensorOrFloat, logvar1: TensorOrFloat, mean2: TensorOrFloat, logvar2: TensorOrFloat) -> Tensor:
    """Elementwise KL(N(mean1, exp(logvar1)) || N(mean2, exp(logvar2))) in nats.

    Arguments broadcast against each other; at least one must be a tensor, whose
    dtype and device the plain floats take.
    """
    ref = next((a for a in (mean1, logvar1, mean2, logvar2) if isinstance(a, Tensor)), None)
    if ref is None:
        raise TypeError("normal_kl needs at least one tensor argument")
    mean1, logvar1, mean2, logvar2 = (
        a if isinstance(a, Tensor) else torch.tensor(a, dtype=ref.dtype, device=ref.device)
        for a in (mean1, logvar1, mean2, logvar2)
    )
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def approx_standard_normal_cdf(x: Tensor) -> Tensor:
    """Standard normal CDF by the tanh approximation (max abs error about 2e-4)."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def discretized_gaussian_log_likelihood(x: Tensor, *, means: Tensor, log_scales: Tensor) -> Tensor:
    """Elementwise log-probability (nats) of data in [-1, 1] quantized to 256 levels.

    Each value owns a bin of width 2/255 centred on it; the lowest and highest levels
    own the whole tail below / above them, so the probabilities of all levels sum to 1.
    ``log_scales`` is the log standard deviation of the Gaussian.
    """
    if not (x.shape == means.shape == log_scales.shape):
        raise ValueError(
            f"shapes differ: x {tuple(x.shape)}, means {tuple(means.shape)}, log_scales {tuple(log_scales.shape)}"
        )
    centered = x - means
    inv_stdv = torch.exp(-log_scales)
    half_bin = 1.0 / 255.0
    cdf_plus = approx_standard_normal_cdf(inv_stdv * (centered + half_bin))
    cdf_min = approx_standard_normal_cdf(inv_stdv * (centered - half_bin))
    # The clamps keep log finite where the approximation saturates to exactly 0 or 1.
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_cdf_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(
        x < -0.999,
        log_cdf_plus,
        torch.where(x > 0.999, log_one_minus_cdf_min, log_cdf_delta),
    )
