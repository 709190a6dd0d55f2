"""Timestep respacing: run a trained T-step process on a subset of its steps.

Keeping the cumulative alphas at the retained steps defines a shorter Markov chain with
the same marginals q(x_t | x_0); the model, trained on the original indices, is called
with the original index of every retained step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

import numpy as np
import torch
from torch import Tensor

from .gaussian_diffusion import GaussianDiffusion, LossType, ModelFn, ModelVarType, get_named_beta_schedule


def space_timesteps(num_timesteps: int, section_counts: Union[str, list[int]]) -> set[int]:
    """Timesteps of the original process to keep.

    ``"ddimN"``: the integer stride ``s`` for which ``range(0, T, s)`` has exactly N steps.
    Otherwise counts per equal section (``"10,15,20"`` or a list): the T steps are cut
    into ``len(counts)`` near-equal sections (earlier ones one longer when T does not
    divide) and each keeps its count of steps at rounded fractional strides, so its first
    and last steps are always kept. ``"250"`` out of 1000 keeps 0 and 999.
    """
    if isinstance(section_counts, str):
        if section_counts.startswith("ddim"):
            desired = int(section_counts[len("ddim") :])
            for step in range(1, num_timesteps):
                if len(range(0, num_timesteps, step)) == desired:
                    return set(range(0, num_timesteps, step))
            raise ValueError(f"cannot take exactly {desired} steps with an integer stride out of {num_timesteps}")
        section_counts = [int(x) for x in section_counts.split(",")]
    if not section_counts:
        raise ValueError("section_counts is empty")

    size_per, extra = divmod(num_timesteps, len(section_counts))
    start = 0
    kept: list[int] = []
    for i, count in enumerate(section_counts):
        size = size_per + (1 if i < extra else 0)
        if size < count:
            raise ValueError(f"cannot take {count} steps from a section of {size}")
        if count < 1:
            raise ValueError(f"every section needs at least one step, got {count}")
        stride = 1.0 if count == 1 else (size - 1) / (count - 1)
        # The position is accumulated (not k * stride) and rounded half to even by Python's
        # round, as the reference does: both change which steps are picked, and sampling
        # at "250" etc. must pick the same steps the published numbers used.
        position = 0.0
        for _ in range(count):
            kept.append(start + round(position))
            position += stride
        start += size
    return set(kept)


class _TimestepMappedModel:
    """Calls the wrapped model with the original index of each spaced timestep."""

    def __init__(self, model_fn: ModelFn, timestep_map: list[int], tables: dict[torch.device, Tensor]) -> None:
        self.model_fn = model_fn
        self.timestep_map = timestep_map
        # the diffusion's own cache: a wrapper is made per call, and copying the table to the device
        # on every training step would stall it (a host-to-device copy from a Python list)
        self._map_cache = tables

    def __call__(self, x: Tensor, t: Tensor, **kwargs: Any) -> Tensor:
        table = self._map_cache.get(t.device)
        if table is None:
            table = torch.tensor(self.timestep_map, dtype=torch.long, device=t.device)
            self._map_cache[t.device] = table
        return self.model_fn(x, table[t.long()].to(t.dtype), **kwargs)


class SpacedDiffusion(GaussianDiffusion):
    """A :class:`GaussianDiffusion` that keeps only ``use_timesteps`` of the base process.

    ``kwargs`` are those of the base :class:`GaussianDiffusion` (``betas`` of the full
    schedule, ``model_var_type``, ``loss_type``). Indices 0..len(use_timesteps)-1 of
    this process are mapped back to the original ones before every model call: every
    public method that takes a ``model_fn`` (``training_losses``, ``p_mean_variance``,
    the samplers) wraps it through :meth:`_wrap_model`.
    """

    def __init__(self, use_timesteps: Iterable[int], **kwargs: Any) -> None:
        self.use_timesteps = {int(t) for t in use_timesteps}
        base = GaussianDiffusion(**kwargs)
        if not self.use_timesteps or not self.use_timesteps <= set(range(base.num_timesteps)):
            raise ValueError(f"use_timesteps must be a non-empty subset of range({base.num_timesteps})")
        self.original_num_steps = base.num_timesteps
        self.timestep_map: list[int] = []
        new_betas = []
        last_alpha_cumprod = 1.0
        for i, alpha_cumprod in enumerate(base.alphas_cumprod):
            if i in self.use_timesteps:
                # The beta that carries acp from the previous retained step to this one.
                new_betas.append(1.0 - alpha_cumprod / last_alpha_cumprod)
                last_alpha_cumprod = alpha_cumprod
                self.timestep_map.append(i)
        kwargs["betas"] = np.array(new_betas, dtype=np.float64)
        super().__init__(**kwargs)
        self._map_cache: dict[torch.device, Tensor] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_map_cache"] = {}  # device tensors: rebuilt on demand
        return state

    def _wrap_model(self, model_fn: ModelFn) -> ModelFn:
        # Idempotent: public entry points wrap, and may call one another.
        if isinstance(model_fn, _TimestepMappedModel) and model_fn.timestep_map is self.timestep_map:
            return model_fn
        return _TimestepMappedModel(model_fn, self.timestep_map, self._map_cache)

    def original_timesteps(self, t: Tensor) -> Tensor:
        """Original-process indices of spaced timesteps ``t``."""
        return torch.tensor(self.timestep_map, dtype=torch.long, device=t.device)[t.long()]


def create_diffusion(
    timestep_respacing: str = "",
    noise_schedule: str = "linear",
    learn_sigma: bool = True,
    diffusion_steps: int = 1000,
    sigma_small: bool = False,
    loss_type: LossType = "mse",
) -> SpacedDiffusion:
    """The diffusion DiT trains and samples with, as the reference's helper.

    ``timestep_respacing``: ``""`` keeps every step (training), ``"250"`` or ``"ddim50"``
    for sampling (see :func:`space_timesteps`). ``learn_sigma`` selects the learned-range
    variance (the model outputs 2C channels, hybrid loss); without it the variance is
    fixed, the posterior's if ``sigma_small`` else beta_t, and the loss is plain MSE.
    """
    betas = get_named_beta_schedule(noise_schedule, diffusion_steps)
    respacing = timestep_respacing or [diffusion_steps]
    if learn_sigma:
        var_type: ModelVarType = "learned_range"
    else:
        var_type = "fixed_small" if sigma_small else "fixed_large"
    return SpacedDiffusion(
        use_timesteps=space_timesteps(diffusion_steps, respacing),
        betas=betas,
        model_var_type=var_type,
        loss_type=loss_type,
    )
