"""The training objectives, each one object (:class:`TrainingObjective`: its losses, its samplers,
its record; :mod:`.objective`, built and read back by :mod:`.registry`): DiT's Gaussian diffusion
(schedules, hybrid loss, respacing, DDPM and DDIM samplers, Min-SNR weighting) and flow matching
(SiT's stochastic interpolants and their ODE / SDE samplers, :mod:`.flow`).

Pure PyTorch + numpy (no Lightning), so notebooks and other trainers can use it directly.
"""

from __future__ import annotations

from .flow import (
    DiffusionForm,
    FlowLossWeight,
    FlowMatching,
    FlowSampler,
    LastStep,
    PathType,
    Prediction,
    TimeDistribution,
)
from .gaussian_diffusion import (
    GaussianDiffusion,
    LossType,
    ModelVarType,
    betas_for_alpha_bar,
    get_named_beta_schedule,
)
from .losses import approx_standard_normal_cdf, discretized_gaussian_log_likelihood, mean_flat, normal_kl
from .objective import DDPMObjective, ReferenceSampler, SamplerSettings, TrainingObjective
from .registry import (
    OBJECTIVE_NAMES,
    LossWeighting,
    ObjectiveName,
    ObjectiveSettings,
    build_objective,
    declared_objective,
    objective_from_record,
    recorded_objective_name,
)
from .respace import SpacedDiffusion, create_diffusion, space_timesteps
from .weighting import min_snr_weight, min_snr_weights, snr

__all__ = [
    "OBJECTIVE_NAMES",
    "DDPMObjective",
    "FlowSampler",
    "LastStep",
    "LossWeighting",
    "ObjectiveName",
    "ObjectiveSettings",
    "ReferenceSampler",
    "SamplerSettings",
    "TrainingObjective",
    "build_objective",
    "declared_objective",
    "objective_from_record",
    "recorded_objective_name",
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
