"""The training objective as one object, as DiT's ``create_diffusion`` and SiT's ``create_transport``
each return one: its per-sample training terms, its sampling loops and default sampler, its record in
checkpoints and what a teacher or a resumed run must share with it.

Two objectives implement :class:`TrainingObjective`: :class:`DDPMObjective` (the paper's Gaussian
diffusion, hybrid loss, Min-SNR weighting; this file) and
:class:`~dit_lightning.diffusion.flow.FlowMatching` (SiT's stochastic interpolants). Building one
from settings or reading one back from a checkpoint's record is :mod:`.registry`'s.

The sampling loops take their settings through :class:`SamplerSettings` (any object with those
attributes: ``dit_lightning.sampling.ResolvedSamplingOptions``), so this layer imports nothing above it.

Pure PyTorch + numpy.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional, Protocol, get_args

from torch import Tensor

from .gaussian_diffusion import ModelFn
from .respace import SpacedDiffusion, create_diffusion
from .weighting import min_snr_weight

# The DDPM objective's own loops (bit-exact with the reference). Its network predicts epsilon on
# the model's betas, so diffusers' schedulers sample it too (dit_lightning.sampling.schedulers).
ReferenceSampler = Literal["ddpm", "ddim"]
NoiseFn = Callable[[int, Tensor], Tensor]
# The sampler a module's configuration holds when none was chosen (its default): an objective that
# does not take it samples with its own default instead.
UNSET_SAMPLER = "ddpm"


class SamplerSettings(Protocol):
    """What a sampling loop reads of the sampling options (``ResolvedSamplingOptions`` has them all)."""

    @property
    def sampler(self) -> str: ...
    @property
    def num_steps(self) -> int: ...
    @property
    def eta(self) -> float: ...
    @property
    def clip_denoised(self) -> bool: ...
    @property
    def cfg_interval(self) -> Optional[tuple[float, float]]: ...
    @property
    def atol(self) -> float: ...
    @property
    def rtol(self) -> float: ...
    @property
    def diffusion_form(self) -> Any: ...
    @property
    def diffusion_norm(self) -> float: ...
    @property
    def last_step(self) -> Any: ...
    @property
    def last_step_size(self) -> float: ...
    @property
    def timestep_shift(self) -> float: ...


class TrainingObjective(ABC):
    """One training objective: what the network learns, how it is sampled and how it is recorded.

    ``name`` is the value of ``model.objective``; ``samplers`` the names of its own loops and
    ``default_sampler`` the one used when none is chosen; ``takes_epsilon_schedulers`` whether
    diffusers' schedulers (epsilon on the model's betas) sample its networks too. A network trained
    with it outputs ``C`` channels, or ``2C`` when ``learns_variance``; ``drops_unused_outputs``: weights
    with ``2C`` outputs of which the network uses the first ``C`` load into a ``C``-output network
    (SiT's released networks).
    """

    name: ClassVar[str]
    samplers: ClassVar[tuple[str, ...]]
    default_sampler: ClassVar[str]
    takes_epsilon_schedulers: ClassVar[bool] = False
    drops_unused_outputs: ClassVar[bool] = False

    @property
    @abstractmethod
    def learns_variance(self) -> bool:
        """Whether the network predicts a variance beside its C output channels (2C outputs)."""

    @abstractmethod
    def training_terms(
        self, model_fn: ModelFn, x: Tensor, noise: Tensor, u: Tensor, model_kwargs: Mapping[str, Any]
    ) -> dict[str, Tensor]:
        """Per-sample (N,) training terms, ``loss`` among them, for clean latents ``x``, Gaussian
        ``noise`` of x's shape and the time draw ``u`` (N,), uniform in [0, 1): the objective maps it to
        its own time (a DDPM timestep, a flow time), so one keyed draw serves every objective."""

    @abstractmethod
    def run_sampler(
        self,
        fn: Callable[[Tensor, Tensor, Tensor], Tensor],
        noise: Tensor,
        y: Tensor,
        settings: SamplerSettings,
        noise_fn: Optional[NoiseFn] = None,
    ) -> Tensor:
        """Latents from the initial ``noise`` with the (guided) network ``fn(x, t, y)`` and one of
        :attr:`samplers` (``settings.sampler``); ``noise_fn(step, x)``: the noise of step ``step``."""

    @abstractmethod
    def record(self) -> dict[str, Any]:
        """The settings a checkpoint records (``DiTModule`` hyper-parameters; registry reads them back)."""

    @abstractmethod
    def describe(self) -> str:
        """A few words for messages: ``objective flow (linear path, velocity prediction)``."""

    def for_network(self, learns_variance: bool) -> TrainingObjective:
        """This objective for a network that does (not) output a variance: the same, where the network's
        outputs do not change how it is sampled."""
        return self

    def shared_settings(self) -> dict[str, Any]:
        """What another network must share with this one to stand in for it (a distillation teacher):
        the meaning of its output."""
        return {"objective": self.name}

    def differences(self, other: TrainingObjective) -> list[tuple[str, Any, Any]]:
        """``(setting, mine, theirs)`` for each setting of :meth:`shared_settings` that ``other`` does not
        share (only the objective, when they differ in it)."""
        mine, theirs = self.shared_settings(), other.shared_settings()
        if mine["objective"] != theirs["objective"]:
            return [("objective", mine["objective"], theirs["objective"])]
        return [(k, mine[k], theirs.get(k)) for k in mine if mine[k] != theirs.get(k)]

    def accepts_sampler(self, sampler: str, epsilon_schedulers: tuple[str, ...] = ()) -> bool:
        return sampler in self.samplers or (self.takes_epsilon_schedulers and sampler in epsilon_schedulers)

    def check_sampler(self, sampler: str, epsilon_schedulers: tuple[str, ...] = ()) -> None:
        """Refuse a sampler of another objective, naming this one's (``epsilon_schedulers``: diffusers'
        scheduler names, which the caller knows)."""
        if self.accepts_sampler(sampler, epsilon_schedulers):
            return
        choices = ", ".join(self.samplers)
        if self.takes_epsilon_schedulers:
            choices += " or one of diffusers' schedulers (docs/sampling.md)"
        raise ValueError(f"sampler {sampler!r} does not sample a model trained with {self.describe()}: use {choices}")

    def sampler_for(self, sampler: Optional[str], epsilon_schedulers: tuple[str, ...] = ()) -> str:
        """The sampler a module configured with ``sampler`` uses: unset (or the configuration's default,
        ``ddpm``, which an objective without that loop does not take) -> :attr:`default_sampler`."""
        if sampler is None or (sampler == UNSET_SAMPLER and not self.accepts_sampler(sampler)):
            return self.default_sampler
        self.check_sampler(sampler, epsilon_schedulers)
        return sampler


LossWeighting = Literal["none", "min_snr"]


@dataclass(frozen=True)
class DDPMObjective(TrainingObjective):
    """The paper's Gaussian diffusion: epsilon prediction on ``noise_schedule`` betas over
    ``diffusion_steps`` timesteps, with the hybrid loss (MSE + the variational bound of the learned
    variance) when ``learn_sigma``, else the epsilon MSE. ``loss_weighting="min_snr"`` multiplies the
    epsilon MSE by ``min(SNR, min_snr_gamma) / SNR`` (Hang et al. 2023; the vb term unchanged).
    Samplers: DDPM (ancestral, learned variance) and DDIM, the reference's loops, and diffusers'."""

    name: ClassVar[str] = "ddpm"
    samplers: ClassVar[tuple[str, ...]] = get_args(ReferenceSampler)
    default_sampler: ClassVar[str] = "ddpm"
    takes_epsilon_schedulers: ClassVar[bool] = True

    noise_schedule: str = "linear"
    diffusion_steps: int = 1000
    learn_sigma: bool = True
    loss_weighting: LossWeighting = "none"
    min_snr_gamma: float = 5.0

    def __post_init__(self) -> None:
        if self.loss_weighting not in get_args(LossWeighting):
            raise ValueError(f"model.loss_weighting must be none or min_snr for ddpm, got {self.loss_weighting!r}")
        if self.min_snr_gamma <= 0:
            raise ValueError(f"model.min_snr_gamma must be positive, got {self.min_snr_gamma}")

    @property
    def learns_variance(self) -> bool:
        return self.learn_sigma

    def for_network(self, learns_variance: bool) -> DDPMObjective:
        # the variance channels decide DDPM's sampling variance (learned range, or fixed)
        return self if learns_variance == self.learn_sigma else dataclasses.replace(self, learn_sigma=learns_variance)

    @property
    def diffusion(self) -> SpacedDiffusion:
        """The training process (every timestep), built once."""
        cached = self.__dict__.get("_diffusion")
        if cached is None:
            cached = self.sampling_diffusion("", learn_sigma=self.learn_sigma)
            object.__setattr__(self, "_diffusion", cached)  # frozen: a cache, not a setting
        return cached

    def sampling_diffusion(self, respacing: Any, learn_sigma: Optional[bool] = None) -> SpacedDiffusion:
        """The process respaced as ``respacing`` (``""``: every step; ``"250"``, ``"ddim50"``...)."""
        return create_diffusion(
            respacing,
            noise_schedule=self.noise_schedule,
            learn_sigma=self.learn_sigma if learn_sigma is None else learn_sigma,
            diffusion_steps=self.diffusion_steps,
        )

    def timesteps(self, u: Tensor) -> Tensor:
        """Timesteps 0..T-1 from uniform draws ``u`` (``floor(u T)``: ``keyed_randint``'s rule)."""
        high = self.diffusion.num_timesteps
        return (u * high).long().clamp_(max=high - 1)

    def training_terms(
        self, model_fn: ModelFn, x: Tensor, noise: Tensor, u: Tensor, model_kwargs: Mapping[str, Any]
    ) -> dict[str, Tensor]:
        t = self.timesteps(u)
        terms = self.diffusion.training_losses(model_fn, x, t, model_kwargs=dict(model_kwargs), noise=noise)
        if self.loss_weighting == "min_snr":  # the epsilon MSE weighted; vb as it is
            weight = min_snr_weight(self.diffusion, t, self.min_snr_gamma, like=terms["mse"])
            terms = {**terms, "loss": weight * terms["mse"] + terms["vb"]}
        return terms

    def respaced(self, sampler: str, num_steps: int, learn_sigma: bool) -> SpacedDiffusion:
        """The sampling process: ``"250"`` for DDPM; ``"ddimN"`` (even stride) for DDIM where N divides
        the steps that way, else the section respacing of N steps."""
        steps = self.diffusion_steps
        if num_steps < 2 or num_steps > steps:
            # One step has no posterior variance to interpolate (the learned-range variance needs t=1).
            raise ValueError(f"num_steps must be in 2..{steps}, got {num_steps}")
        respacing = str(num_steps)
        if sampler == "ddim" and any(len(range(0, steps, s)) == num_steps for s in range(1, steps)):
            respacing = f"ddim{num_steps}"
        return self.sampling_diffusion(respacing, learn_sigma=learn_sigma)

    def run_sampler(
        self,
        fn: Callable[[Tensor, Tensor, Tensor], Tensor],
        noise: Tensor,
        y: Tensor,
        settings: SamplerSettings,
        noise_fn: Optional[NoiseFn] = None,
    ) -> Tensor:
        self.check_sampler(settings.sampler)
        process = self.respaced(settings.sampler, settings.num_steps, self.learn_sigma)
        common: dict[str, Any] = dict(
            noise=noise,
            clip_denoised=settings.clip_denoised,
            model_kwargs={"y": y},
            device=noise.device,
            noise_fn=noise_fn,
        )
        if settings.sampler == "ddpm":
            return process.p_sample_loop(fn, noise.shape, **common)
        return process.ddim_sample_loop(fn, noise.shape, eta=settings.eta, **common)

    def record(self) -> dict[str, Any]:
        return {
            "objective": self.name,
            "noise_schedule": self.noise_schedule,
            "diffusion_steps": self.diffusion_steps,
            "loss_weighting": self.loss_weighting,
            "min_snr_gamma": self.min_snr_gamma,
        }

    def shared_settings(self) -> dict[str, Any]:
        return {"objective": self.name, "noise_schedule": self.noise_schedule, "diffusion_steps": self.diffusion_steps}

    def describe(self) -> str:
        weighting = ", Min-SNR" if self.loss_weighting == "min_snr" else ""
        return f"objective ddpm ({self.noise_schedule} schedule, {self.diffusion_steps} steps{weighting})"
