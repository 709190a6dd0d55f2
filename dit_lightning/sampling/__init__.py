"""The sampling layer: which class each sample gets (:mod:`.labels`), how it is sampled (one
:class:`SamplingOptions`, :mod:`.options`) and the loop that turns keyed noise into latents with
guidance and the model's objective's own steps (DDPM / DDIM, or SiT's ODE / SDE samplers for flow
matching: :mod:`dit_lightning.diffusion`) (:mod:`.loop`), or one of diffusers' multistep schedulers
built from the model's betas (:mod:`.schedulers`). Pure PyTorch (+ diffusers).

Decoding latents to images and writing files live in :mod:`dit_lightning.images`; loading a
network from a checkpoint in :mod:`dit_lightning.checkpoints`; the ``sample`` command in
:mod:`dit_lightning.commands.sample`.
"""

from .labels import LabelPlan, LabelSpec, SampleRequests, parse_labels
from .loop import (
    StepLines,
    guided_model_fn,
    initial_noise,
    initial_token_noise,
    joint_model_fn,
    sample_latents,
    step_noise,
    token_step_noise,
)
from .options import SAMPLING_OPTION_NAMES, ResolvedSamplingOptions, SamplingOptions, sampling_options
from .schedulers import (
    DIFFUSERS_SAMPLERS,
    DiffusersSampler,
    Sampler,
    build_scheduler,
    is_diffusers_sampler,
    noise_schedule_of,
    scheduler_config,
)

__all__ = [
    "DIFFUSERS_SAMPLERS",
    "DiffusersSampler",
    "LabelPlan",
    "LabelSpec",
    "ResolvedSamplingOptions",
    "SAMPLING_OPTION_NAMES",
    "SampleRequests",
    "Sampler",
    "SamplingOptions",
    "StepLines",
    "build_scheduler",
    "guided_model_fn",
    "initial_noise",
    "initial_token_noise",
    "is_diffusers_sampler",
    "joint_model_fn",
    "noise_schedule_of",
    "parse_labels",
    "sample_latents",
    "sampling_options",
    "scheduler_config",
    "step_noise",
    "token_step_noise",
]
