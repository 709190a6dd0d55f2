"""The sampling loop: noise, classifier-free guidance, and the steps of the model's objective (its own
loops: DDPM / DDIM, or SiT's ODE / SDE samplers for flow matching; :mod:`dit_lightning.diffusion`) or
of a diffusers scheduler (:mod:`.schedulers`). Nothing else.

Every random number of sample ``i`` (its initial noise, the noise of every DDPM / DDIM step) is
a pure function of ``(seed, i, step)`` drawn with :mod:`dit_lightning.keyed_random`, not of a
sequential generator; so sample ``i`` is the same image whatever the batch size, the number of
ranks or the resume point (up to the last-bit differences batched GEMMs of different sizes may
show). The module, the callbacks and the ``sample`` command all call :func:`sample_latents`, with
the one :class:`~.options.SamplingOptions`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor

from ..diffusion import DDPMObjective, TrainingObjective
from ..keyed_random import keyed_normal, sample_keys
from ..models.dit import DiT
from ..precision import SamplingPrecision, autocast, to_dtype
from ..signals import stop_point
from .options import SamplingOptions, sampling_options
from .schedulers import DIFFUSERS_SAMPLERS, check_sampler, is_diffusers_sampler, sample_with_scheduler

# Keys of the counter-based random numbers; fixed forever, since they define which image
# sample i is for a given seed.
_KEY_INIT, _KEY_STEP = 0x1E1, 0x57E
# REG's class token draws from keys of its own, so the latent's draws are those of a DiT without it.
_KEY_TOKEN_INIT, _KEY_TOKEN_STEP = 0xC11, 0xC57


def initial_noise(indices: Tensor, shape: Sequence[int], seed: int) -> Tensor:
    """x_T of samples ``indices``: (N, *shape) float32, a pure function of (seed, index)."""
    return keyed_normal(sample_keys(indices.long(), seed, _KEY_INIT), shape)


def step_noise(indices: Tensor, shape: Sequence[int], seed: int, step: int) -> Tensor:
    """The noise sample ``i`` gets at sampling step ``step`` (0 = the first, at t = T-1)."""
    return keyed_normal(sample_keys(indices.long(), seed, _KEY_STEP, step), shape)


def initial_token_noise(indices: Tensor, dim: int, seed: int) -> Tensor:
    """REG's class token at the start (pure noise) of samples ``indices``: (N, dim) float32, a pure
    function of (seed, index) from keys of its own."""
    return keyed_normal(sample_keys(indices.long(), seed, _KEY_TOKEN_INIT), (dim,))


def token_step_noise(indices: Tensor, dim: int, seed: int, step: int) -> Tensor:
    """The noise REG's class token of sample ``i`` gets at SDE step ``step``."""
    return keyed_normal(sample_keys(indices.long(), seed, _KEY_TOKEN_STEP, step), (dim,))


class StepLines:
    """``on_step`` for :func:`sample_latents` that prints a line (to stderr) every ``every_s`` seconds of
    a long sampling call: in a batch job's log, minutes of denoising show as progress, not silence."""

    def __init__(self, label: str, every_s: float = 10.0) -> None:
        self.label, self.every_s = label, every_s
        self._last = time.monotonic()

    def __call__(self, evaluations: int) -> None:
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            print(f"{self.label}: {evaluations} network evaluations so far", file=sys.stderr, flush=True)


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


def joint_model_fn(
    net: DiT,
    cfg_scale: float,
    class_token_cfg_scale: Optional[float] = None,
    precision: SamplingPrecision = "fp32",
    cfg_interval: Optional[tuple[float, float]] = None,
) -> Callable[..., Tensor]:
    """``fn(z, t, y)`` for a DiT with REG's class token: ``z`` (N, C*H*W + D) packs each sample's
    latent (flattened) and its noisy class token; the result packs the velocity of the first C
    output channels and the token's velocity the same way, so that every flow sampler (elementwise,
    per-sample times) integrates the token jointly with the latent (REG's ``samplers.py``).

    Guidance as REG's: a doubled batch with the same noisy token in both halves and labels
    ``[y, null]``; the latent's velocity guided by ``cfg_scale``, the token's by
    ``class_token_cfg_scale`` (None: ``cfg_scale``; 0: the conditional token velocity, REG's
    ``cls_cfg_scale`` 0 branch); outside ``cfg_interval`` (flow times) the conditional branch alone.
    REG guides its SDE drift ``v - g/2 score(v, x)``; the score is affine in v with the same x in
    both halves, so guiding the velocity and then forming the drift is the same thing.
    """
    if net.class_token_dim is None:
        raise ValueError("joint_model_fn samples REG's class token: this DiT has none (use guided_model_fn)")
    dtype = to_dtype(precision)
    c, size = net.in_channels, net.input_size
    numel = c * size * size
    token_scale = cfg_scale if class_token_cfg_scale is None else class_token_cfg_scale

    def conditional(x: Tensor, token: Tensor, t: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        out, token_v = net(x, t, y, class_token=token)
        return out[:, :c], token_v

    def guided(x: Tensor, token: Tensor, t: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        null = torch.full_like(y, net.num_classes)
        out, token_v = net(
            torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]), class_token=torch.cat([token, token])
        )
        cond, uncond = out[:, :c].chunk(2)
        token_cond, token_uncond = token_v.chunk(2)
        v = uncond + cfg_scale * (cond - uncond)
        token_v = token_cond if token_scale == 0 else token_uncond + token_scale * (token_cond - token_uncond)
        return v, token_v

    def run(x: Tensor, token: Tensor, t: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        if cfg_scale == 1.0:  # REG guides (the token too) only when cfg_scale guides: no doubled batch
            return conditional(x, token, t, y)
        if cfg_interval is not None:
            inside = (t >= cfg_interval[0]) & (t <= cfg_interval[1])
            if not inside.any():
                return conditional(x, token, t, y)
            if not inside.all():
                (v, tv), (cv, ctv) = guided(x, token, t, y), conditional(x, token, t, y)
                return torch.where(inside.view(-1, 1, 1, 1), v, cv), torch.where(inside.view(-1, 1), tv, ctv)
        return guided(x, token, t, y)

    def fn(z: Tensor, t: Tensor, y: Tensor) -> Tensor:
        x, token = z[:, :numel].reshape(-1, c, size, size), z[:, numel:]
        with autocast(z.device.type, dtype):
            v, token_v = run(x, token, t, y)
        return torch.cat([v.float().flatten(1), token_v.float()], dim=1)

    return fn


@torch.no_grad()
def sample_latents(
    net: DiT,
    labels: Union[Tensor, Sequence[int]],
    indices: Optional[Union[Tensor, Sequence[int]]] = None,
    *,
    options: Optional[SamplingOptions] = None,
    objective: Optional[TrainingObjective] = None,
    noise: Optional[Tensor] = None,
    noise_fn: Optional[Callable[[int, Tensor], Tensor]] = None,
    model_fn: Optional[Callable[..., Tensor]] = None,
    class_token_noise: Optional[Tensor] = None,
    on_step: Optional[Callable[[int], None]] = None,
    **overrides: Any,
) -> Tensor:
    """Latents (N, C, H, W) for ``labels``, sample ``indices[k]`` drawn from keys (seed, index).

    How: ``options`` and keyword ``overrides`` of its fields (``sampler="ddim", num_steps=50,
    cfg_scale=4.0, seed=1``; :class:`~.options.SamplingOptions`); unset ones take the library's
    defaults (DDPM-250, no guidance, no x0 clamp), a model's are ``DiTModule.sample``'s.
    ``objective`` is what trained the model (:class:`~dit_lightning.diffusion.TrainingObjective`;
    default DiT's DDPM on the linear schedule of 1000 steps): it runs its own samplers (DDPM / DDIM,
    or a flow model's ODE / SDE samplers) and refuses another objective's; diffusers' schedulers
    sample the objectives that predict epsilon on the model's betas.

    ``on_step(k)`` is told of the k-th network evaluation (progress: :class:`StepLines`).
    ``indices`` default to ``0..N-1``. ``noise`` overrides x_T; ``noise_fn(step, x)`` overrides
    the per-step noise (tests use it to replay a ``torch.Generator``). DDPM is ancestral
    sampling with the learned variance; DDIM ignores the variance and adds ``eta``-scaled
    noise (eta 0: deterministic given x_T).

    ``clip_denoised`` clamps every step's estimate of x_0 to [-1, 1] (every DDPM sampler). Pixel
    stores need it (``clip_denoised_for(vae)``): without the clamp a step where alphas_cumprod
    is tiny turns a small epsilon error into a huge x_0 (the cosine schedule's last step,
    acp ~ 2.4e-9, multiplies it by ~2e4) that ancestral sampling carries into the next inputs
    of the network. VAE latents are unbounded, and DiT's published numbers sample them unclipped.

    A DiT with REG's class token (``class_token_dim``, a flow objective) samples the token jointly
    from its own keyed noise (``class_token_noise`` (N, D) overrides it): the sampler's state is each
    sample's ``[latent.flatten(), token]`` (:func:`joint_model_fn`; ``noise_fn`` then returns that
    packed shape, and a ``model_fn`` takes and returns it as :func:`joint_model_fn` does) and the token
    is dropped at the end, as REG's sampler returns the latents only.
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
    objective = (objective or DDPMObjective()).for_network(net.learn_sigma)
    objective.check_sampler(opts.sampler, tuple(DIFFUSERS_SAMPLERS))
    token_dim = net.class_token_dim
    if token_dim is not None and (isinstance(objective, DDPMObjective) or is_diffusers_sampler(opts.sampler)):
        raise ValueError(
            f"this DiT has REG's class token (class_token_dim {token_dim}), which only the flow samplers denoise "
            f"jointly: sample it with its flow objective (--objective flow, with --path_type linear for REG's "
            f"networks; a flow sampler such as sde-euler), not {opts.sampler}"
        )
    if token_dim is not None and opts.guide_channels is not None and model_fn is None:
        raise ValueError(
            f"guide_channels {opts.guide_channels} does not apply to a DiT with REG's class token: its sampler guides "
            "every latent channel, and the token by class_token_cfg_scale; unset guide_channels (null)"
        )
    if token_dim is None and class_token_noise is not None:
        raise ValueError("class_token_noise given, but this DiT has no class token (class_token_dim unset)")
    if model_fn is not None:
        guided = model_fn
    elif token_dim is not None:
        guided = joint_model_fn(
            net, opts.cfg_scale, opts.class_token_cfg_scale, opts.precision, cfg_interval=opts.cfg_interval
        )
    else:
        guided = guided_model_fn(
            net, opts.cfg_scale, opts.guide_channels, opts.precision, cfg_interval=opts.cfg_interval
        )

    evaluations = 0

    def fn(*args: Any, **kwargs: Any) -> Tensor:
        nonlocal evaluations
        stop_point()  # every denoising step is a safe point: a signal stops sampling here (dit_lightning.signals)
        evaluations += 1
        if on_step is not None:
            on_step(evaluations)
        return guided(*args, **kwargs)

    if noise_fn is None:
        idx_dev = idx.to(device)

        def noise_fn(step: int, like: Tensor) -> Tensor:
            if token_dim is None:
                return step_noise(idx_dev, shape, seed, step).to(like.dtype)
            latent = step_noise(idx_dev, shape, seed, step).flatten(1)
            return torch.cat([latent, token_step_noise(idx_dev, token_dim, seed, step)], 1).to(like.dtype)

    x = (noise if noise is not None else initial_noise(idx.to(device), shape, seed)).to(device, torch.float32)
    if tuple(x.shape) != (n, *shape):
        raise ValueError(f"noise of shape {tuple(x.shape)}, expected {(n, *shape)}")
    was_training = net.training
    net.eval()
    try:
        if is_diffusers_sampler(opts.sampler):  # epsilon on the model's betas (the objective accepted it)
            assert isinstance(objective, DDPMObjective)
            x = sample_with_scheduler(
                fn, x, y, idx, opts, seed=seed, in_channels=net.in_channels, learn_sigma=net.learn_sigma,
                noise_schedule=objective.noise_schedule, diffusion_steps=objective.diffusion_steps, noise_fn=noise_fn,
            )  # fmt: skip
        elif token_dim is not None:  # REG: the token is integrated jointly, then dropped
            token = class_token_noise
            if token is None:
                token = initial_token_noise(idx.to(device), token_dim, seed)
            token = token.to(device, torch.float32)
            if tuple(token.shape) != (n, token_dim):
                raise ValueError(f"class_token_noise of shape {tuple(token.shape)}, expected {(n, token_dim)}")
            z = objective.run_sampler(fn, torch.cat([x.flatten(1), token], 1), y, opts, noise_fn=noise_fn)
            x = z[:, : x[0].numel()].reshape(x.shape)
        else:
            x = objective.run_sampler(fn, x, y, opts, noise_fn=noise_fn)
    finally:
        net.train(was_training)
    return x
