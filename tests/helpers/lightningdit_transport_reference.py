"""LightningDiT's flow objective and ODE sampler, transcribed as an independent yardstick.

Source: github.com/hustvl/LightningDiT at commit 2725fed ("Update README.md"): ``transport/__init__.py``
(``create_transport``), ``transport/transport.py`` (``Transport``: ``check_interval``,
``sample_logit_normal``, ``sample``, ``training_losses``, ``get_drift``; ``Sampler.sample_ode``),
``transport/path.py`` (``ICPlan``, the linear path of LightningDiT's configs), ``transport/utils.py``
(``mean_flat``), ``transport/integrators.py`` (``ode`` with ``timestep_shift``) and
``models/lightningdit.py`` (``LightningDiT.forward_with_cfg``: the CFG interval).

Their signatures and defaults are kept: never edit this file to the project's numbers. What is left
out: the GVP / VP paths (``PathType.GVP`` / ``VP`` are not wired: LightningDiT's configs train on the
linear path; ``tests/helpers/sit_reference.py`` transcribes SiT's paths), the SDE sampler, the
likelihood, the score / noise drifts and the partial-range time draws (``partitial_train``,
``sample_in_range``), none of which LightningDiT's published recipe uses. The draws are theirs
(``th.randn_like`` for the noise, ``scipy.stats.norm.rvs`` from numpy's global generator for the
logit-normal time): a test seeds both generators and gives the same draws to the project.
"""

from __future__ import annotations

import enum

import numpy as np
import torch as th
from scipy.stats import norm
from torchdiffeq import odeint


# ---- transport/utils.py -------------------------------------------------------------------------
def mean_flat(x):
    """
    Take the mean over all non-batch dimensions.
    """
    return th.mean(x, dim=list(range(1, len(x.size()))))


# ---- transport/path.py --------------------------------------------------------------------------
def expand_t_like_x(t, x):
    dims = [1] * (len(x.size()) - 1)
    t = t.view(t.size(0), *dims)
    return t


class ICPlan:
    """Linear Coupling Plan"""

    def __init__(self, sigma=0.0):
        self.sigma = sigma

    def compute_alpha_t(self, t):
        return t, 1

    def compute_sigma_t(self, t):
        return 1 - t, -1

    def compute_d_alpha_alpha_ratio_t(self, t):
        return 1 / t

    def compute_drift(self, x, t):
        t = expand_t_like_x(t, x)
        alpha_ratio = self.compute_d_alpha_alpha_ratio_t(t)
        sigma_t, d_sigma_t = self.compute_sigma_t(t)
        drift = alpha_ratio * x
        diffusion = alpha_ratio * (sigma_t**2) - sigma_t * d_sigma_t
        return -drift, diffusion

    def compute_mu_t(self, t, x0, x1):
        t = expand_t_like_x(t, x1)
        alpha_t, _ = self.compute_alpha_t(t)
        sigma_t, _ = self.compute_sigma_t(t)
        return alpha_t * x1 + sigma_t * x0

    def compute_xt(self, t, x0, x1):
        xt = self.compute_mu_t(t, x0, x1)
        return xt

    def compute_ut(self, t, x0, x1, xt):
        t = expand_t_like_x(t, x1)
        _, d_alpha_t = self.compute_alpha_t(t)
        _, d_sigma_t = self.compute_sigma_t(t)
        return d_alpha_t * x1 + d_sigma_t * x0

    def plan(self, t, x0, x1):
        xt = self.compute_xt(t, x0, x1)
        ut = self.compute_ut(t, x0, x1, xt)
        return t, xt, ut


# ---- transport/transport.py ---------------------------------------------------------------------
class ModelType(enum.Enum):
    NOISE = enum.auto()
    SCORE = enum.auto()
    VELOCITY = enum.auto()


class PathType(enum.Enum):
    LINEAR = enum.auto()
    GVP = enum.auto()
    VP = enum.auto()


class WeightType(enum.Enum):
    NONE = enum.auto()
    VELOCITY = enum.auto()
    LIKELIHOOD = enum.auto()


class Transport:
    def __init__(
        self,
        *,
        model_type,
        path_type,
        loss_type,
        train_eps,
        sample_eps,
        use_cosine_loss=False,
        use_lognorm=False,
        partitial_train=None,
        partial_ratio=1.0,
        shift_lg=False,
    ):
        path_options = {PathType.LINEAR: ICPlan}  # GVP / VP: not transcribed (see the docstring)
        self.loss_type = loss_type
        self.model_type = model_type
        self.path_sampler = path_options[path_type]()
        self.train_eps = train_eps
        self.sample_eps = sample_eps
        self.use_cosine_loss = use_cosine_loss
        self.use_lognorm = use_lognorm
        self.partitial_train = partitial_train
        self.partial_ratio = partial_ratio
        self.shift_lg = shift_lg

    def check_interval(
        self,
        train_eps,
        sample_eps,
        *,
        diffusion_form="SBDM",
        sde=False,
        reverse=False,
        eval=False,
        last_step_size=0.0,
    ):
        t0 = 0
        t1 = 1
        eps = train_eps if not eval else sample_eps
        if type(self.path_sampler) in [ICPlan] and (self.model_type != ModelType.VELOCITY or sde):
            t0 = eps if (diffusion_form == "SBDM" and sde) or self.model_type != ModelType.VELOCITY else 0
            t1 = 1 - eps if (not sde or last_step_size == 0) else 1 - last_step_size
        if reverse:
            t0, t1 = 1 - t0, 1 - t1
        return t0, t1

    def sample_logit_normal(self, mu, sigma, size=1):
        samples = norm.rvs(loc=mu, scale=sigma, size=size)
        samples = 1 / (1 + np.exp(-samples))
        samples = th.tensor(samples, dtype=th.float32)
        return samples

    def sample(self, x1, sp_timesteps=None, shifted_mu=0):
        x0 = th.randn_like(x1)
        t0, t1 = self.check_interval(self.train_eps, self.sample_eps)
        if not self.use_lognorm:
            if self.partitial_train is not None and th.rand(1) < self.partial_ratio:
                t = (
                    th.rand((x1.shape[0],)) * (self.partitial_train[1] - self.partitial_train[0])
                    + self.partitial_train[0]
                )
            else:
                t = th.rand((x1.shape[0],)) * (t1 - t0) + t0
        else:
            if not self.shift_lg:
                if self.partitial_train is not None and th.rand(1) < self.partial_ratio:
                    raise NotImplementedError("sample_in_range: not transcribed")
                else:
                    t = self.sample_logit_normal(0, 1, size=x1.shape[0]) * (t1 - t0) + t0
            else:
                assert self.partitial_train is None, (
                    "Shifted lognormal distribution is not compatible with partial training"
                )
                t = self.sample_logit_normal(shifted_mu, 1, size=x1.shape[0]) * (t1 - t0) + t0
        if sp_timesteps is not None:
            t = th.rand((x1.shape[0],)) * (sp_timesteps[1] - sp_timesteps[0]) + sp_timesteps[0]
        t = t.to(x1)
        return t, x0, x1

    def training_losses(
        self,
        model,
        x1,
        model_kwargs=None,
        sp_timesteps=None,
        shifted_mu=0,
    ):
        if model_kwargs == None:  # noqa: E711 - theirs
            model_kwargs = {}
        t, x0, x1 = self.sample(x1, sp_timesteps, shifted_mu)
        t, xt, ut = self.path_sampler.plan(t, x0, x1)
        model_output = model(xt, t, **model_kwargs)
        B, *_, C = xt.shape
        assert model_output.size() == (B, *xt.size()[1:-1], C)
        terms = {}
        terms["pred"] = model_output
        if self.model_type == ModelType.VELOCITY:
            terms["loss"] = mean_flat((model_output - ut) ** 2)
            if self.use_cosine_loss:
                terms["cos_loss"] = mean_flat(1 - th.nn.functional.cosine_similarity(model_output, ut, dim=1))
        else:
            raise NotImplementedError("noise / score prediction: not transcribed (LightningDiT trains velocity)")
        return terms

    def get_drift(self):
        def velocity_ode(x, t, model, **model_kwargs):
            model_output = model(x, t, **model_kwargs)
            return model_output

        if self.model_type != ModelType.VELOCITY:
            raise NotImplementedError("noise / score drifts: not transcribed")
        drift_fn = velocity_ode

        def body_fn(x, t, model, **model_kwargs):
            model_output = drift_fn(x, t, model, **model_kwargs)
            assert model_output.shape == x.shape, "Output shape from ODE solver must match input shape"
            return model_output

        return body_fn


# ---- train.py: the loss LightningDiT optimises (lines 201-206) -----------------------------------
def train_loss(transport, model, x, model_kwargs):
    loss_dict = transport.training_losses(model, x, model_kwargs)
    if "cos_loss" in loss_dict:
        mse_loss = loss_dict["loss"].mean()
        loss = loss_dict["cos_loss"].mean() + mse_loss
    else:
        loss = loss_dict["loss"].mean()
    return loss


# ---- transport/__init__.py ----------------------------------------------------------------------
def create_transport(
    path_type="Linear",
    prediction="velocity",
    loss_weight=None,
    train_eps=None,
    sample_eps=None,
    use_cosine_loss=None,
    use_lognorm=None,
    partitial_train=None,
    partial_ratio=1.0,
    shift_lg=False,
):
    if prediction == "noise":
        model_type = ModelType.NOISE
    elif prediction == "score":
        model_type = ModelType.SCORE
    else:
        model_type = ModelType.VELOCITY
    if loss_weight == "velocity":
        loss_type = WeightType.VELOCITY
    elif loss_weight == "likelihood":
        loss_type = WeightType.LIKELIHOOD
    else:
        loss_type = WeightType.NONE
    path_choice = {"Linear": PathType.LINEAR, "GVP": PathType.GVP, "VP": PathType.VP}
    path_type = path_choice[path_type]
    if path_type in [PathType.VP]:
        train_eps = 1e-5 if train_eps is None else train_eps
        sample_eps = 1e-3 if train_eps is None else sample_eps
    elif path_type in [PathType.GVP, PathType.LINEAR] and model_type != ModelType.VELOCITY:
        train_eps = 1e-3 if train_eps is None else train_eps
        sample_eps = 1e-3 if train_eps is None else sample_eps
    else:
        train_eps = 0
        sample_eps = 0
    return Transport(
        model_type=model_type,
        path_type=path_type,
        loss_type=loss_type,
        train_eps=train_eps,
        sample_eps=sample_eps,
        use_cosine_loss=use_cosine_loss,
        use_lognorm=use_lognorm,
        partitial_train=partitial_train,
        partial_ratio=partial_ratio,
        shift_lg=shift_lg,
    )


# ---- transport/integrators.py -------------------------------------------------------------------
class ode:
    """ODE solver class"""

    def __init__(
        self,
        drift,
        *,
        t0,
        t1,
        sampler_type,
        num_steps,
        atol,
        rtol,
        timestep_shift,
    ):
        assert t0 < t1, "ODE sampler has to be in forward time"
        self.drift = drift
        self.t = th.linspace(t0, t1, num_steps)
        if timestep_shift > 0:

            def compute_tm(t_n, timestep_shift):
                numerator = timestep_shift * t_n
                denominator = 1 + (timestep_shift - 1) * t_n
                return numerator / denominator

            self.t = th.tensor([compute_tm(t_n, timestep_shift) for t_n in self.t])
        self.atol = atol
        self.rtol = rtol
        self.sampler_type = sampler_type

    def sample(self, x, model, **model_kwargs):
        device = x[0].device if isinstance(x, tuple) else x.device

        def _fn(t, x):
            t = th.ones(x[0].size(0)).to(device) * t if isinstance(x, tuple) else th.ones(x.size(0)).to(device) * t
            model_output = self.drift(x, t, model, **model_kwargs)
            return model_output

        t = self.t.to(device)
        atol = [self.atol] * len(x) if isinstance(x, tuple) else [self.atol]
        rtol = [self.rtol] * len(x) if isinstance(x, tuple) else [self.rtol]
        samples = odeint(_fn, x, t, method=self.sampler_type, atol=atol, rtol=rtol)
        return samples


# ---- transport/transport.py: Sampler.sample_ode ---------------------------------------------------
class Sampler:
    def __init__(self, transport):
        self.transport = transport
        self.drift = self.transport.get_drift()

    def sample_ode(
        self,
        *,
        sampling_method="dopri5",
        num_steps=50,
        atol=1e-6,
        rtol=1e-3,
        reverse=False,
        timestep_shift=0.0,
    ):
        if reverse:
            drift = lambda x, t, model, **kwargs: self.drift(x, th.ones_like(t) * (1 - t), model, **kwargs)  # noqa: E731
        else:
            drift = self.drift
        t0, t1 = self.transport.check_interval(
            self.transport.train_eps,
            self.transport.sample_eps,
            sde=False,
            eval=True,
            reverse=reverse,
            last_step_size=0.0,
        )
        _ode = ode(
            drift=drift,
            t0=t0,
            t1=t1,
            sampler_type=sampling_method,
            num_steps=num_steps,
            atol=atol,
            rtol=rtol,
            timestep_shift=timestep_shift,
        )
        return _ode.sample


# ---- models/lightningdit.py: LightningDiT.forward_with_cfg (``self.forward`` is ``forward``) ------
def forward_with_cfg(forward, x, t, y, cfg_scale, cfg_interval=None, cfg_interval_start=None):
    half = x[: len(x) // 2]
    combined = th.cat([half, half], dim=0)
    model_out = forward(combined, t, y)
    eps, rest = model_out[:, :3], model_out[:, 3:]
    cond_eps, uncond_eps = th.split(eps, len(eps) // 2, dim=0)
    half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
    if cfg_interval is True:
        timestep = t[0]
        if timestep < cfg_interval_start:
            half_eps = cond_eps
    eps = th.cat([half_eps, half_eps], dim=0)
    return th.cat([eps, rest], dim=1)
