"""Gaussian diffusion for DiT: schedules, hybrid loss, respacing, DDPM and DDIM samplers, Min-SNR
weighting; and flow matching (SiT's stochastic interpolants, :mod:`.flow`).

Pure PyTorch + numpy (no Lightning), so notebooks and other trainers can use it directly.
"""

from __future__ import annotations

from .flow import DiffusionForm, FlowLossWeight, FlowMatching, PathType, Prediction, TimeDistribution
from .gaussian_diffusion import (
    GaussianDiffusion,
    LossType,
    ModelVarType,
    betas_for_alpha_bar,
    get_named_beta_schedule,
)
from .losses import approx_standard_normal_cdf, discretized_gaussian_log_likelihood, mean_flat, normal_kl
from .respace import SpacedDiffusion, space_timesteps
from .weighting import min_snr_weight, min_snr_weights, snr

__all__ = [
    "DiffusionForm",
    "FlowLossWeight",
    "FlowMatching",
    "GaussianDiffusion",
    "LossType",
    "ModelVarType",
    "PathType",
    "Prediction",
    "SpacedDiffusion",
    "TimeDistribution",
    "approx_standard_normal_cdf",
    "betas_for_alpha_bar",
    "create_diffusion",
    "discretized_gaussian_log_likelihood",
    "get_named_beta_schedule",
    "mean_flat",
    "min_snr_weight",
    "min_snr_weights",
    "normal_kl",
    "snr",
    "space_timesteps",
]


def create_diffusion(
    timestep_respacing: str = "",
    noise_schedule: str = "linear",
    learn_sigma: bool = True,
    diffusion_steps: int = 1000,
    sigma_small: bool = False,
    loss_type: LossType = "mse",
) -> SpacedDiffusion:
    """The diffusion DiT trains and samples with, as the reference's helper.

    ``timestep_respacing``: ``""`` keeps every step (training), ``"250"`` or ``"ddim50"``
    for sampling (see :func:`space_timesteps`). ``learn_sigma`` selects the learned-range
    variance (the model outputs 2C channels, hybrid loss); without it the variance is
    fixed, the posterior's if ``sigma_small`` else beta_t, and the loss is plain MSE.
    """
    betas = get_named_beta_schedule(noise_schedule, diffusion_steps)
    respacing = timestep_respacing or [diffusion_steps]
    if learn_sigma:
        var_type: ModelVarType = "learned_range"
    else:
        var_type = "fixed_small" if sigma_small else "fixed_large"
    return SpacedDiffusion(
        use_timesteps=space_timesteps(diffusion_steps, respacing),
        betas=betas,
        model_var_type=var_type,
        loss_type=loss_type,
    )
