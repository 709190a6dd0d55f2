"""Flow matching with stochastic interpolants, the objective of SiT (Ma et al. 2024, "SiT: Exploring
Flow and Diffusion-based Generative Models with Scalable Interpolant Transformers", arXiv 2401.08740;
github.com/willisma/SiT, ``transport/``).

Time runs from noise to data, as in SiT: ``x_t = alpha(t) * x_data + sigma(t) * noise`` with
``alpha(0) = 0, sigma(0) = 1`` (pure noise) and ``alpha(1) = 1, sigma(1) = 0`` (the data). The paths:

- ``linear``: alpha = t, sigma = 1 - t (rectified flow; SiT's default and its published model);
- ``gvp``: alpha = sin(pi t / 2), sigma = cos(pi t / 2) (variance preserving, "generalised VP");
- ``vp``: the VP-SDE's marginals with beta from 0.1 to 20 (alpha = exp(-(1-t)^2 (20 - 0.1) / 4
  - (1-t) 0.1 / 2), sigma = sqrt(1 - alpha^2)).

The network predicts the ``velocity`` d x_t / d t (SiT's default), the ``noise``, or the ``score``
grad log p_t(x_t) = -noise / sigma(t); the latter two may weight the loss per time (SiT's
``velocity`` and ``likelihood`` weights). Sampling integrates the probability-flow ODE
``dx = v(x, t) dt`` or the SDE ``dx = [v + w(t) s(x, t)] dt + sqrt(2 w(t)) dW`` forwards from t = 0,
where ``s`` is the score and ``w`` the chosen diffusion coefficient (:meth:`FlowMatching.diffusion`);
the loops live in :mod:`dit_lightning.sampling.flow`.

The time interval follows SiT (``train_eps`` / ``sample_eps``): velocity prediction on the linear and
GVP paths is stable everywhere and uses [0, 1]; the other combinations stay ``eps`` away from the
ends where a coefficient divides by zero.

Pure PyTorch: no Lightning, nothing of the package above the foundation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Optional, get_args

import torch
from torch import Tensor

from .losses import mean_flat

PathType = Literal["linear", "gvp", "vp"]
Prediction = Literal["velocity", "noise", "score"]
FlowLossWeight = Literal["none", "velocity", "likelihood"]
TimeDistribution = Literal["uniform", "logit_normal"]
DiffusionForm = Literal["sigma", "sbdm", "constant", "linear", "decreasing", "increasing-decreasing"]

# The VP path's beta range (SiT's VPCPlan defaults).
VP_BETA_MIN, VP_BETA_MAX = 0.1, 20.0
# SiT's command-line defaults (train_utils.py), used where its create_transport keeps an epsilon.
DEFAULT_TRAIN_EPS, DEFAULT_SAMPLE_EPS = 1e-5, 1e-3

ModelFn = Callable[..., Tensor]


def _column(t: Tensor, x: Tensor) -> Tensor:
    """Per-sample times (N,) shaped to broadcast over x (N, ...)."""
    return t.reshape(t.shape[0], *([1] * (x.ndim - 1)))


def _check(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class FlowMatching:
    """A flow-matching objective: the path, what the network predicts, the loss weight, the time
    interval and (for training) the distribution of times.

    ``train_eps`` / ``sample_eps``: the distance kept from the ends of [0, 1] in training and in
    sampling; unset (None) they are SiT's: 0 for velocity prediction on the linear and GVP paths
    (which SiT always trains and samples on the whole interval; other values are refused), else
    1e-5 and 1e-3 (its scripts' defaults). ``time_distribution``: ``uniform`` on the training
    interval (SiT), or ``logit_normal``, where the noise level ``1 - t`` is ``sigmoid(n)`` with
    ``n ~ N(time_mean, time_std^2)`` (Esser et al. 2024, SD3's convention: a positive mean puts
    the weight on noisier times), mapped onto the training interval.
    """

    path_type: PathType = "linear"
    prediction: Prediction = "velocity"
    loss_weight: FlowLossWeight = "none"
    train_eps: Optional[float] = None
    sample_eps: Optional[float] = None
    time_distribution: TimeDistribution = "uniform"
    time_mean: float = 0.0
    time_std: float = 1.0

    def __post_init__(self) -> None:
        _check("path_type", self.path_type, get_args(PathType))
        _check("prediction", self.prediction, get_args(Prediction))
        _check("loss weight", self.loss_weight, get_args(FlowLossWeight))
        _check("time_distribution", self.time_distribution, get_args(TimeDistribution))
        if self.loss_weight != "none" and self.prediction == "velocity":
            raise ValueError(
                f"the {self.loss_weight} loss weight applies to noise or score prediction (as in SiT); "
                "velocity prediction is trained with the plain velocity error"
            )
        if self.time_std <= 0:
            raise ValueError(f"time_std must be positive, got {self.time_std}")
        if self.whole_interval:
            for name in ("train_eps", "sample_eps"):
                if getattr(self, name) not in (None, 0, 0.0):
                    raise ValueError(
                        f"{name}={getattr(self, name)}: velocity prediction on the {self.path_type} path is "
                        "trained and sampled on the whole interval [0, 1], as in SiT (leave it unset)"
                    )
            train, sample = 0.0, 0.0
        else:
            train = DEFAULT_TRAIN_EPS if self.train_eps is None else float(self.train_eps)
            sample = DEFAULT_SAMPLE_EPS if self.sample_eps is None else float(self.sample_eps)
            for name, value in (("train_eps", train), ("sample_eps", sample)):
                if not 0.0 <= value < 0.5:
                    raise ValueError(f"{name} must be in [0, 0.5), got {value}")
        object.__setattr__(self, "train_eps", train)  # frozen: resolved once
        object.__setattr__(self, "sample_eps", sample)

    @property
    def whole_interval(self) -> bool:
        """Velocity prediction on the linear or GVP path: no coefficient diverges on [0, 1]."""
        return self.prediction == "velocity" and self.path_type in ("linear", "gvp")

    # ---- the path ---------------------------------------------------------------------------
    def _vp_log_alpha(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """log alpha(t) of the VP path and its derivative (which is beta(t) / 2)."""
        s = 1 - t
        log_alpha = -0.25 * s**2 * (VP_BETA_MAX - VP_BETA_MIN) - 0.5 * s * VP_BETA_MIN
        return log_alpha, 0.5 * s * (VP_BETA_MAX - VP_BETA_MIN) + 0.5 * VP_BETA_MIN

    def alpha(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """The data coefficient alpha(t) and d alpha / dt."""
        if self.path_type == "linear":
            return t, torch.ones_like(t)
        if self.path_type == "gvp":
            return torch.sin(t * (math.pi / 2)), (math.pi / 2) * torch.cos(t * (math.pi / 2))
        log_alpha, d_log_alpha = self._vp_log_alpha(t)
        a = torch.exp(log_alpha)
        return a, a * d_log_alpha

    def sigma(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """The noise coefficient sigma(t) and d sigma / dt."""
        if self.path_type == "linear":
            return 1 - t, -torch.ones_like(t)
        if self.path_type == "gvp":
            return torch.cos(t * (math.pi / 2)), -(math.pi / 2) * torch.sin(t * (math.pi / 2))
        log_alpha, d_log_alpha = self._vp_log_alpha(t)
        a2 = torch.exp(2 * log_alpha)
        s = torch.sqrt(1 - a2)
        return s, -a2 * d_log_alpha / s  # d/dt sqrt(1 - alpha^2) = -alpha^2 (d log alpha) / sigma

    def alpha_log_derivative(self, t: Tensor) -> Tensor:
        """(d alpha / dt) / alpha in the stable closed form of each path."""
        if self.path_type == "linear":
            return 1 / t
        if self.path_type == "gvp":
            return (math.pi / 2) / torch.tan(t * (math.pi / 2))
        return self._vp_log_alpha(t)[1]

    def interpolate(self, x_data: Tensor, noise: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """``(x_t, u_t)``: the point of the path at times ``t`` (N,) and its velocity d x_t / dt."""
        tc = _column(t, x_data)
        a, da = self.alpha(tc)
        s, ds = self.sigma(tc)
        return a * x_data + s * noise, da * x_data + ds * noise

    def flow_coefficients(self, t: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
        """``(f, g2)`` of the probability-flow velocity ``v(x, t) = f(t) x + g2(t) score(x, t)``,
        broadcast to ``like`` (g2 is SiT's "drift variance", the SBDM diffusion coefficient)."""
        tc = _column(t, like)
        if self.path_type == "vp":
            half_beta = 0.5 * (VP_BETA_MIN + (1 - tc) * (VP_BETA_MAX - VP_BETA_MIN))
            return half_beta, half_beta
        f = self.alpha_log_derivative(tc)
        s, ds = self.sigma(tc)
        return f, f * s**2 - s * ds

    # ---- the network's prediction ----------------------------------------------------------
    @staticmethod
    def prediction_of(model_output: Tensor, x: Tensor) -> Tensor:
        """The prediction in a network's output: its first C channels (SiT's networks with
        ``learn_sigma`` output 2C and use the first C), in x's dtype (autocast may give bf16)."""
        c = x.shape[1]
        if model_output.shape[1] not in (c, 2 * c):
            raise ValueError(f"a flow model outputs {c} channels (or {2 * c}), got {model_output.shape[1]}")
        return model_output[:, :c].to(x.dtype)

    def velocity(self, prediction: Tensor, x: Tensor, t: Tensor) -> Tensor:
        """The probability-flow ODE's velocity at (x, t) from the network's prediction."""
        if self.prediction == "velocity":
            return prediction
        f, g2 = self.flow_coefficients(t, x)
        return f * x + g2 * self.score(prediction, x, t)

    def score(self, prediction: Tensor, x: Tensor, t: Tensor) -> Tensor:
        """grad log p_t(x) from the network's prediction."""
        if self.prediction == "score":
            return prediction
        tc = _column(t, x)
        s, ds = self.sigma(tc)
        if self.prediction == "noise":
            return prediction / -s
        a, da = self.alpha(tc)
        # v = (da/a) x + ((da/a) s^2 - s ds) score, solved for the score
        inv_ratio = a / da
        return (inv_ratio * prediction - x) / (s**2 - inv_ratio * ds * s)

    def diffusion(self, x: Tensor, t: Tensor, form: DiffusionForm = "sigma", norm: float = 1.0) -> Tensor:
        """The SDE's diffusion coefficient w(t) (its noise is sqrt(2 w) dW), broadcast to x."""
        tc = _column(t, x)
        if form == "constant":
            w = torch.full_like(tc, norm)
        elif form == "sbdm":
            w = norm * self.flow_coefficients(t, x)[1]
        elif form == "sigma":
            w = norm * self.sigma(tc)[0]
        elif form == "linear":
            w = norm * (1 - tc)
        elif form == "decreasing":
            w = 0.25 * (norm * torch.cos(math.pi * tc) + 1) ** 2
        elif form == "increasing-decreasing":
            w = norm * torch.sin(math.pi * tc) ** 2
        else:
            raise ValueError(f"diffusion form must be one of {', '.join(get_args(DiffusionForm))}, got {form!r}")
        return w

    def sde_drift(self, prediction: Tensor, x: Tensor, t: Tensor, form: DiffusionForm, norm: float) -> Tensor:
        """The SDE's drift v + w(t) score at (x, t)."""
        return self.velocity(prediction, x, t) + self.diffusion(x, t, form, norm) * self.score(prediction, x, t)

    # ---- time ---------------------------------------------------------------------------------
    def interval(
        self, *, sampling: bool, sde: bool = False, diffusion_form: DiffusionForm = "sigma", last_step_size: float = 0.0
    ) -> tuple[float, float]:
        """The time interval (t0, t1) of training, or of an ODE / SDE sampler (SiT's rule). An SDE
        sampler stops ``last_step_size`` short of 1 for its last step; SBDM diffusion needs t0 > 0."""
        eps = float(self.sample_eps if sampling else self.train_eps)  # type: ignore[arg-type]
        t0, t1 = 0.0, 1.0
        end = 1 - eps if (not sde or last_step_size == 0) else 1 - last_step_size
        if self.path_type == "vp":
            t1 = end
        elif self.prediction != "velocity" or sde:
            t0 = eps if (diffusion_form == "sbdm" and sde) or self.prediction != "velocity" else 0.0
            t1 = end
        return t0, t1

    def training_time(self, u: Tensor) -> Tensor:
        """Training times from uniform draws ``u`` in (0, 1): uniform on the training interval,
        or logit-normal (the noise level's logit normal, through the inverse normal CDF of u)."""
        t0, t1 = self.interval(sampling=False)
        if self.time_distribution == "uniform":
            return u * (t1 - t0) + t0
        n = torch.special.ndtri(u.double()).to(u.dtype)
        return torch.sigmoid(-(self.time_mean + self.time_std * n)) * (t1 - t0) + t0

    # ---- training -------------------------------------------------------------------------------
    def loss_weight_at(self, x: Tensor, t: Tensor) -> Optional[Tensor]:
        """SiT's per-sample weight of a noise / score loss (None: unweighted)."""
        if self.loss_weight == "none":
            return None
        g2 = self.flow_coefficients(t, x)[1]
        s = self.sigma(_column(t, x))[0]
        return (g2 / s) ** 2 if self.loss_weight == "velocity" else g2 / s**2

    def training_losses(
        self,
        model_fn: ModelFn,
        x_data: Tensor,
        noise: Tensor,
        t: Tensor,
        model_kwargs: Optional[dict[str, Any]] = None,
    ) -> dict[str, Tensor]:
        """Per-sample (N,) ``loss`` at times ``t`` (N,) for data ``x_data`` and Gaussian ``noise``.

        velocity: ``|v - u_t|^2``; noise: ``weight * |eps - noise|^2``; score:
        ``weight * |sigma_t s + noise|^2`` (means over the non-batch dimensions).
        """
        if noise.shape != x_data.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} != data shape {tuple(x_data.shape)}")
        x_t, u_t = self.interpolate(x_data, noise, t)
        pred = self.prediction_of(model_fn(x_t, t, **(model_kwargs or {})), x_t)
        if self.prediction == "velocity":
            return {"loss": mean_flat((pred - u_t) ** 2)}
        weight = self.loss_weight_at(x_t, t)
        if self.prediction == "noise":
            err = (pred - noise) ** 2
        else:
            err = (pred * self.sigma(_column(t, x_t))[0] + noise) ** 2
        return {"loss": mean_flat(err if weight is None else weight * err)}
