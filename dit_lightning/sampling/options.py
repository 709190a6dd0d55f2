"""The sampling options: one dataclass for every setting that, with the network and a sample's
index, fixes the sample's image.

The sampling loop (:func:`~.loop.sample_latents`), ``DiTModule.sample``, the ``sample`` and
``evaluate`` commands and ``GenerationMetrics`` all take a :class:`SamplingOptions`. The commands
and the callback take its fields as flat keyword arguments (``**sampling``) and build it with
``SamplingOptions(**sampling)``: jsonargparse follows that call, so the command lines keep flat
flags (``--sampler``, ``--num_steps``, ``--evaluation.cfg_scale``) with this class's documentation
as their help, and the records (``sample_config.json`` and its resume check, the metrics files)
list every field.

So a new option is a field here (its default: the behaviour before it existed, which is also
what an older ``sample_config.json`` without it meant), the code that uses it in :mod:`.loop` or
:mod:`.schedulers`, and a test; no front end names it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from ..diffusion import DiffusionForm, LastStep
from ..precision import SamplingPrecision
from ..vae import clip_denoised_for
from .schedulers import Sampler


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """How latents are sampled: every setting that, with the network and the sample's index,
    fixes its image (the batch size, the device and the number of ranks do not).

    ``None`` means unset: the model's setting (:meth:`from_hparams`: a ``DiTModule``'s, or the
    one a Lightning checkpoint recorded), else the library's default
    (:class:`ResolvedSamplingOptions`: DDPM, 250 steps, no guidance, no x0 clamp).

    Attributes:
        sampler: "ddpm" (ancestral, learned variance) or "ddim" (bit-exact with the reference);
            or a diffusers scheduler with the model's betas: "dpm++2m", "dpm++2m-karras",
            "dpm++2m-sde", "unipc", "deis", "euler", "euler-a", "diffusers-ddim",
            "diffusers-ddpm" (docs/sampling.md). Flow-matching models (objective flow) take SiT's:
            "ode-euler", "ode-heun", "ode-dopri5" (adaptive; atol / rtol), "sde-euler"
            (Euler-Maruyama, SiT's published FIDs), "sde-heun" (docs/recipes.md). Unset: the
            model's, else DDPM.
        num_steps: respaced sampling steps (for the diffusers schedulers: network evaluations; for
            the flow samplers: the evenly spaced times from noise to data, num_steps - 1 steps,
            plus the SDE's last step; ode-dopri5 chooses its own steps); unset: the model's, else
            250 (the paper's).
        cfg_scale: classifier-free guidance scale (1: none; the paper's best FID used 1.5);
            unset: the model's, else 1.
        guide_channels: guide only the first N epsilon channels; 3 reproduces the reference
            implementation the published FIDs were computed with; unset: the model's, else all
            (correct).
        cfg_interval: guide only the steps at training timesteps lo <= t <= hi, e.g. [200, 700]
            (0: the data end, diffusion_steps - 1: pure noise); the others take the conditional
            prediction, at half the cost. Guidance is harmful at the highest noise levels and
            largely unnecessary at the lowest (Kynkäänniemi et al. 2024, "Applying guidance in a
            limited interval", arXiv 2404.07724). Flow models take flow times instead,
            0 <= lo <= hi <= 1 (0: noise, 1: data): LightningDiT's ``cfg_interval_start`` 0.11
            is [0.11, 1]. Unset: every step.
        class_token_cfg_scale: the guidance scale of REG's class token, which a DiT with
            ``class_token_dim`` samples jointly with the latents (flow samplers): unset (None): the
            same as cfg_scale (REG's eval.sh passes 2.3 for both); 0: the conditional token
            velocity, unguided (REG's ``--cls-cfg-scale 0``). Guided on the steps cfg_scale
            guides (cfg_interval); DiTs without the token leave it aside.
        eta: DDIM noise (0: deterministic; ddim and diffusers-ddim).
        clip_denoised: clamp each step's x_0 estimate to [-1, 1]; unset: the store's rule, on for
            pixel stores (their data lie in [-1, 1]), off for VAE latents (unbounded; the
            published setting). The DDPM samplers only: the flow samplers have no such step
            (as SiT) and leave it aside.
        atol: absolute error tolerance of ode-dopri5 (SiT's default 1e-6).
        rtol: relative error tolerance of ode-dopri5 (SiT's default 1e-3).
        diffusion_form: the diffusion coefficient w(t) of the flow SDE samplers (noise
            sqrt(2 w) dW): "sigma" (w = sigma(t), SiT's default), "sbdm" (the score-based
            diffusion model's), "constant", "linear" (1 - t), "decreasing", "increasing-decreasing";
            times diffusion_norm.
        diffusion_norm: the scale of the flow SDE's diffusion coefficient (SiT's default 1).
        last_step: the flow SDE's last step from 1 - last_step_size to 1: "mean" (a drift step
            without noise, SiT's default), "tweedie" (the denoised estimate), "euler" (an ODE
            step) or "none" (stop at 1 - sample_eps).
        last_step_size: the length of the flow SDE's last step (SiT's default 0.04).
        timestep_shift: the flow ODE samplers' time grid t -> s t / (1 + (s - 1) t) for s > 0
            (LightningDiT's ``timestep_shift``; s < 1 puts the steps near the noise: their
            recipe's 0.3); 0: the evenly spaced grid (SiT's). The flow SDE samplers refuse it; the
            DDPM samplers leave it aside, as the other flow settings.
        precision: autocast of the DiT: "fp32", "bf16" or "fp16" (changes the images slightly).
        seed: key of every random number (the noise, the classes of labels "random"): sample i
            depends only on (seed, i).
    """

    sampler: Optional[Sampler] = None
    num_steps: Optional[int] = None
    cfg_scale: Optional[float] = None
    guide_channels: Optional[int] = None
    cfg_interval: Optional[tuple[float, float]] = None
    class_token_cfg_scale: Optional[float] = None
    eta: float = 0.0
    clip_denoised: Optional[bool] = None
    precision: SamplingPrecision = "fp32"
    seed: int = 0
    atol: float = 1e-6
    rtol: float = 1e-3
    diffusion_form: DiffusionForm = "sigma"
    diffusion_norm: float = 1.0
    last_step: LastStep = "mean"
    last_step_size: float = 0.04
    timestep_shift: float = 0.0

    def __post_init__(self) -> None:
        if self.timestep_shift < 0:
            raise ValueError(
                f"timestep_shift {self.timestep_shift}: give s > 0 (LightningDiT's 0.3), or 0 for the even grid"
            )
        if self.atol < 0 or self.rtol < 0 or (self.atol == 0 and self.rtol == 0):
            raise ValueError(
                f"atol {self.atol} / rtol {self.rtol}: ode-dopri5's tolerances must be >= 0 and not both 0 "
                "(SiT's defaults: atol 1e-6, rtol 1e-3)"
            )
        if self.class_token_cfg_scale is not None and self.class_token_cfg_scale < 0:
            raise ValueError(
                f"class_token_cfg_scale {self.class_token_cfg_scale}: give a scale >= 0 (0: the conditional "
                "token velocity, REG's --cls-cfg-scale 0), or leave it unset for cfg_scale's"
            )
        if self.cfg_interval is not None:
            interval = tuple(float(t) for t in self.cfg_interval)  # a list from YAML or JSON too
            if len(interval) != 2 or interval[0] > interval[1]:
                raise ValueError(f"cfg_interval {list(self.cfg_interval)}: give [lo, hi] timesteps with lo <= hi")
            object.__setattr__(self, "cfg_interval", interval)  # frozen: set once, normalised

    def replace(self, **changes: Any) -> SamplingOptions:
        """A copy with ``changes`` (field names; another name is a TypeError that lists them)."""
        unknown = sorted(set(changes) - set(SAMPLING_OPTION_NAMES))
        if unknown:
            raise TypeError(f"unknown sampling option(s) {unknown}: choose from {', '.join(SAMPLING_OPTION_NAMES)}")
        return dataclasses.replace(self, **changes)

    def over(self, defaults: SamplingOptions) -> SamplingOptions:
        """These options, the unset ones taken from ``defaults`` (e.g. :meth:`from_hparams`)."""
        unset = {name: getattr(defaults, name) for name in SAMPLING_OPTION_NAMES if getattr(self, name) is None}
        return dataclasses.replace(self, **unset)

    def resolved(self) -> ResolvedSamplingOptions:
        """Every option set: the unset ones at the library's defaults."""
        given = {name: getattr(self, name) for name in SAMPLING_OPTION_NAMES}
        return ResolvedSamplingOptions(**{k: v for k, v in given.items() if v is not None})

    def record(self) -> dict[str, Any]:
        """The fields as JSON values (what ``sample_config.json`` and the metrics files hold, so
        that a record read back compares equal)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_hparams(cls, hparams: Mapping[str, Any], in_channels: int) -> SamplingOptions:
        """The settings a model brings: a ``DiTModule``'s hyper-parameters ``sampler``,
        ``sample_steps``, ``cfg_scale`` and ``guide_channels`` (or those a Lightning checkpoint
        recorded; absent ones stay unset), and the x0 clamp of its store: on for pixel stores
        (``vae`` "none/pixels"; without a VAE name, 1 or 3 channels), off for VAE latents."""
        vae = hparams.get("vae")
        return cls(
            sampler=hparams.get("sampler"),
            num_steps=hparams.get("sample_steps"),
            cfg_scale=hparams.get("cfg_scale"),
            guide_channels=hparams.get("guide_channels"),
            clip_denoised=clip_denoised_for(vae) if vae else in_channels in (1, 3),
        )


@dataclass(frozen=True, kw_only=True)
class ResolvedSamplingOptions(SamplingOptions):
    """:class:`SamplingOptions` with every option set, what the sampling loop runs; its defaults
    are the library's for the options a model may set."""

    sampler: Sampler = "ddpm"
    num_steps: int = 250
    cfg_scale: float = 1.0
    clip_denoised: bool = False


SAMPLING_OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingOptions))


def sampling_options(options: Optional[SamplingOptions] = None, **overrides: Any) -> SamplingOptions:
    """``options`` (default: every option unset) with keyword ``overrides`` of its fields: both
    spellings ``sample_latents`` and ``DiTModule.sample`` take (``num_steps=50, cfg_scale=4.0``)."""
    if options is None:
        options = SamplingOptions()
    elif not isinstance(options, SamplingOptions):
        raise TypeError(
            f"options must be a SamplingOptions, got {type(options).__name__}: pass settings by name (num_steps=...)"
        )
    return options.replace(**overrides) if overrides else options
