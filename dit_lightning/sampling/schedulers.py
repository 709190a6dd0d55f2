"""Fast samplers: diffusers' multistep schedulers driven by a DiT, built from the model's own betas.

DDPM and DDIM stay the diffusion's own loops (:mod:`dit_lightning.diffusion`, bit-exact with the
reference, the defaults for reproducing published FIDs). Every other sampler name is one of
diffusers' schedulers (:data:`DIFFUSERS_SAMPLERS`), configured from the model's noise schedule
by :func:`scheduler_config` (one rule, also what ``dit-lightning export --format diffusers``
writes to ``scheduler/``) and stepped here with:

- the DiT's epsilon (the learned-variance channels are dropped, as ``DiTPipeline`` does; only
  ``diffusers-ddpm`` uses them, through ``variance_type="learned_range"``);
- classifier-free guidance from the caller's model function (``guided_model_fn``);
- keyed noise, so sample ``i`` still depends only on ``(seed, i)``: x_T is the same keyed draw
  as DDPM/DDIM's (times the scheduler's ``init_noise_sigma``), and the noise of step ``k``
  is the keyed draw of ``(seed, i, k)`` where the scheduler takes it (``variance_noise``: DDIM,
  DPM-Solver SDE), else drawn from one CPU ``torch.Generator`` per sample seeded with that key
  (DDPM, Euler ancestral);
- ``clip_denoised`` as a rewrite of epsilon through the clamped x0 estimate (what the
  diffusion's DDIM does), so every scheduler clips the same way, sigma-space ones included.

Pure PyTorch + diffusers; no Lightning.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, Literal, Optional, get_args

import torch
from torch import Tensor

from ..diffusion import FlowSampler, ReferenceSampler, SamplerSettings
from ..keyed_random import sample_keys

# The diffusion's own loops (reference parity), diffusers' schedulers and, for flow-matching models,
# the ODE / SDE samplers of :mod:`dit_lightning.diffusion.flow`.
DiffusersSampler = Literal[
    "dpm++2m",
    "dpm++2m-karras",
    "dpm++2m-sde",
    "unipc",
    "deis",
    "euler",
    "euler-a",
    "diffusers-ddim",
    "diffusers-ddpm",
]
Sampler = Literal[ReferenceSampler, DiffusersSampler, FlowSampler]

# sampler -> (diffusers class, settings over scheduler_config). Timestep spacing: diffusers'
# default of each class ("linspace": from t = T-1 to 0), except DDIM/DDPM, whose default
# "leading" never visits t = T-1 (our own DDIM's even stride does the same): DDIM "trailing"
# (T-1 down to T/N - 1; its previous step is t - T/N, so it needs even spacing), DDPM
# "linspace" (it steps to the listed previous timestep, and adds no noise only at t = 0).
DIFFUSERS_SAMPLERS: dict[str, tuple[str, dict[str, Any]]] = {
    "dpm++2m": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "dpm++2m-karras": (
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True},
    ),
    "dpm++2m-sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++", "solver_order": 2}),
    "unipc": ("UniPCMultistepScheduler", {"solver_order": 2, "solver_type": "bh2"}),
    "deis": ("DEISMultistepScheduler", {"solver_order": 2}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler-a": ("EulerAncestralDiscreteScheduler", {}),
    "diffusers-ddim": ("DDIMScheduler", {"timestep_spacing": "trailing", "clip_sample": False}),
    "diffusers-ddpm": ("DDPMScheduler", {"timestep_spacing": "linspace", "clip_sample": False}),
}
if set(DIFFUSERS_SAMPLERS) != set(get_args(DiffusersSampler)):  # pragma: no cover - for whoever adds one
    raise RuntimeError("DiffusersSampler and DIFFUSERS_SAMPLERS disagree")

# Schedulers whose x0 clamp diffusers can express itself (``thresholding`` with
# ``sample_max_value=1``: the dynamic threshold s is clamped to [1, 1], i.e. clip to [-1, 1]).
_THRESHOLDING = {
    "DPMSolverMultistepScheduler",
    "UniPCMultistepScheduler",
    "DEISMultistepScheduler",
    "DDIMScheduler",
    "DDPMScheduler",
}
# Schedulers that draw their step noise themselves (no ``variance_noise`` argument), and the
# key of the per-sample generators given to them; fixed forever.
_DRAW_OWN_NOISE = {"DDPMScheduler", "EulerAncestralDiscreteScheduler"}
_KEY_GENERATOR = 0x6E5


def is_diffusers_sampler(sampler: str) -> bool:
    return sampler in DIFFUSERS_SAMPLERS


def check_sampler(sampler: str) -> None:
    """Raise a ValueError naming the choices when ``sampler`` is not a known sampler."""
    if sampler not in get_args(Sampler):
        raise ValueError(f"unknown sampler {sampler!r}: choose one of {', '.join(get_args(Sampler))}")


def scheduler_config(noise_schedule: str = "linear", diffusion_steps: int = 1000) -> dict[str, Any]:
    """The diffusers scheduler settings of a DiT's training noise: its betas (the same values as
    :func:`dit_lightning.diffusion.get_named_beta_schedule`, in diffusers' float32) and epsilon
    prediction. The one rule for the samplers and for ``export --format diffusers``."""
    config: dict[str, Any] = {"num_train_timesteps": int(diffusion_steps), "prediction_type": "epsilon"}
    if noise_schedule == "linear":
        scale = 1000.0 / diffusion_steps
        config.update(beta_schedule="linear", beta_start=scale * 1e-4, beta_end=scale * 0.02)
    elif noise_schedule in ("cosine", "squaredcos_cap_v2"):
        config.update(beta_schedule="squaredcos_cap_v2")
    else:
        raise ValueError(f"unknown noise schedule {noise_schedule!r} (expected 'linear' or 'cosine')")
    return config


def noise_schedule_of(config: dict[str, Any]) -> Optional[tuple[str, int]]:
    """``(noise_schedule, diffusion_steps)`` of a diffusers scheduler config when its betas are one
    of dit-lightning's schedules (to float32 precision), else None."""
    from diffusers import DDPMScheduler

    from ..diffusion import get_named_beta_schedule

    steps = int(config.get("num_train_timesteps", 1000))
    keys = ("num_train_timesteps", "beta_schedule", "beta_start", "beta_end", "trained_betas")
    try:
        betas = DDPMScheduler.from_config({k: config[k] for k in keys if k in config}).betas.double()
    except Exception:  # an unknown beta_schedule...
        return None
    for name in ("linear", "cosine"):
        ours = torch.from_numpy(get_named_beta_schedule(name, steps))
        if torch.allclose(betas, ours, rtol=1e-5, atol=1e-9):
            return name, steps
    return None


def build_scheduler(
    sampler: str,
    noise_schedule: str = "linear",
    diffusion_steps: int = 1000,
    learn_sigma: bool = False,
    thresholding: bool = False,
) -> Any:
    """A fresh diffusers scheduler for ``sampler`` with the model's betas.

    ``learn_sigma``: ``diffusers-ddpm`` then uses the model's variance (``learned_range``).
    ``thresholding``: let the scheduler clamp x0 to [-1, 1] itself (what an export for a pixel
    store writes, so ``DiTPipeline`` clips as dit-lightning does); the samplers here clip
    through epsilon instead (:func:`sample_with_scheduler`) and leave it off.
    """
    import diffusers

    if sampler not in DIFFUSERS_SAMPLERS:
        check_sampler(sampler)
        raise ValueError(f"{sampler!r} is the diffusion's own sampler, not a diffusers scheduler")
    class_name, settings = DIFFUSERS_SAMPLERS[sampler]
    config = {**scheduler_config(noise_schedule, diffusion_steps), **settings}
    if sampler == "diffusers-ddpm":
        config["variance_type"] = "learned_range" if learn_sigma else "fixed_small"
    if thresholding:
        if class_name not in _THRESHOLDING:
            raise ValueError(
                f"{class_name} cannot clamp x0 to [-1, 1] itself (no `thresholding`): choose another scheduler"
            )
        config.update(thresholding=True, sample_max_value=1.0)
    return getattr(diffusers, class_name).from_config(config)


def can_threshold(sampler: str) -> bool:
    """Whether the scheduler of ``sampler`` can clamp x0 to [-1, 1] by its own configuration."""
    return sampler in DIFFUSERS_SAMPLERS and DIFFUSERS_SAMPLERS[sampler][0] in _THRESHOLDING


def _per_sample_generators(indices: Tensor, seed: int, step: int) -> list[torch.Generator]:
    keys = sample_keys(indices.cpu().long(), seed, _KEY_GENERATOR, step)
    return [torch.Generator("cpu").manual_seed(int(k) & ((1 << 63) - 1)) for k in keys.tolist()]


def clipped_epsilon(x: Tensor, eps: Tensor, alpha_bar: float) -> Tensor:
    """Epsilon rewritten so that its x0 estimate is clamped to [-1, 1] (``x`` is the model's
    variance-preserving input at noise level ``alpha_bar``)."""
    a, s = math.sqrt(alpha_bar), math.sqrt(1.0 - alpha_bar)
    x0 = ((x - s * eps) / a).clamp(-1, 1)
    return (x - a * x0) / s


def _alpha_bar(scheduler: Any, k: int, t: Tensor) -> float:
    """The noise level of step ``k``: from the scheduler's sigma where it keeps one per step
    (DPM-Solver, UniPC, DEIS, Euler: sigma^2 = (1 - acp) / acp), else ``alphas_cumprod[t]``."""
    sigmas = getattr(scheduler, "sigmas", None)
    if sigmas is not None and len(sigmas) > k:
        return 1.0 / (1.0 + float(sigmas[k]) ** 2)
    return float(scheduler.alphas_cumprod[int(t)])


@torch.no_grad()
def sample_with_scheduler(
    fn: Callable[[Tensor, Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    indices: Tensor,
    options: SamplerSettings,
    *,
    seed: int,
    in_channels: int,
    learn_sigma: bool,
    noise_schedule: str = "linear",
    diffusion_steps: int = 1000,
    noise_fn: Optional[Callable[[int, Tensor], Tensor]] = None,
) -> Tensor:
    """Run diffusers scheduler ``options.sampler`` for ``options.num_steps`` steps from the unit noise ``x``.

    ``fn(x, t, y)`` is the (guided) model, returning epsilon first; ``noise_fn(step, x)`` the
    keyed noise of a step (used where the scheduler accepts ``variance_noise``).
    """
    sampler, num_steps, eta = options.sampler, options.num_steps, options.eta
    if not 1 <= num_steps <= diffusion_steps:
        raise ValueError(f"num_steps must be in 1..{diffusion_steps}, got {num_steps}")
    device = x.device
    scheduler = build_scheduler(sampler, noise_schedule, diffusion_steps, learn_sigma=learn_sigma)
    scheduler.set_timesteps(num_steps, device=device)
    if len(scheduler.timesteps) != num_steps:  # pragma: no cover - every listed scheduler is one call per step
        raise RuntimeError(f"{type(scheduler).__name__} takes {len(scheduler.timesteps)} model calls for {num_steps}")
    params = inspect.signature(scheduler.step).parameters
    if eta and "eta" not in params:
        raise ValueError(f"eta={eta} is a DDIM setting: sampler {sampler!r} has none (use 0)")
    draws_noise = type(scheduler).__name__ in _DRAW_OWN_NOISE
    full_output = sampler == "diffusers-ddpm" and learn_sigma
    n = x.shape[0]
    x = x * scheduler.init_noise_sigma
    for k, t in enumerate(scheduler.timesteps):
        model_in = scheduler.scale_model_input(x, t)
        out = fn(model_in, torch.full((n,), float(t), device=device), y)
        eps = out[:, :in_channels]
        if options.clip_denoised:
            eps = clipped_epsilon(model_in, eps, _alpha_bar(scheduler, k, t))
        model_output = torch.cat([eps, out[:, in_channels:]], dim=1) if full_output else eps
        kwargs: dict[str, Any] = {}
        if "eta" in params:
            kwargs["eta"] = eta
        if "variance_noise" in params:
            if noise_fn is not None:
                kwargs["variance_noise"] = noise_fn(k, x)
        elif draws_noise:
            kwargs["generator"] = _per_sample_generators(indices, seed, k)
        x = scheduler.step(model_output, t, x, **kwargs).prev_sample
    return x
