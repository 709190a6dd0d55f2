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
where ``s`` is the score and ``w`` the chosen diffusion coefficient (:meth:`FlowMatching.diffusion`).

The time interval follows SiT's ``create_transport`` (``train_eps`` / ``sample_eps``): velocity
prediction on the linear and GVP paths is stable everywhere and uses [0, 1]; noise and score
prediction on those paths keep 1e-3 from the ends, the VP path 1e-5 in training and 1e-3 in
sampling, where a coefficient divides by zero.

The samplers (SiT's ``transport/integrators.py``), from the noise at t = 0 forwards to the data at t = 1:

- ``ode-euler`` / ``ode-heun``: the probability-flow ODE on ``num_steps`` evenly spaced times from t0
  to t1 (``num_steps - 1`` steps; Heun's second-order method takes two network evaluations a step),
  the steps torchdiffeq's fixed-grid ``euler`` / ``heun2`` take, which SiT calls. ``timestep_shift``
  s > 0 maps that grid by ``t -> s t / (1 + (s - 1) t)`` (LightningDiT's ``transport/integrators.py``;
  their recipe: 0.3, euler, 250 steps), for every ODE sampler.
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
velocity, like DiT guides epsilon; ``cfg_interval`` [lo, hi] in flow times: LightningDiT's
``cfg_interval_start`` 0.11 is [0.11, 1], where they guide only t >= 0.11); the noise of SDE step k
is the caller's ``noise_fn(k, x)``.

Pure PyTorch (+ torchdiffeq for ``ode-dopri5``): no Lightning, nothing of the package above the foundation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional, get_args

import torch
from torch import Tensor

from .losses import mean_flat
from .objective import NoiseFn, SamplerSettings, TrainingObjective

PathType = Literal["linear", "gvp", "vp"]
Prediction = Literal["velocity", "noise", "score"]
FlowLossWeight = Literal["none", "velocity", "likelihood"]
TimeDistribution = Literal["uniform", "logit_normal"]
DiffusionForm = Literal["sigma", "sbdm", "constant", "linear", "decreasing", "increasing-decreasing"]
FlowSampler = Literal["ode-euler", "ode-heun", "ode-dopri5", "sde-euler", "sde-heun"]
LastStep = Literal["mean", "tweedie", "euler", "none"]

# The VP path's beta range (SiT's VPCPlan defaults).
VP_BETA_MIN, VP_BETA_MAX = 0.1, 20.0
# create_transport's epsilons when train_eps / sample_eps are unset (SiT's command line leaves them
# unset): (train, sample) for the VP path, and for noise or score prediction on the linear / GVP paths.
VP_EPS = (1e-5, 1e-3)
NON_VELOCITY_EPS = (1e-3, 1e-3)

ModelFn = Callable[..., Tensor]


def _column(t: Tensor, x: Tensor) -> Tensor:
    """Per-sample times (N,) shaped to broadcast over x (N, ...)."""
    return t.reshape(t.shape[0], *([1] * (x.ndim - 1)))


def _check(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class FlowMatching(TrainingObjective):
    """A flow-matching objective: the path, what the network predicts, the loss weight, the time
    interval and (for training) the distribution of times.

    ``train_eps`` / ``sample_eps``: the distance kept from the ends of [0, 1] in training and in
    sampling; unset (None) they are SiT's ``create_transport``'s: 0 for velocity prediction on the
    linear and GVP paths (which SiT always trains and samples on the whole interval; other values are
    refused), 1e-3 and 1e-3 for noise or score prediction on those paths, 1e-5 and 1e-3 on the VP
    path. (SiT also takes 1e-3 for sampling when only ``sample_eps`` is given; here a given value is
    used.) ``time_distribution``: ``uniform`` on the training
    interval (SiT), or ``logit_normal``, where the noise level ``1 - t`` is ``sigmoid(n)`` with
    ``n ~ N(time_mean, time_std^2)`` (Esser et al. 2024, SD3's convention: a positive mean puts
    the weight on noisier times), mapped onto the training interval. With mean 0 and std 1 this is
    LightningDiT's ``use_lognorm`` (their ``t = sigmoid(n)``, ``n ~ N(0, 1)`` drawn by scipy, is the
    same distribution: the standard normal is symmetric; no clipping, and no eps on the linear path).

    ``cosine_loss``: LightningDiT's velocity direction term (``use_cosine_loss``, Yao et al. 2025,
    github.com/hustvl/LightningDiT ``transport/transport.py``): ``1 - cos(v, u_t)`` over the channels
    at each position, averaged over the positions, added with weight 1 to the velocity MSE (their
    ``train.py``); velocity prediction only, as theirs.
    """

    name: ClassVar[str] = "flow"
    samplers: ClassVar[tuple[str, ...]] = get_args(FlowSampler)
    default_sampler: ClassVar[str] = "sde-euler"  # SiT's published FIDs
    drops_unused_outputs: ClassVar[bool] = True  # SiT's networks output 2C and use the first C

    path_type: PathType = "linear"
    prediction: Prediction = "velocity"
    loss_weight: FlowLossWeight = "none"
    train_eps: Optional[float] = None
    sample_eps: Optional[float] = None
    time_distribution: TimeDistribution = "uniform"
    time_mean: float = 0.0
    time_std: float = 1.0
    cosine_loss: bool = False

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
        if self.cosine_loss and self.prediction != "velocity":
            raise ValueError(
                f"the cosine loss compares a predicted velocity with the path's (LightningDiT's use_cosine_loss): "
                f"it needs velocity prediction, not {self.prediction}; drop model.cosine_loss or predict velocity"
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
            default_train, default_sample = VP_EPS if self.path_type == "vp" else NON_VELOCITY_EPS
            train = default_train if self.train_eps is None else float(self.train_eps)
            sample = default_sample if self.sample_eps is None else float(self.sample_eps)
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
        ``weight * |sigma_t s + noise|^2`` (means over the non-batch dimensions). With
        ``cosine_loss`` the velocity ``loss`` is ``velocity_mse + cosine`` (both returned, for the logs).
        """
        if noise.shape != x_data.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} != data shape {tuple(x_data.shape)}")
        x_t, u_t = self.interpolate(x_data, noise, t)
        pred = self.prediction_of(model_fn(x_t, t, **(model_kwargs or {})), x_t)
        if self.prediction == "velocity":
            mse = mean_flat((pred - u_t) ** 2)
            if not self.cosine_loss:
                return {"loss": mse}
            # LightningDiT: cosine over the channels (dim 1) per position, the mean over the positions
            cosine = mean_flat(1 - torch.nn.functional.cosine_similarity(pred, u_t, dim=1))
            return {"loss": mse + cosine, "velocity_mse": mse, "cosine": cosine}
        weight = self.loss_weight_at(x_t, t)
        if self.prediction == "noise":
            err = (pred - noise) ** 2
        else:
            err = (pred * self.sigma(_column(t, x_t))[0] + noise) ** 2
        return {"loss": mean_flat(err if weight is None else weight * err)}

    # ---- the objective's protocol (TrainingObjective) -----------------------------------------
    @property
    def learns_variance(self) -> bool:
        return False

    def training_terms(
        self, model_fn: ModelFn, x: Tensor, noise: Tensor, u: Tensor, model_kwargs: Mapping[str, Any]
    ) -> dict[str, Tensor]:
        return self.training_losses(model_fn, x, noise, self.training_time(u), dict(model_kwargs))

    def record(self) -> dict[str, Any]:
        return {
            "objective": self.name,
            "path_type": self.path_type,
            "prediction": self.prediction,
            "loss_weighting": self.loss_weight,
            "train_eps": self.train_eps,
            "sample_eps": self.sample_eps,
            "time_distribution": self.time_distribution,
            "time_mean": self.time_mean,
            "time_std": self.time_std,
            "cosine_loss": self.cosine_loss,
        }

    def shared_settings(self) -> dict[str, Any]:
        return {"objective": self.name, "path_type": self.path_type, "prediction": self.prediction}

    def describe(self) -> str:
        cosine = ", cosine loss" if self.cosine_loss else ""
        return f"objective flow ({self.path_type} path, {self.prediction} prediction{cosine})"

    # ---- sampling ---------------------------------------------------------------------------------
    @torch.no_grad()
    def run_sampler(
        self,
        fn: Callable[[Tensor, Tensor, Tensor], Tensor],
        noise: Tensor,
        y: Tensor,
        settings: SamplerSettings,
        noise_fn: Optional[NoiseFn] = None,
    ) -> Tensor:
        """Integrate from the unit ``noise`` (t = 0) to data with flow sampler ``settings.sampler``.

        ``fn(x, t, y)`` is the (guided) network, ``t`` the (N,) times in [0, 1]; its first C channels
        are the prediction. ``noise_fn(step, x)`` gives the noise of SDE step ``step`` (0 = the first);
        without it the steps draw from torch's generator.
        """
        sampler, num_steps = settings.sampler, settings.num_steps
        self.check_sampler(sampler)
        if num_steps < 2:
            raise ValueError(
                f"num_steps must be at least 2 for flow samplers (the times from t0 to t1), got {num_steps}"
            )
        if settings.eta:
            raise ValueError(f"eta={settings.eta} is a DDIM setting: flow sampler {sampler!r} has none (use 0)")
        interval = settings.cfg_interval
        if interval is not None and not 0 <= interval[0] <= interval[1] <= 1:
            raise ValueError(
                f"cfg_interval {list(interval)}: a flow model's interval is in flow times 0 <= lo <= hi <= 1 "
                "(0: noise, 1: data; LightningDiT's cfg_interval_start 0.11 is [0.11, 1]), not DDPM timesteps"
            )
        shift = float(settings.timestep_shift)
        if shift and not sampler.startswith("ode-"):
            raise ValueError(
                f"timestep_shift={shift} shifts the ODE samplers' time grid (LightningDiT's): {sampler} has none "
                "(use an ode- sampler, or 0)"
            )
        x, n = noise, noise.shape[0]

        def prediction(x: Tensor, t: Tensor) -> Tensor:
            return self.prediction_of(fn(x, t, y), x)

        def at(t: Tensor) -> Tensor:  # a time of the grid for every sample
            return torch.ones(n, device=x.device, dtype=x.dtype) * t

        if sampler.startswith("ode-"):
            t0, t1 = self.interval(sampling=True)
            times = torch.linspace(t0, t1, num_steps)  # SiT's grid: float32 linspace on the CPU
            if shift > 0:  # LightningDiT's integrators.py: s t / (1 + (s - 1) t), in float32 as theirs
                times = shift * times / (1 + (shift - 1) * times)
            times = times.to(x.device)

            def velocity(x: Tensor, t: Tensor) -> Tensor:
                return self.velocity(prediction(x, t), x, t)

            if sampler == "ode-dopri5":
                from torchdiffeq import odeint

                return odeint(
                    lambda t, x: velocity(x, at(t)),
                    x,
                    times,
                    method="dopri5",
                    atol=[settings.atol],
                    rtol=[settings.rtol],
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

        form, norm = settings.diffusion_form, settings.diffusion_norm
        last: LastStep = settings.last_step
        last_size = 0.0 if last == "none" else float(settings.last_step_size)
        if last != "none" and not 0 < last_size < 1:
            raise ValueError(f"last_step_size must be in (0, 1) for the {last} last step, got {last_size}")
        if form == "sbdm" and self.sample_eps == 0:
            raise ValueError(
                "diffusion_form sbdm diverges at t = 0, where a velocity model on the linear or GVP path starts: "
                "use sigma (SiT's default) or another form"
            )
        t0, t1 = self.interval(sampling=True, sde=True, diffusion_form=form, last_step_size=last_size)
        if sampler == "sde-heun" and float(self.sigma(torch.tensor(t1))[0]) == 0.0:
            # Heun's corrector evaluates the score at t1, where sigma is exactly 0 on the linear path
            # (NaN, in SiT too); on GVP cos(pi / 2) is not exactly 0 in floating point, and SiT samples it
            raise ValueError(
                f"sde-heun without a last step evaluates the score at t = {t1}, where sigma is 0 on the "
                f"{self.path_type} path (NaN, in SiT too): keep a last step (last_step mean, SiT's default) or "
                "use sde-euler"
            )
        times = torch.linspace(t0, t1, num_steps)
        dt = times[1] - times[0]

        def drift(x: Tensor, t: Tensor) -> Tensor:
            return self.sde_drift(prediction(x, t), x, t, form, norm)

        for k, tk in enumerate(times[:-1]):
            w = noise_fn(k, x) if noise_fn is not None else torch.randn_like(x)
            dw = w * torch.sqrt(dt)
            t = at(tk.to(x.device))
            if sampler == "sde-euler":
                mean = x + drift(x, t) * dt
                x = mean + torch.sqrt(2 * self.diffusion(x, t, form, norm)) * dw
            else:  # SiT's stochastic Heun: noise first, then a Heun step of the drift
                x_hat = x + torch.sqrt(2 * self.diffusion(x, t, form, norm)) * dw
                k1 = drift(x_hat, t)
                k2 = drift(x_hat + dt * k1, t + dt)
                x = x_hat + 0.5 * dt * (k1 + k2)
        t = at(times[-1].to(x.device))
        if last == "mean":
            return x + drift(x, t) * last_size
        if last == "euler":
            return x + self.velocity(prediction(x, t), x, t) * last_size
        if last == "tweedie":
            a, s = self.alpha(t[0])[0], self.sigma(t[0])[0]  # SiT takes the batch's first time (all are t1)
            return x / a + s**2 / a * self.score(prediction(x, t), x, t)
        return x
