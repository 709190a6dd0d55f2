"""The sampling loop: noise, classifier-free guidance, DDPM / DDIM steps (or a diffusers
scheduler's, :mod:`.schedulers`; or, for flow-matching models, SiT's ODE / SDE samplers, :mod:`.flow`).
Nothing else.

Every random number of sample ``i`` (its initial noise, the noise of every DDPM / DDIM step) is
a pure function of ``(seed, i, step)`` drawn with :mod:`dit_lightning.keyed_random`, not of a
sequential generator; so sample ``i`` is the same image whatever the batch size, the number of
ranks or the resume point (up to the last-bit differences batched GEMMs of different sizes may
show). The module, the callbacks and the ``sample`` command all call :func:`sample_latents`, with
the one :class:`~.options.SamplingOptions`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor

from ..diffusion import FlowMatching, SpacedDiffusion, create_diffusion
from ..keyed_random import keyed_normal, sample_keys
from ..models.dit import DiT
from ..precision import SamplingPrecision, autocast, to_dtype
from ..signals import stop_point
from .flow import check_flow_sampling, sample_flow
from .options import SamplingOptions, sampling_options
from .schedulers import Sampler, check_sampler, is_diffusers_sampler, sample_with_scheduler

# Keys of the counter-based random numbers; fixed forever, since they define which image
# sample i is for a given seed.
_KEY_INIT, _KEY_STEP = 0x1E1, 0x57E


def build_sampling_diffusion(
    sampler: Sampler,
    num_steps: int,
    noise_schedule: str = "linear",
    diffusion_steps: int = 1000,
    learn_sigma: bool = True,
) -> SpacedDiffusion:
    """The respaced process: ``"250"`` for DDPM; ``"ddimN"`` (even stride) for DDIM where N
    divides the steps that way, else the section respacing of N steps."""
    if num_steps < 2 or num_steps > diffusion_steps:
        # One step has no posterior variance to interpolate (the learned-range variance needs t=1).
        raise ValueError(f"num_steps must be in 2..{diffusion_steps}, got {num_steps}")
    respacing = str(num_steps)
    if sampler == "ddim" and any(len(range(0, diffusion_steps, s)) == num_steps for s in range(1, diffusion_steps)):
        respacing = f"ddim{num_steps}"
    return create_diffusion(
        respacing, noise_schedule=noise_schedule, learn_sigma=learn_sigma, diffusion_steps=diffusion_steps
    )


def initial_noise(indices: Tensor, shape: Sequence[int], seed: int) -> Tensor:
    """x_T of samples ``indices``: (N, *shape) float32, a pure function of (seed, index)."""
    return keyed_normal(sample_keys(indices.long(), seed, _KEY_INIT), shape)


def step_noise(indices: Tensor, shape: Sequence[int], seed: int, step: int) -> Tensor:
    """The noise sample ``i`` gets at sampling step ``step`` (0 = the first, at t = T-1)."""
    return keyed_normal(sample_keys(indices.long(), seed, _KEY_STEP, step), shape)


def guided_model_fn(
    net: DiT,
    cfg_scale: float,
    guide_channels: Optional[int] = None,
    precision: SamplingPrecision = "fp32",
    force_cfg: bool = False,
    cfg_interval: Optional[tuple[float, float]] = None,
) -> Callable[..., Tensor]:
    """``fn(x, t, y)`` -> model output for the (un-doubled) batch ``x``.

    With guidance the batch is doubled to ``[x, x]`` with labels ``[y, null]`` and combined by
    ``net.forward_with_cfg`` (``guide_channels=3``: the reference's published-FID variant); the
    first half is returned. Scale 1 skips the doubled batch (same result, half the cost)
    unless ``force_cfg``; so do timesteps outside ``cfg_interval = (lo, hi)``. The network runs
    under autocast for bf16/fp16; the output is float32.
    """
    dtype = to_dtype(precision)

    def guided(x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        n = x.shape[0]
        null = torch.full_like(y, net.num_classes)
        out = net.forward_with_cfg(
            torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]), cfg_scale, guide_channels
        )
        return out[:n]

    def run(x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        if cfg_scale == 1.0 and not force_cfg:
            return net(x, t, y)
        if cfg_interval is not None:
            inside = (t >= cfg_interval[0]) & (t <= cfg_interval[1])
            if not inside.any():  # the conditional prediction alone: no doubled batch
                return net(x, t, y)
            if not inside.all():  # a batch of mixed timesteps (the loops here step all samples together)
                return torch.where(inside.view(-1, *[1] * (x.dim() - 1)), guided(x, t, y), net(x, t, y))
        return guided(x, t, y)

    def fn(x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        with autocast(x.device.type, dtype):
            return run(x, t, y).float()

    return fn


@torch.no_grad()
def sample_latents(
    net: DiT,
    labels: Union[Tensor, Sequence[int]],
    indices: Optional[Union[Tensor, Sequence[int]]] = None,
    *,
    options: Optional[SamplingOptions] = None,
    noise_schedule: str = "linear",
    diffusion_steps: int = 1000,
    noise: Optional[Tensor] = None,
    noise_fn: Optional[Callable[[int, Tensor], Tensor]] = None,
    model_fn: Optional[Callable[..., Tensor]] = None,
    flow: Optional[FlowMatching] = None,
    **overrides: Any,
) -> Tensor:
    """Latents (N, C, H, W) for ``labels``, sample ``indices[k]`` drawn from keys (seed, index).

    How: ``options`` and keyword ``overrides`` of its fields (``sampler="ddim", num_steps=50,
    cfg_scale=4.0, seed=1``; :class:`~.options.SamplingOptions`); unset ones take the library's
    defaults (DDPM-250, no guidance, no x0 clamp), a model's are ``DiTModule.sample``'s.
    ``noise_schedule`` and ``diffusion_steps`` are the model's training process; ``flow`` the
    flow-matching objective of a model trained with one (None: a DDPM model). A flow model takes
    the flow samplers (``ode-euler``...; :mod:`.flow`), a DDPM model the others: each refuses the other.

    ``indices`` default to ``0..N-1``. ``noise`` overrides x_T; ``noise_fn(step, x)`` overrides
    the per-step noise (tests use it to replay a ``torch.Generator``). DDPM is ancestral
    sampling with the learned variance; DDIM ignores the variance and adds ``eta``-scaled
    noise (eta 0: deterministic given x_T).

    ``clip_denoised`` clamps every step's estimate of x_0 to [-1, 1] (every sampler). Pixel
    stores need it (``clip_denoised_for(vae)``): without the clamp a step where alphas_cumprod
    is tiny turns a small epsilon error into a huge x_0 (the cosine schedule's last step,
    acp ~ 2.4e-9, multiplies it by ~2e4) that ancestral sampling carries into the next inputs
    of the network. VAE latents are unbounded, and DiT's published numbers sample them unclipped.
    """
    if isinstance(indices, SamplingOptions):
        raise TypeError("options are passed by name: sample_latents(net, labels, indices, options=...)")
    opts = sampling_options(options, **overrides).resolved()
    device = next(net.parameters()).device
    y = torch.as_tensor(labels, dtype=torch.long).to(device)
    n = y.shape[0]
    idx = torch.arange(n) if indices is None else torch.as_tensor(indices, dtype=torch.long)
    if idx.shape != (n,):
        raise ValueError(f"{n} labels but indices of shape {tuple(idx.shape)}")
    shape = (net.in_channels, net.input_size, net.input_size)
    seed = opts.seed
    check_sampler(opts.sampler)
    check_flow_sampling(opts.sampler, flow)
    diffusion = (
        None
        if is_diffusers_sampler(opts.sampler) or flow is not None  # built by the scheduler's / flow's loop
        else build_sampling_diffusion(opts.sampler, opts.num_steps, noise_schedule, diffusion_steps, net.learn_sigma)
    )
    guided = model_fn or guided_model_fn(
        net, opts.cfg_scale, opts.guide_channels, opts.precision, cfg_interval=opts.cfg_interval
    )

    def fn(*args: Any, **kwargs: Any) -> Tensor:
        stop_point()  # every denoising step is a safe point: a signal stops sampling here (dit_lightning.signals)
        return guided(*args, **kwargs)

    if noise_fn is None:
        idx_dev = idx.to(device)

        def noise_fn(step: int, like: Tensor) -> Tensor:
            return step_noise(idx_dev, shape, seed, step).to(like.dtype)

    x = (noise if noise is not None else initial_noise(idx.to(device), shape, seed)).to(device, torch.float32)
    if tuple(x.shape) != (n, *shape):
        raise ValueError(f"noise of shape {tuple(x.shape)}, expected {(n, *shape)}")
    was_training = net.training
    net.eval()
    common: dict[str, Any] = dict(
        noise=x, clip_denoised=opts.clip_denoised, model_kwargs={"y": y}, device=device, noise_fn=noise_fn
    )
    try:
        if flow is not None:
            x = sample_flow(fn, x, y, flow, opts, noise_fn=noise_fn)
        elif diffusion is None:
            x = sample_with_scheduler(
                fn, x, y, idx, opts, in_channels=net.in_channels, learn_sigma=net.learn_sigma,
                noise_schedule=noise_schedule, diffusion_steps=diffusion_steps, noise_fn=noise_fn,
            )  # fmt: skip
        elif opts.sampler == "ddpm":
            x = diffusion.p_sample_loop(fn, x.shape, **common)
        else:
            x = diffusion.ddim_sample_loop(fn, x.shape, eta=opts.eta, **common)
    finally:
        net.train(was_training)
    return x
