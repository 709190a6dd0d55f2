"""Samplers of flow-matching models (:class:`~dit_lightning.diffusion.flow.FlowMatching`), as SiT's
``transport`` samples them: from the noise at t = 0 forwards to the data at t = 1.

- ``ode-euler`` / ``ode-heun``: the probability-flow ODE on ``num_steps`` evenly spaced times from t0
  to t1 (``num_steps - 1`` steps; Heun's second-order method takes two network evaluations a step),
  the steps torchdiffeq's fixed-grid ``euler`` / ``heun2`` take, which SiT calls.
- ``ode-dopri5``: the adaptive Dormand-Prince solver of torchdiffeq (SiT's default ODE sampler), with
  ``atol`` / ``rtol``; its step sizes are chosen for the whole batch, so a sample depends on its
  batch within the solver's tolerance (the fixed-step samplers do not).
- ``sde-euler`` / ``sde-heun``: Euler-Maruyama (or SiT's stochastic Heun) for
  ``dx = [v + w(t) score] dt + sqrt(2 w(t)) dW`` with w of ``diffusion_form`` times
  ``diffusion_norm``, on ``num_steps - 1`` steps from t0 to ``1 - last_step_size``, then SiT's last
  step (``mean``: one drift step of ``last_step_size`` without noise, ``tweedie``: the denoised
  estimate, ``euler``: one ODE step, ``none``). ``sde-euler`` with 250 steps, ``sigma`` diffusion and
  the ``mean`` last step of 0.04 is the sampler of SiT's published FIDs.

Classifier-free guidance is the caller's model function (SiT guides the network output, here the
velocity, like DiT guides epsilon); the noise of SDE step k is the keyed draw of (seed, i, k), so
sample i depends only on (seed, i).

Pure PyTorch (+ torchdiffeq for ``ode-dopri5``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Optional, get_args

import torch
from torch import Tensor

from ..diffusion.flow import FlowMatching

if TYPE_CHECKING:  # options.py imports the sampler names from here
    from .options import ResolvedSamplingOptions

FlowSampler = Literal["ode-euler", "ode-heun", "ode-dopri5", "sde-euler", "sde-heun"]
FLOW_SAMPLERS: tuple[str, ...] = get_args(FlowSampler)
LastStep = Literal["mean", "tweedie", "euler", "none"]


def is_flow_sampler(sampler: str) -> bool:
    return sampler in FLOW_SAMPLERS


def check_flow_sampling(sampler: str, flow: Optional[FlowMatching]) -> None:
    """Refuse a flow sampler for a DDPM model and a DDPM sampler for a flow model, saying which to use."""
    if is_flow_sampler(sampler) and flow is None:
        raise ValueError(
            f"sampler {sampler!r} samples flow-matching models (objective flow), and this model is trained with "
            "the DDPM objective: use ddpm, ddim or one of the diffusers schedulers (docs/sampling.md)"
        )
    if flow is not None and not is_flow_sampler(sampler):
        raise ValueError(
            f"this model is trained with flow matching (objective flow, {flow.path_type} path, {flow.prediction} "
            f"prediction): sampler {sampler!r} is for DDPM models; use one of {', '.join(FLOW_SAMPLERS)}"
        )


@torch.no_grad()
def sample_flow(
    fn: Callable[[Tensor, Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    flow: FlowMatching,
    options: ResolvedSamplingOptions,
    noise_fn: Optional[Callable[[int, Tensor], Tensor]] = None,
) -> Tensor:
    """Integrate from the unit noise ``x`` (t = 0) to data with flow sampler ``options.sampler``.

    ``fn(x, t, y)`` is the (guided) network, ``t`` the (N,) times in [0, 1]; its first C channels
    are the prediction. ``noise_fn(step, x)`` gives the noise of SDE step ``step`` (0 = the first);
    without it the steps draw from torch's generator.
    """
    sampler, num_steps = options.sampler, options.num_steps
    check_flow_sampling(sampler, flow)
    if num_steps < 2:
        raise ValueError(f"num_steps must be at least 2 for flow samplers (the times from t0 to t1), got {num_steps}")
    if options.eta:
        raise ValueError(f"eta={options.eta} is a DDIM setting: flow sampler {sampler!r} has none (use 0)")
    if options.cfg_interval is not None:
        raise ValueError("cfg_interval is given in DDPM timesteps: flow samplers do not take it (leave it unset)")
    n = x.shape[0]

    def prediction(x: Tensor, t: Tensor) -> Tensor:
        return flow.prediction_of(fn(x, t, y), x)

    def at(t: Tensor) -> Tensor:  # a time of the grid for every sample
        return torch.ones(n, device=x.device, dtype=x.dtype) * t

    if sampler.startswith("ode-"):
        t0, t1 = flow.interval(sampling=True)
        times = torch.linspace(t0, t1, num_steps).to(x.device)  # SiT's grid: float32 linspace on the CPU

        def velocity(x: Tensor, t: Tensor) -> Tensor:
            return flow.velocity(prediction(x, t), x, t)

        if sampler == "ode-dopri5":
            from torchdiffeq import odeint

            return odeint(
                lambda t, x: velocity(x, at(t)),
                x,
                times,
                method="dopri5",
                atol=[options.atol],
                rtol=[options.rtol],
            )[-1]
        for k in range(num_steps - 1):
            t, dt = times[k], times[k + 1] - times[k]
            k1 = velocity(x, at(t))
            if sampler == "ode-euler":
                x = x + dt * k1
            else:  # Heun: trapezoidal corrector on an Euler predictor
                k2 = velocity(x + dt * k1, at(t + dt))
                x = x + dt * (k1 * 0.5 + k2 * 0.5)
        return x

    form, norm = options.diffusion_form, options.diffusion_norm
    last: LastStep = options.last_step
    last_size = 0.0 if last == "none" else float(options.last_step_size)
    if last != "none" and not 0 < last_size < 1:
        raise ValueError(f"last_step_size must be in (0, 1) for the {last} last step, got {last_size}")
    if form == "sbdm" and flow.sample_eps == 0:
        raise ValueError(
            "diffusion_form sbdm diverges at t = 0, where a velocity model on the linear or GVP path starts: "
            "use sigma (SiT's default) or another form"
        )
    t0, t1 = flow.interval(sampling=True, sde=True, diffusion_form=form, last_step_size=last_size)
    if sampler == "sde-heun" and t1 == 1.0:
        raise ValueError(
            "sde-heun without a last step evaluates the score at t = 1, where sigma is 0 (NaN, in SiT too): "
            "keep a last step (last_step mean, SiT's default) or use sde-euler"
        )
    times = torch.linspace(t0, t1, num_steps)
    dt = times[1] - times[0]

    def drift(x: Tensor, t: Tensor) -> Tensor:
        return flow.sde_drift(prediction(x, t), x, t, form, norm)

    for k, tk in enumerate(times[:-1]):
        w = noise_fn(k, x) if noise_fn is not None else torch.randn_like(x)
        dw = w * torch.sqrt(dt)
        t = at(tk.to(x.device))
        if sampler == "sde-euler":
            mean = x + drift(x, t) * dt
            x = mean + torch.sqrt(2 * flow.diffusion(x, t, form, norm)) * dw
        else:  # SiT's stochastic Heun: noise first, then a Heun step of the drift
            x_hat = x + torch.sqrt(2 * flow.diffusion(x, t, form, norm)) * dw
            k1 = drift(x_hat, t)
            k2 = drift(x_hat + dt * k1, t + dt)
            x = x_hat + 0.5 * dt * (k1 + k2)
    t = at(times[-1].to(x.device))
    if last == "mean":
        return x + drift(x, t) * last_size
    if last == "euler":
        return x + flow.velocity(prediction(x, t), x, t) * last_size
    if last == "tweedie":
        a, s = flow.alpha(t[0])[0], flow.sigma(t[0])[0]  # SiT takes the batch's first time (all are t1)
        return x / a + s**2 / a * flow.score(prediction(x, t), x, t)
    return x
