"""The sampling layer: which class each sample gets (:mod:`.labels`) and the loop that turns keyed
noise into latents with guidance, DDPM or DDIM (:mod:`.loop`). Pure PyTorch.

Decoding latents to images and writing files live in :mod:`dit_lightning.images`; loading a
network from a checkpoint in :mod:`dit_lightning.checkpoints`; the ``sample`` command in
:mod:`dit_lightning.commands.sample`.
"""

from .labels import LabelPlan, LabelSpec, SampleRequests, parse_labels
from .loop import Sampler, build_sampling_diffusion, guided_model_fn, initial_noise, sample_latents, step_noise

__all__ = [
    "LabelPlan",
    "LabelSpec",
    "SampleRequests",
    "Sampler",
    "build_sampling_diffusion",
    "guided_model_fn",
    "initial_noise",
    "parse_labels",
    "sample_latents",
    "step_noise",
]
