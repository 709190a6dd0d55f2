"""An independent yardstick for flow matching: SiT's formulas (github.com/willisma/SiT, ``transport/``
and ``models.py``), transcribed one expression at a time, each commented with the SiT file and
function it comes from. It is deliberately literal (SiT's names: ``x0`` is the noise, ``x1`` the
data; its branches, its dtype handling, its doubled classifier-free-guidance batch, its
torchdiffeq call), so that a reformulation in ``dit_lightning`` that changes a result shows.

A transcription keeps SiT's own signatures and defaults: never edit it to this project's numbers (a
test that compares the project with an edited copy compares the project with itself). Two things
differ from SiT by construction, both marked: the training time ``t`` and the noise
``x0`` are arguments (SiT draws them with ``th.rand`` / ``th.randn_like`` inside
``Transport.sample``), and the SDE's per-step noise comes from a ``randn(step, shape)`` argument
(SiT calls ``th.randn``), so that the same draws can be given to both implementations.
"""

from __future__ import annotations

import numpy as np
import torch as th


def expand_t_like_x(t, x):
    # transport/path.py: expand_t_like_x
    dims = [1] * (len(x.size()) - 1)
    return t.view(t.size(0), *dims)


def mean_flat(x):
    # transport/utils.py: mean_flat
    return th.mean(x, dim=list(range(1, len(x.size()))))


# ---- the paths: transport/path.py --------------------------------------------------------------
class Path:
    def __init__(self, kind):
        self.kind = kind  # "Linear" -> ICPlan, "GVP" -> GVPCPlan, "VP" -> VPCPlan
        self.sigma_min, self.sigma_max = 0.1, 20.0  # VPCPlan.__init__ defaults

    def log_mean_coeff(self, t):
        # VPCPlan.__init__: self.log_mean_coeff
        return -0.25 * ((1 - t) ** 2) * (self.sigma_max - self.sigma_min) - 0.5 * (1 - t) * self.sigma_min

    def d_log_mean_coeff(self, t):
        # VPCPlan.__init__: self.d_log_mean_coeff
        return 0.5 * (1 - t) * (self.sigma_max - self.sigma_min) + 0.5 * self.sigma_min

    def compute_alpha_t(self, t):
        if self.kind == "Linear":  # ICPlan.compute_alpha_t
            return t, 1
        if self.kind == "GVP":  # GVPCPlan.compute_alpha_t
            return th.sin(t * np.pi / 2), np.pi / 2 * th.cos(t * np.pi / 2)
        alpha_t = th.exp(self.log_mean_coeff(t))  # VPCPlan.compute_alpha_t
        return alpha_t, alpha_t * self.d_log_mean_coeff(t)

    def compute_sigma_t(self, t):
        if self.kind == "Linear":  # ICPlan.compute_sigma_t
            return 1 - t, -1
        if self.kind == "GVP":  # GVPCPlan.compute_sigma_t
            return th.cos(t * np.pi / 2), -np.pi / 2 * th.sin(t * np.pi / 2)
        p_sigma_t = 2 * self.log_mean_coeff(t)  # VPCPlan.compute_sigma_t
        sigma_t = th.sqrt(1 - th.exp(p_sigma_t))
        return sigma_t, th.exp(p_sigma_t) * (2 * self.d_log_mean_coeff(t)) / (-2 * sigma_t)

    def compute_d_alpha_alpha_ratio_t(self, t):
        if self.kind == "Linear":  # ICPlan.compute_d_alpha_alpha_ratio_t
            return 1 / t
        if self.kind == "GVP":  # GVPCPlan.compute_d_alpha_alpha_ratio_t
            return np.pi / (2 * th.tan(t * np.pi / 2))
        return self.d_log_mean_coeff(t)  # VPCPlan.compute_d_alpha_alpha_ratio_t

    def compute_drift(self, x, t):
        t = expand_t_like_x(t, x)
        if self.kind == "VP":  # VPCPlan.compute_drift
            beta_t = self.sigma_min + (1 - t) * (self.sigma_max - self.sigma_min)
            return -0.5 * beta_t * x, beta_t / 2
        alpha_ratio = self.compute_d_alpha_alpha_ratio_t(t)  # ICPlan.compute_drift
        sigma_t, d_sigma_t = self.compute_sigma_t(t)
        drift = alpha_ratio * x
        diffusion = alpha_ratio * (sigma_t**2) - sigma_t * d_sigma_t
        return -drift, diffusion

    def compute_diffusion(self, x, t, form="constant", norm=1.0):
        # ICPlan.compute_diffusion (SiT's dict key "inccreasing-decreasing" is spelled right here)
        t = expand_t_like_x(t, x)
        choices = {
            "constant": norm,
            "SBDM": norm * self.compute_drift(x, t)[1],
            "sigma": norm * self.compute_sigma_t(t)[0],
            "linear": norm * (1 - t),
            "decreasing": 0.25 * (norm * th.cos(np.pi * t) + 1) ** 2,
            "increasing-decreasing": norm * th.sin(np.pi * t) ** 2,
        }
        return choices[form]

    def get_score_from_velocity(self, velocity, x, t):
        # ICPlan.get_score_from_velocity
        t = expand_t_like_x(t, x)
        alpha_t, d_alpha_t = self.compute_alpha_t(t)
        sigma_t, d_sigma_t = self.compute_sigma_t(t)
        mean = x
        reverse_alpha_ratio = alpha_t / d_alpha_t
        var = sigma_t**2 - reverse_alpha_ratio * d_sigma_t * sigma_t
        return (reverse_alpha_ratio * velocity - mean) / var

    def plan(self, t, x0, x1):
        # ICPlan.plan, compute_xt / compute_mu_t and compute_ut
        te = expand_t_like_x(t, x1)
        alpha_t, d_alpha_t = self.compute_alpha_t(te)
        sigma_t, d_sigma_t = self.compute_sigma_t(te)
        xt = alpha_t * x1 + sigma_t * x0
        ut = d_alpha_t * x1 + d_sigma_t * x0
        return t, xt, ut


# ---- transport/__init__.py: create_transport, its signature and defaults as SiT's (train_utils.py's
# command line leaves --train-eps / --sample-eps unset, so these None defaults are what SiT runs with) --
def create_transport(path_type="Linear", prediction="velocity", loss_weight=None, train_eps=None, sample_eps=None):
    if path_type == "VP":
        train_eps_new = 1e-5 if train_eps is None else train_eps
        sample_eps_new = 1e-3 if train_eps is None else sample_eps
        train_eps, sample_eps = train_eps_new, sample_eps_new
    elif path_type in ("GVP", "Linear") and prediction != "velocity":
        train_eps_new = 1e-3 if train_eps is None else train_eps
        sample_eps_new = 1e-3 if train_eps is None else sample_eps
        train_eps, sample_eps = train_eps_new, sample_eps_new
    else:  # velocity & [GVP, LINEAR] is stable everywhere
        train_eps = 0
        sample_eps = 0
    return Transport(prediction, path_type, loss_weight, train_eps, sample_eps)


class Transport:
    def __init__(self, model_type, path_type, loss_type, train_eps, sample_eps):
        # transport/transport.py: Transport.__init__
        self.model_type, self.loss_type = model_type, loss_type
        self.path_sampler = Path(path_type)
        self.train_eps, self.sample_eps = train_eps, sample_eps

    def check_interval(self, train_eps, sample_eps, *, diffusion_form="SBDM", sde=False, reverse=False, eval=False,
                       last_step_size=0.0):  # fmt: skip
        # Transport.check_interval
        t0 = 0
        t1 = 1
        eps = train_eps if not eval else sample_eps
        if self.path_sampler.kind == "VP":
            t1 = 1 - eps if (not sde or last_step_size == 0) else 1 - last_step_size
        elif self.model_type != "velocity" or sde:
            t0 = eps if (diffusion_form == "SBDM" and sde) or self.model_type != "velocity" else 0
            t1 = 1 - eps if (not sde or last_step_size == 0) else 1 - last_step_size
        if reverse:
            t0, t1 = 1 - t0, 1 - t1
        return t0, t1

    def training_losses(self, model, x1, t, x0, model_kwargs=None):
        # Transport.training_losses; t and x0 given instead of drawn by Transport.sample
        if model_kwargs is None:
            model_kwargs = {}
        t, xt, ut = self.path_sampler.plan(t, x0, x1)
        model_output = model(xt, t, **model_kwargs)
        terms = {}
        if self.model_type == "velocity":
            terms["loss"] = mean_flat((model_output - ut) ** 2)
        else:
            _, drift_var = self.path_sampler.compute_drift(xt, t)
            sigma_t, _ = self.path_sampler.compute_sigma_t(expand_t_like_x(t, xt))
            if self.loss_type == "velocity":
                weight = (drift_var / sigma_t) ** 2
            elif self.loss_type == "likelihood":
                weight = drift_var / (sigma_t**2)
            else:
                weight = 1
            if self.model_type == "noise":
                terms["loss"] = mean_flat(weight * ((model_output - x0) ** 2))
            else:
                terms["loss"] = mean_flat(weight * ((model_output * sigma_t + x0) ** 2))
        return terms

    def get_drift(self):
        # Transport.get_drift: score_ode / noise_ode / velocity_ode
        def score_ode(x, t, model, **model_kwargs):
            drift_mean, drift_var = self.path_sampler.compute_drift(x, t)
            model_output = model(x, t, **model_kwargs)
            return -drift_mean + drift_var * model_output

        def noise_ode(x, t, model, **model_kwargs):
            drift_mean, drift_var = self.path_sampler.compute_drift(x, t)
            sigma_t, _ = self.path_sampler.compute_sigma_t(expand_t_like_x(t, x))
            model_output = model(x, t, **model_kwargs)
            score = model_output / -sigma_t
            return -drift_mean + drift_var * score

        def velocity_ode(x, t, model, **model_kwargs):
            return model(x, t, **model_kwargs)

        return {"noise": noise_ode, "score": score_ode, "velocity": velocity_ode}[self.model_type]

    def get_score(self):
        # Transport.get_score
        if self.model_type == "noise":
            return lambda x, t, model, **kw: (
                model(x, t, **kw) / -self.path_sampler.compute_sigma_t(expand_t_like_x(t, x))[0]
            )
        if self.model_type == "score":
            return lambda x, t, model, **kw: model(x, t, **kw)
        return lambda x, t, model, **kw: self.path_sampler.get_score_from_velocity(model(x, t, **kw), x, t)


# ---- transport/transport.py: Sampler; transport/integrators.py: ode, sde -------------------------
def sample_ode(transport, z, model, *, sampling_method="dopri5", num_steps=50, atol=1e-6, rtol=1e-3, **model_kwargs):
    """Sampler.sample_ode + integrators.ode.sample; returns the last point."""
    from torchdiffeq import odeint

    drift = transport.get_drift()
    t0, t1 = transport.check_interval(transport.train_eps, transport.sample_eps, sde=False, eval=True,
                                      reverse=False, last_step_size=0.0)  # fmt: skip
    ts = th.linspace(t0, t1, num_steps)  # integrators.ode.__init__
    device = z.device

    def _fn(t, x):  # integrators.ode.sample._fn
        t = th.ones(x.size(0)).to(device) * t
        return drift(x, t, model, **model_kwargs)

    samples = odeint(_fn, z, ts.to(device), method=sampling_method, atol=[atol], rtol=[rtol])
    return samples[-1]


def sample_sde(transport, z, model, randn, *, sampling_method="Euler", diffusion_form="sigma", diffusion_norm=1.0,
               last_step="Mean", last_step_size=0.04, num_steps=250, **model_kwargs):  # fmt: skip
    """Sampler.sample_sde + integrators.sde.sample; ``randn(step, shape)`` replaces ``th.randn``."""
    drift_fn, score_fn = transport.get_drift(), transport.get_score()
    path = transport.path_sampler
    if last_step is None:
        last_step_size = 0.0

    def diffusion_fn(x, t):  # Sampler.__get_sde_diffusion_and_drift
        return path.compute_diffusion(x, t, form=diffusion_form, norm=diffusion_norm)

    def sde_drift(x, t, model, **kw):
        return drift_fn(x, t, model, **kw) + diffusion_fn(x, t) * score_fn(x, t, model, **kw)

    t0, t1 = transport.check_interval(transport.train_eps, transport.sample_eps, diffusion_form=diffusion_form,
                                      sde=True, eval=True, reverse=False, last_step_size=last_step_size)  # fmt: skip
    ts = th.linspace(t0, t1, num_steps)  # integrators.sde.__init__
    dt = ts[1] - ts[0]

    def euler_maruyama_step(x, mean_x, t, model, step, **kw):  # integrators.sde.__Euler_Maruyama_step
        w_cur = randn(step, x.size()).to(x)
        t = th.ones(x.size(0)).to(x) * t
        dw = w_cur * th.sqrt(dt)
        drift = sde_drift(x, t, model, **kw)
        diffusion = diffusion_fn(x, t)
        mean_x = x + drift * dt
        x = mean_x + th.sqrt(2 * diffusion) * dw
        return x, mean_x

    def heun_step(x, _, t, model, step, **kw):  # integrators.sde.__Heun_step
        w_cur = randn(step, x.size()).to(x)
        dw = w_cur * th.sqrt(dt)
        t_cur = th.ones(x.size(0)).to(x) * t
        diffusion = diffusion_fn(x, t_cur)
        xhat = x + th.sqrt(2 * diffusion) * dw
        K1 = sde_drift(xhat, t_cur, model, **kw)
        xp = xhat + dt * K1
        K2 = sde_drift(xp, t_cur + dt, model, **kw)
        return xhat + 0.5 * dt * (K1 + K2), xhat

    step_fn = {"Euler": euler_maruyama_step, "Heun": heun_step}[sampling_method]
    x, mean_x = z, z
    for step, ti in enumerate(ts[:-1]):  # integrators.sde.sample
        with th.no_grad():
            x, mean_x = step_fn(x, mean_x, ti, model, step, **model_kwargs)
    t = th.ones(z.size(0), device=z.device) * t1  # Sampler.sample_sde._sample
    if last_step is None:  # Sampler.__get_last_step
        return x
    if last_step == "Mean":
        return x + sde_drift(x, t, model, **model_kwargs) * last_step_size
    if last_step == "Tweedie":
        alpha, sigma = path.compute_alpha_t, path.compute_sigma_t
        return x / alpha(t)[0][0] + (sigma(t)[0][0] ** 2) / alpha(t)[0][0] * score_fn(x, t, model, **model_kwargs)
    return x + drift_fn(x, t, model, **model_kwargs) * last_step_size  # "Euler"


# ---- models.py: SiT.forward's output and SiT.forward_with_cfg -------------------------------------
def sit_forward(net, learn_sigma):
    """SiT.forward: the network's output, its first half when ``learn_sigma`` (x.chunk(2, dim=1))."""

    def forward(x, t, y):
        out = net(x, t, y)
        if learn_sigma:
            out, _ = out.chunk(2, dim=1)
        return out

    return forward


def sit_forward_with_cfg(forward, guide_channels=3):
    """SiT.forward_with_cfg: guidance on the first 3 channels (SiT's default; ``None``: all, the
    "standard approach" of its comment) of a doubled batch [z, z] with labels [y, null]."""

    def forward_with_cfg(x, t, y, cfg_scale):
        half = x[: len(x) // 2]
        combined = th.cat([half, half], dim=0)
        model_out = forward(combined, t, y)
        n = model_out.shape[1] if guide_channels is None else guide_channels
        eps, rest = model_out[:, :n], model_out[:, n:]
        cond_eps, uncond_eps = th.split(eps, len(eps) // 2, dim=0)
        half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
        eps = th.cat([half_eps, half_eps], dim=0)
        return th.cat([eps, rest], dim=1)

    return forward_with_cfg


def sit_state_dict(depth=12, hidden=384, patch=2, in_channels=4, input_size=32, num_classes=1000, learn_sigma=True,
                   seed=0):  # fmt: skip
    """Random weights under the names and shapes SiT's models.py gives a SiT (defaults: SiT-S/2 at
    256 px, ``learn_sigma`` on as in its train.py and the released SiT-XL-2-256x256.pt). Listed
    here from SiT's modules, not from dit_lightning's, so that a naming difference shows."""
    g = th.Generator().manual_seed(seed)
    out_channels = in_channels * 2 if learn_sigma else in_channels  # SiT.__init__
    tokens = (input_size // patch) ** 2
    shapes = {
        "pos_embed": (1, tokens, hidden),  # nn.Parameter(requires_grad=False): in the state dict
        "x_embedder.proj.weight": (hidden, in_channels, patch, patch),  # timm PatchEmbed's Conv2d
        "x_embedder.proj.bias": (hidden,),
        "t_embedder.mlp.0.weight": (hidden, 256),  # TimestepEmbedder: Linear, SiLU, Linear
        "t_embedder.mlp.0.bias": (hidden,),
        "t_embedder.mlp.2.weight": (hidden, hidden),
        "t_embedder.mlp.2.bias": (hidden,),
        "y_embedder.embedding_table.weight": (num_classes + 1, hidden),  # + the null class (dropout 0.1)
        "final_layer.linear.weight": (patch * patch * out_channels, hidden),
        "final_layer.linear.bias": (patch * patch * out_channels,),
        "final_layer.adaLN_modulation.1.weight": (2 * hidden, hidden),
        "final_layer.adaLN_modulation.1.bias": (2 * hidden,),
    }
    for i in range(depth):  # SiTBlock: timm Attention (qkv_bias) and Mlp, adaLN_modulation (SiLU, Linear)
        shapes.update({
            f"blocks.{i}.attn.qkv.weight": (3 * hidden, hidden),
            f"blocks.{i}.attn.qkv.bias": (3 * hidden,),
            f"blocks.{i}.attn.proj.weight": (hidden, hidden),
            f"blocks.{i}.attn.proj.bias": (hidden,),
            f"blocks.{i}.mlp.fc1.weight": (4 * hidden, hidden),
            f"blocks.{i}.mlp.fc1.bias": (4 * hidden,),
            f"blocks.{i}.mlp.fc2.weight": (hidden, 4 * hidden),
            f"blocks.{i}.mlp.fc2.bias": (hidden,),
            f"blocks.{i}.adaLN_modulation.1.weight": (6 * hidden, hidden),
            f"blocks.{i}.adaLN_modulation.1.bias": (6 * hidden,),
        })  # fmt: skip
    return {k: th.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
