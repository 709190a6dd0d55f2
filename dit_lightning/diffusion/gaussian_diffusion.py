"""Gaussian diffusion with epsilon prediction, as trained by DiT (ADM / improved DDPM).

The forward process, posterior, model parametrization ("learned range" variance), the
hybrid loss ``L_simple + L_vb`` and the ancestral (DDPM) and DDIM samplers. Every
schedule table is computed once in float64 numpy; a lookup at timesteps ``t`` returns it
in the dtype and on the device of the tensor it is combined with.

Pure PyTorch + numpy: no Lightning import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, Optional, Union

import numpy as np
import torch
from torch import Tensor

from .losses import discretized_gaussian_log_likelihood, mean_flat, normal_kl

ModelFn = Callable[..., Tensor]
ModelVarType = Literal["learned_range", "fixed_small", "fixed_large"]
LossType = Literal["mse", "rescaled_mse", "kl", "rescaled_kl"]
DeviceLike = Union[str, torch.device, None]

_VAR_TYPES = ("learned_range", "fixed_small", "fixed_large")
_LOSS_TYPES = ("mse", "rescaled_mse", "kl", "rescaled_kl")


# --------------------------------------------------------------------------------------
# Beta schedules
# --------------------------------------------------------------------------------------


def betas_for_alpha_bar(
    num_diffusion_timesteps: int, alpha_bar: Callable[[float], float], max_beta: float = 0.999
) -> np.ndarray:
    """Betas that make the cumulative product follow ``alpha_bar(t)`` for t in [0, 1]."""
    betas = []
    for i in range(num_diffusion_timesteps):
        t1, t2 = i / num_diffusion_timesteps, (i + 1) / num_diffusion_timesteps
        # Capped below 1 so the last steps do not collapse the signal entirely.
        betas.append(min(1.0 - alpha_bar(t2) / alpha_bar(t1), max_beta))
    return np.array(betas, dtype=np.float64)


def get_named_beta_schedule(schedule_name: str, num_diffusion_timesteps: int) -> np.ndarray:
    """``"linear"`` (Ho et al., scaled to the step count) or ``"cosine"`` (Nichol & Dhariwal).

    ``"squaredcos_cap_v2"`` is accepted as another name of ``"cosine"``.
    """
    if schedule_name == "linear":
        # 1e-4 .. 0.02 is defined for 1000 steps; scaling keeps the total noise comparable
        # for other step counts.
        scale = 1000.0 / num_diffusion_timesteps
        return np.linspace(scale * 1e-4, scale * 0.02, num_diffusion_timesteps, dtype=np.float64)
    if schedule_name in ("cosine", "squaredcos_cap_v2"):  # the second is the reference's name
        return betas_for_alpha_bar(num_diffusion_timesteps, lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2)
    raise ValueError(f"unknown beta schedule {schedule_name!r} (expected 'linear' or 'cosine')")


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def _resolve_device(device: DeviceLike, noise: Optional[Tensor], generator: Optional[torch.Generator]) -> torch.device:
    if device is not None:
        return torch.device(device)
    if noise is not None:
        return noise.device
    if generator is not None:
        return generator.device
    return torch.device("cpu")


# noise_fn(step, x) -> the noise of sampling step ``step`` (0 = first), shaped like x.
NoiseFn = Callable[[int, Tensor], Tensor]


def _no_noise(step: int, like: Tensor) -> None:
    return None


def _randn(
    shape: Sequence[int], *, device: torch.device, dtype: torch.dtype, generator: Optional[torch.Generator]
) -> Tensor:
    """Standard normal noise; drawn where the generator lives, so a CPU seed also drives GPU sampling."""
    if generator is None:
        return torch.randn(tuple(shape), device=device, dtype=dtype)
    return torch.randn(tuple(shape), generator=generator, device=generator.device, dtype=dtype).to(device)


def _progress(indices: Sequence[int], enabled: bool, description: str) -> Iterable[int]:
    """Wrap the timestep iterator in a rich (or tqdm) bar when asked and available."""
    if not enabled:
        return indices
    try:
        from rich.progress import track

        return track(indices, description=description, total=len(indices))
    except ImportError:
        pass
    try:
        from tqdm.auto import tqdm

        return tqdm(indices, desc=description)
    except ImportError:
        return indices


# --------------------------------------------------------------------------------------
# The process
# --------------------------------------------------------------------------------------


class GaussianDiffusion:
    """Diffusion over ``len(betas)`` steps with an epsilon-predicting model.

    ``model_fn(x_t, t, **model_kwargs)`` returns ``C`` channels (epsilon) for fixed
    variances, or ``2C`` (epsilon, then ``v`` in [-1, 1]) for ``"learned_range"``, where
    the log variance interpolates between the posterior's and ``log(beta_t)``.
    """

    def __init__(
        self,
        *,
        betas: np.ndarray,
        model_var_type: ModelVarType = "learned_range",
        loss_type: LossType = "mse",
    ) -> None:
        if model_var_type not in _VAR_TYPES:
            raise ValueError(f"model_var_type must be one of {_VAR_TYPES}, got {model_var_type!r}")
        if loss_type not in _LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {_LOSS_TYPES}, got {loss_type!r}")
        self.model_var_type = model_var_type
        self.loss_type = loss_type

        betas = np.asarray(betas, dtype=np.float64)
        if betas.ndim != 1 or len(betas) == 0:
            raise ValueError("betas must be a non-empty 1-D array")
        if not ((betas > 0).all() and (betas <= 1).all()):
            raise ValueError("betas must lie in (0, 1]")
        self.betas = betas
        self.num_timesteps = int(len(betas))

        alphas = 1.0 - betas
        self.alphas_cumprod = np.cumprod(alphas)
        self.alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.alphas_cumprod_next = np.append(self.alphas_cumprod[1:], 0.0)

        # q(x_t | x_0)
        self.sqrt_alphas_cumprod = np.sqrt(self.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - self.alphas_cumprod)
        self.log_one_minus_alphas_cumprod = np.log(1.0 - self.alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1.0)

        # q(x_{t-1} | x_t, x_0)
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        # The posterior variance is 0 at t = 0; borrow t = 1's value so the log stays finite.
        self.posterior_log_variance_clipped = (
            np.log(np.append(self.posterior_variance[1], self.posterior_variance[1:]))
            if self.num_timesteps > 1
            else np.array([], dtype=np.float64)
        )
        self.posterior_mean_coef1 = betas * np.sqrt(self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - self.alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - self.alphas_cumprod)
        self.log_betas = np.log(betas)
        # "fixed large" variance: beta_t, except at t = 0 where the posterior's (t = 1)
        # value gives a sensible decoder.
        self.fixed_large_variance = (
            np.append(self.posterior_variance[1], betas[1:]) if self.num_timesteps > 1 else betas.copy()
        )
        self.fixed_large_log_variance = np.log(self.fixed_large_variance)

        # Converted tables per (name, device, dtype): converting float64 -> dtype on the CPU
        # first also serves devices without float64 (MPS).
        self._table_cache: dict[tuple[str, torch.device, torch.dtype], Tensor] = {}

    # ---- table lookup ----------------------------------------------------------------

    def _extract(self, name: str, t: Tensor, like: Tensor) -> Tensor:
        """Table ``name`` at timesteps ``t`` (N,), broadcast to ``like``'s shape, dtype, device."""
        key = (name, like.device, like.dtype)
        table = self._table_cache.get(key)
        if table is None:
            table = torch.from_numpy(getattr(self, name)).to(like.dtype).to(like.device)
            self._table_cache[key] = table
        values = table[t.to(like.device).long()]
        return values.view(-1, *([1] * (like.ndim - 1))).expand(like.shape)

    def __getstate__(self) -> dict[str, Any]:
        # Device tensors do not belong in a pickle or deepcopy; they are rebuilt on demand.
        state = self.__dict__.copy()
        state["_table_cache"] = {}
        return state

    # ---- wrapping the model (SpacedDiffusion maps timesteps here) --------------------

    def _wrap_model(self, model_fn: ModelFn) -> ModelFn:
        return model_fn

    # ---- forward process -------------------------------------------------------------

    def sample_timesteps(
        self, n: int, device: DeviceLike = None, generator: Optional[torch.Generator] = None
    ) -> Tensor:
        """``n`` uniform integer timesteps in [0, num_timesteps)."""
        device = _resolve_device(device, None, generator)
        if generator is None:
            return torch.randint(0, self.num_timesteps, (n,), device=device)
        return torch.randint(0, self.num_timesteps, (n,), generator=generator, device=generator.device).to(device)

    def q_mean_variance(self, x_start: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Mean, variance and log variance of q(x_t | x_0)."""
        mean = self._extract("sqrt_alphas_cumprod", t, x_start) * x_start
        variance = 1.0 - self._extract("alphas_cumprod", t, x_start)
        log_variance = self._extract("log_one_minus_alphas_cumprod", t, x_start)
        return mean, variance, log_variance

    def q_sample(self, x_start: Tensor, t: Tensor, noise: Optional[Tensor] = None) -> Tensor:
        """Draw x_t ~ q(x_t | x_0) = N(sqrt(acp_t) x_0, (1 - acp_t) I), with the given noise if any."""
        if noise is None:
            noise = torch.randn_like(x_start)
        if noise.shape != x_start.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} != x_start shape {tuple(x_start.shape)}")
        return (
            self._extract("sqrt_alphas_cumprod", t, x_start) * x_start
            + self._extract("sqrt_one_minus_alphas_cumprod", t, x_start) * noise
        )

    def q_posterior_mean_variance(self, x_start: Tensor, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Mean, variance and clipped log variance of q(x_{t-1} | x_t, x_0)."""
        mean = (
            self._extract("posterior_mean_coef1", t, x_t) * x_start
            + self._extract("posterior_mean_coef2", t, x_t) * x_t
        )
        variance = self._extract("posterior_variance", t, x_t)
        log_variance = self._extract("posterior_log_variance_clipped", t, x_t)
        return mean, variance, log_variance

    # ---- reverse process -------------------------------------------------------------

    def _predict_xstart_from_eps(self, x_t: Tensor, t: Tensor, eps: Tensor) -> Tensor:
        return (
            self._extract("sqrt_recip_alphas_cumprod", t, x_t) * x_t
            - self._extract("sqrt_recipm1_alphas_cumprod", t, x_t) * eps
        )

    def _predict_eps_from_xstart(self, x_t: Tensor, t: Tensor, pred_xstart: Tensor) -> Tensor:
        return (self._extract("sqrt_recip_alphas_cumprod", t, x_t) * x_t - pred_xstart) / self._extract(
            "sqrt_recipm1_alphas_cumprod", t, x_t
        )

    def _split_output(self, model_output: Tensor, x: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """(eps, v) for learned variance, (eps, None) otherwise; checks the channel count."""
        c = x.shape[1]
        # Computed in the input's precision: under autocast the network may return bf16.
        model_output = model_output.to(x.dtype)
        if self.model_var_type == "learned_range":
            if model_output.shape[1] != 2 * c:
                raise ValueError(
                    f"learned variance needs {2 * c} output channels (eps, v), got {model_output.shape[1]}"
                )
            eps, v = torch.split(model_output, c, dim=1)
            return eps, v
        if model_output.shape[1] != c:
            raise ValueError(f"fixed variance needs {c} output channels (eps), got {model_output.shape[1]}")
        return model_output, None

    def _variance(self, v: Optional[Tensor], x: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """Model variance and log variance at ``t``."""
        if self.model_var_type == "learned_range":
            assert v is not None
            min_log = self._extract("posterior_log_variance_clipped", t, x)
            max_log = self._extract("log_betas", t, x)
            frac = (v + 1.0) / 2.0
            log_variance = frac * max_log + (1.0 - frac) * min_log
            return torch.exp(log_variance), log_variance
        if self.model_var_type == "fixed_large":
            return self._extract("fixed_large_variance", t, x), self._extract("fixed_large_log_variance", t, x)
        return self._extract("posterior_variance", t, x), self._extract("posterior_log_variance_clipped", t, x)

    def _p_mean_variance(
        self,
        model_fn: ModelFn,
        x: Tensor,
        t: Tensor,
        clip_denoised: bool,
        denoised_fn: Optional[Callable[[Tensor], Tensor]],
        model_kwargs: Optional[dict[str, Any]],
    ) -> dict[str, Tensor]:
        eps, v = self._split_output(model_fn(x, t, **(model_kwargs or {})), x)
        variance, log_variance = self._variance(v, x, t)
        pred_xstart = self._predict_xstart_from_eps(x, t, eps)
        if denoised_fn is not None:
            pred_xstart = denoised_fn(pred_xstart)
        if clip_denoised:
            pred_xstart = pred_xstart.clamp(-1.0, 1.0)
        mean, _, _ = self.q_posterior_mean_variance(pred_xstart, x, t)
        return {
            "mean": mean,
            "variance": variance,
            "log_variance": log_variance,
            "pred_xstart": pred_xstart,
            "eps": eps,
        }

    def p_mean_variance(
        self,
        model_fn: ModelFn,
        x: Tensor,
        t: Tensor,
        clip_denoised: bool = False,
        denoised_fn: Optional[Callable[[Tensor], Tensor]] = None,
        model_kwargs: Optional[dict[str, Any]] = None,
    ) -> dict[str, Tensor]:
        """p(x_{t-1} | x_t): dict of ``mean``, ``variance``, ``log_variance``, ``pred_xstart``, ``eps``.

        ``eps`` is the raw model prediction; ``pred_xstart`` is after ``denoised_fn`` and
        the optional clamp to [-1, 1] (off by default: latents are not bounded).
        """
        return self._p_mean_variance(self._wrap_model(model_fn), x, t, clip_denoised, denoised_fn, model_kwargs)

    # ---- training --------------------------------------------------------------------

    def _vb_terms_bpd(self, out: dict[str, Tensor], x_start: Tensor, x_t: Tensor, t: Tensor) -> Tensor:
        """Per-sample VLB term in bits: KL to the true posterior, decoder NLL at t = 0."""
        true_mean, _, true_log_variance = self.q_posterior_mean_variance(x_start, x_t, t)
        kl = mean_flat(normal_kl(true_mean, true_log_variance, out["mean"], out["log_variance"])) / math.log(2.0)
        decoder_nll = -mean_flat(
            discretized_gaussian_log_likelihood(x_start, means=out["mean"], log_scales=0.5 * out["log_variance"])
        ) / math.log(2.0)
        return torch.where(t == 0, decoder_nll, kl)

    def training_losses(
        self,
        model_fn: ModelFn,
        x_start: Tensor,
        t: Tensor,
        model_kwargs: Optional[dict[str, Any]] = None,
        noise: Optional[Tensor] = None,
    ) -> dict[str, Tensor]:
        """Per-sample (N,) ``loss``, ``mse`` and ``vb`` at timesteps ``t``.

        MSE loss types: ``loss = mse + vb`` with learned variance (the hybrid loss), where
        ``vb`` sees a detached epsilon so it trains only the variance output; with a fixed
        variance ``loss = mse`` and ``vb`` is zeros. KL loss types: ``loss = vb`` on the
        undetached output (``mse`` is reported, detached). ``rescaled_*`` multiply the VLB
        term by ``num_timesteps`` (KL) or ``num_timesteps / 1000`` (MSE) as the reference.
        """
        model_fn = self._wrap_model(model_fn)
        if noise is None:
            noise = torch.randn_like(x_start)
        x_t = self.q_sample(x_start, t, noise=noise)
        model_output = model_fn(x_t, t, **(model_kwargs or {}))
        eps, v = self._split_output(model_output, x_t)
        mse = mean_flat((noise - eps) ** 2)

        if self.loss_type in ("kl", "rescaled_kl"):
            out = self._p_mean_variance(lambda *_a, **_k: model_output, x_t, t, False, None, None)
            vb = self._vb_terms_bpd(out, x_start, x_t, t)
            if self.loss_type == "rescaled_kl":
                vb = vb * self.num_timesteps
            return {"loss": vb, "mse": mse.detach(), "vb": vb}

        if v is None:
            return {"loss": mse, "mse": mse, "vb": torch.zeros_like(mse)}
        # Only the variance head learns from the bound; L_simple alone drives epsilon.
        frozen_out = torch.cat([eps.detach(), v], dim=1)
        out = self._p_mean_variance(lambda *_a, **_k: frozen_out, x_t, t, False, None, None)
        vb = self._vb_terms_bpd(out, x_start, x_t, t)
        if self.loss_type == "rescaled_mse":
            vb = vb * (self.num_timesteps / 1000.0)
        return {"loss": mse + vb, "mse": mse, "vb": vb}

    # ---- ancestral sampling ----------------------------------------------------------

    def p_sample(
        self,
        model_fn: ModelFn,
        x: Tensor,
        t: Tensor,
        clip_denoised: bool = False,
        denoised_fn: Optional[Callable[[Tensor], Tensor]] = None,
        model_kwargs: Optional[dict[str, Any]] = None,
        generator: Optional[torch.Generator] = None,
        noise: Optional[Tensor] = None,
    ) -> dict[str, Tensor]:
        """One DDPM step x_t -> x_{t-1}: ``{"sample", "pred_xstart"}``; no noise where t == 0.
        ``noise`` replaces the step's draw from ``generator``."""
        out = self.p_mean_variance(model_fn, x, t, clip_denoised, denoised_fn, model_kwargs)
        if noise is None:
            noise = _randn(x.shape, device=x.device, dtype=x.dtype, generator=generator)
        nonzero = (t != 0).to(x.dtype).view(-1, *([1] * (x.ndim - 1)))
        sample = out["mean"] + nonzero * torch.exp(0.5 * out["log_variance"]) * noise
        return {"sample": sample, "pred_xstart": out["pred_xstart"]}

    def _loop_start(
        self,
        shape: Sequence[int],
        noise: Optional[Tensor],
        device: DeviceLike,
        generator: Optional[torch.Generator],
    ) -> Tensor:
        dev = _resolve_device(device, noise, generator)
        if noise is not None:
            if tuple(noise.shape) != tuple(shape):
                raise ValueError(f"noise shape {tuple(noise.shape)} != requested shape {tuple(shape)}")
            return noise.to(dev)
        return _randn(shape, device=dev, dtype=torch.float32, generator=generator)

    def p_sample_loop_progressive(
        self,
        model_fn: ModelFn,
        shape: Sequence[int],
        noise: Optional[Tensor] = None,
        clip_denoised: bool = False,
        denoised_fn: Optional[Callable[[Tensor], Tensor]] = None,
        model_kwargs: Optional[dict[str, Any]] = None,
        device: DeviceLike = None,
        progress: bool = False,
        generator: Optional[torch.Generator] = None,
        noise_fn: Optional[NoiseFn] = None,
    ) -> Iterator[dict[str, Tensor]]:
        """Yield ``{"sample", "pred_xstart", "t"}`` after every DDPM step, from t = T-1 down to 0.
        ``noise_fn(step, x)`` (step 0 = the first, noisiest) replaces the generator's draws."""
        model_fn = self._wrap_model(model_fn)
        x = self._loop_start(shape, noise, device, generator)

        def step(x: Tensor, t: Tensor, z: Optional[Tensor]) -> dict[str, Tensor]:
            return self.p_sample(model_fn, x, t, clip_denoised, denoised_fn, model_kwargs, generator, z)

        yield from self._run_steps(step, x, progress, "DDPM sampling", noise_fn)

    def _run_steps(
        self,
        step: Callable[..., dict[str, Tensor]],
        x: Tensor,
        progress: bool,
        description: str,
        noise_fn: Optional[NoiseFn],
    ) -> Iterator[dict[str, Tensor]]:
        """The loop shared by the samplers: t = T-1 .. 0, each step's noise from ``noise_fn``."""
        step_noise = noise_fn or _no_noise
        for k, i in enumerate(_progress(list(range(self.num_timesteps))[::-1], progress, description)):
            t = torch.full((x.shape[0],), i, device=x.device, dtype=torch.long)
            with torch.no_grad():
                out = step(x, t, step_noise(k, x))
            out["t"] = t
            yield out
            x = out["sample"]

    def p_sample_loop(
        self,
        model_fn: ModelFn,
        shape: Sequence[int],
        noise: Optional[Tensor] = None,
        clip_denoised: bool = False,
        model_kwargs: Optional[dict[str, Any]] = None,
        device: DeviceLike = None,
        progress: bool = False,
        generator: Optional[torch.Generator] = None,
        denoised_fn: Optional[Callable[[Tensor], Tensor]] = None,
        noise_fn: Optional[NoiseFn] = None,
    ) -> Tensor:
        """Ancestral sampling from pure noise; returns the final x_0 (latents)."""
        final = None
        for final in self.p_sample_loop_progressive(  # noqa: B007 - keeps the last step
            model_fn, shape, noise, clip_denoised, denoised_fn, model_kwargs, device, progress, generator, noise_fn
        ):
            pass
        assert final is not None
        return final["sample"]

    # ---- DDIM sampling ---------------------------------------------------------------

    def ddim_sample(
        self,
        model_fn: ModelFn,
        x: Tensor,
        t: Tensor,
        clip_denoised: bool = False,
        denoised_fn: Optional[Callable[[Tensor], Tensor]] = None,
        model_kwargs: Optional[dict[str, Any]] = None,
        eta: float = 0.0,
        generator: Optional[torch.Generator] = None,
        noise: Optional[Tensor] = None,
    ) -> dict[str, Tensor]:
        """One DDIM step (Song et al., eq. 12): ``{"sample", "pred_xstart"}``; ``noise``
        replaces the step's draw from ``generator`` (used only when eta > 0).

        The learned variance is ignored; ``eta`` scales the DDIM sigma (0: deterministic,
        1: DDPM-like). No noise is added where t == 0.
        """
        out = self.p_mean_variance(model_fn, x, t, clip_denoised, denoised_fn, model_kwargs)
        # Re-derived so that a clipped or denoised x_0 stays consistent with the direction term.
        eps = self._predict_eps_from_xstart(x, t, out["pred_xstart"])
        alpha_bar = self._extract("alphas_cumprod", t, x)
        alpha_bar_prev = self._extract("alphas_cumprod_prev", t, x)
        sigma = (
            eta * torch.sqrt((1.0 - alpha_bar_prev) / (1.0 - alpha_bar)) * torch.sqrt(1.0 - alpha_bar / alpha_bar_prev)
        )
        mean_pred = (
            out["pred_xstart"] * torch.sqrt(alpha_bar_prev)
            + torch.sqrt((1.0 - alpha_bar_prev - sigma**2).clamp(min=0.0)) * eps
        )
        if eta == 0.0:
            # Deterministic: draw nothing, so the generator state is left untouched.
            return {"sample": mean_pred, "pred_xstart": out["pred_xstart"]}
        if noise is None:
            noise = _randn(x.shape, device=x.device, dtype=x.dtype, generator=generator)
        nonzero = (t != 0).to(x.dtype).view(-1, *([1] * (x.ndim - 1)))
        return {"sample": mean_pred + nonzero * sigma * noise, "pred_xstart": out["pred_xstart"]}

    def ddim_sample_loop_progressive(
        self,
        model_fn: ModelFn,
        shape: Sequence[int],
        noise: Optional[Tensor] = None,
        clip_denoised: bool = False,
        denoised_fn: Optional[Callable[[Tensor], Tensor]] = None,
        model_kwargs: Optional[dict[str, Any]] = None,
        device: DeviceLike = None,
        progress: bool = False,
        eta: float = 0.0,
        generator: Optional[torch.Generator] = None,
        noise_fn: Optional[NoiseFn] = None,
    ) -> Iterator[dict[str, Tensor]]:
        """Yield ``{"sample", "pred_xstart", "t"}`` after every DDIM step (``noise_fn`` as DDPM's)."""
        model_fn = self._wrap_model(model_fn)
        x = self._loop_start(shape, noise, device, generator)

        def step(x: Tensor, t: Tensor, z: Optional[Tensor]) -> dict[str, Tensor]:
            return self.ddim_sample(model_fn, x, t, clip_denoised, denoised_fn, model_kwargs, eta, generator, z)

        yield from self._run_steps(step, x, progress, "DDIM sampling", noise_fn)

    def ddim_sample_loop(
        self,
        model_fn: ModelFn,
        shape: Sequence[int],
        noise: Optional[Tensor] = None,
        clip_denoised: bool = False,
        model_kwargs: Optional[dict[str, Any]] = None,
        device: DeviceLike = None,
        progress: bool = False,
        eta: float = 0.0,
        generator: Optional[torch.Generator] = None,
        denoised_fn: Optional[Callable[[Tensor], Tensor]] = None,
        noise_fn: Optional[NoiseFn] = None,
    ) -> Tensor:
        """DDIM sampling from pure noise over this process's (possibly respaced) steps."""
        final = None
        for final in self.ddim_sample_loop_progressive(  # noqa: B007 - keeps the last step
            model_fn, shape, noise, clip_denoised, denoised_fn, model_kwargs, device, progress, eta, generator, noise_fn
        ):
            pass
        assert final is not None
        return final["sample"]
