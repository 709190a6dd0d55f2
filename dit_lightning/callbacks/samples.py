"""A callback that samples a fixed class-conditional grid and shows it in TensorBoard / a PNG."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor

from ..distributed.sharding import is_sharded
from ..images import make_grid_image, save_png, save_sample, to_uint8
from ..sampling import Sampler
from .checkpoint import run_path
from .media import log_image


class PredictionWriter(BasePredictionWriter):
    """Writes the images of ``dit-lightning predict`` as PNGs named by sample index and class
    (atomically; samples whose file exists are rewritten identically, the draws being keyed).
    ``dit-lightning predict`` adds one writing to ``{log_dir}/predictions`` when none is configured.

    Args:
        output_dir: the directory of the PNGs; ``{log_dir}`` is the run's directory.
    """

    def __init__(self, output_dir: str = "{log_dir}/predictions") -> None:
        super().__init__(write_interval="batch")
        self.output_dir = output_dir
        self.written = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.resolved_dir = run_path(self.output_dir, trainer).resolve()
        self.written = 0

    def output_locations(self, trainer: L.Trainer, stage: str) -> list[tuple[Path, str, str]]:
        """Where this callback writes in ``stage``: (directory, what, the option that sets it)."""
        if stage != "predict":
            return []
        return [(run_path(self.output_dir, trainer), "prediction directory", "the PredictionWriter's output_dir")]

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0
    ) -> None:
        arrays = to_uint8(prediction["images"])
        for i, y, array in zip(prediction["index"].tolist(), prediction["y"].tolist(), arrays):
            save_sample(array, self.resolved_dir, i, y)
        self.written += len(arrays)

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        written = trainer.strategy.reduce(torch.tensor(float(self.written)), reduce_op="sum")
        if trainer.is_global_zero:
            print(f"predict: {int(written)} images written to {self.resolved_dir}")


class SampleGrid(L.Callback):
    """Every ``every_n_steps`` optimiser steps (and at the end of fit), sample ``per_class``
    images for each class in ``classes`` with fixed noise from the EMA weights, and log the
    grid (one row per class) to every logger as ``samples/grid``; at the end of fit also
    write it to ``output`` as a PNG. The CLI's ``sample_grid`` section (``--sample_grid.enabled
    false``, ``--sample_grid.per_class 4``, ``--sample_grid.num_steps 20``...) is this callback.

    A grid never costs more than ``max_cost`` times the training so far on a device, counted in
    network evaluations (3 per trained image: forward and backward; 1 per sampled image and
    step, 2 with guidance): a short run (a 10-step try of a config) samples its grid with fewer
    steps than ``num_steps`` instead of spending most of its time on a picture of an untrained
    model; longer runs get ``num_steps`` (the demo's grid from step 209 on).

    Args:
        every_n_steps: 0: only at the end of fit.
        classes: the rows (default: up to ten).
        per_class: images per row.
        num_steps: sampling steps.
        sampler: the sampler (default: the module's, e.g. ``sde-euler`` for a flow model).
        cfg_scale: guidance scale.
        seed: of the noise.
        output: the PNG of the end of fit (``{log_dir}``: the run's directory).
        upscale: magnification of the PNG.
        max_cost: the most a grid costs, as a fraction of the training so far: fewer steps if
            needed, at least 2. None: ``num_steps``.
        enabled: False: no grid.
    """

    def __init__(
        self,
        every_n_steps: int = 0,
        classes: Optional[list[int]] = None,
        per_class: int = 8,
        num_steps: int = 50,
        sampler: Optional[Sampler] = None,
        cfg_scale: float = 1.0,
        seed: int = 0,
        output: Optional[str] = None,
        upscale: int = 1,
        max_cost: Optional[float] = 0.25,
        enabled: bool = True,
    ) -> None:
        if every_n_steps < 0 or per_class < 1 or num_steps < 2 or upscale < 1:
            raise ValueError(
                "SampleGrid needs every_n_steps >= 0, num_steps >= 2 and per_class, upscale >= 1, got "
                f"every_n_steps={every_n_steps}, per_class={per_class}, num_steps={num_steps}, upscale={upscale}"
            )
        if max_cost is not None and max_cost <= 0:
            raise ValueError(f"SampleGrid's max_cost must be > 0 (or null: always num_steps), got {max_cost}")
        self.every_n_steps = every_n_steps
        self.classes = classes
        self.per_class = per_class
        self.num_steps = num_steps
        self.sampler = sampler
        self.cfg_scale = cfg_scale
        self.seed = seed
        self.output = output
        self.upscale = upscale
        self.max_cost = max_cost
        self.enabled = enabled
        self.last_grid: Optional[Tensor] = None
        self.last_steps = 0  # the sampling steps of last_grid
        self._last_step: Optional[int] = None  # the optimiser step of last_grid
        self._batch_size: Optional[int] = None  # training images per micro-batch on this device
        self._path: Optional[Path] = None  # the PNG, resolved at set-up

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Resolved on every rank: ``{log_dir}`` is a broadcast, which rank 0 alone would wait on forever
        self._path = run_path(self.output, trainer) if self.output and self.enabled and stage == "fit" else None

    def output_locations(self, trainer: L.Trainer, stage: str) -> list[tuple[Path, str, str]]:
        """Where this callback writes in ``stage``: (directory, what, the option that sets it)."""
        if stage != "fit" or self._path is None:
            return []
        return [(self._path.parent, "sample grid's directory", "the SampleGrid's output")]

    def _labels(self, pl_module) -> list[int]:
        classes = self.classes if self.classes is not None else list(range(min(10, pl_module.model.num_classes)))
        return [c for c in classes for _ in range(self.per_class)]

    def sampling_steps(self, trainer: L.Trainer, num_images: int) -> int:
        """``num_steps``, or fewer when the grid would cost more than ``max_cost`` of the training so far."""
        if self.max_cost is None or self._batch_size is None:
            return self.num_steps  # no training seen: nothing to weigh the grid against
        per_step = self._batch_size * max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        trained = 3 * per_step * trainer.global_step  # forward + backward of every image, this device
        per_sampling_step = num_images * (2 if self.cfg_scale != 1.0 else 1)
        return min(self.num_steps, max(2, int(self.max_cost * trained / per_sampling_step)))  # DDPM needs 2

    @torch.no_grad()
    def render(self, trainer: L.Trainer, pl_module) -> Tensor:
        labels = self._labels(pl_module)
        self.last_steps = self.sampling_steps(trainer, len(labels))
        # A grid at the end of a long run takes minutes: a log file says what it is doing, and for how long
        what = f"sample grid at step {trainer.global_step}: {len(labels)} images ({len(labels) // self.per_class} "
        what += f"classes x {self.per_class}), {self.last_steps} sampling steps"
        if trainer.is_global_zero:
            print(f"{what}: sampling...", flush=True)
        started = time.perf_counter()
        latents = pl_module.sample(
            labels,
            num_steps=self.last_steps,
            sampler=self.sampler,
            cfg_scale=self.cfg_scale,
            seed=self.seed,
        )
        images = pl_module.decode(latents)
        self.last_grid = make_grid_image(images, nrow=self.per_class)
        self._last_step = trainer.global_step
        if trainer.is_global_zero:
            print(f"{what}: done in {time.perf_counter() - started:.1f} s", flush=True)
            factor = max(self.upscale, -(-256 // self.last_grid.shape[-1]))
            shown = self.last_grid.repeat_interleave(factor, dim=1).repeat_interleave(factor, dim=2)
            log_image(trainer, "samples/grid", shown, trainer.global_step)
        return self.last_grid

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.enabled:
            return
        if self._batch_size is None:
            self._batch_size = _batch_size(batch)
        step = trainer.global_step
        # Under FSDP sampling gathers shards (a collective): every rank renders, rank 0 logs.
        renders = trainer.is_global_zero or is_sharded(pl_module)
        if self.every_n_steps > 0 and step > 0 and step % self.every_n_steps == 0 and renders:
            # Several micro-batches share one optimiser step: sample once per step.
            if self._last_step != step:
                self.render(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        if not self.enabled or trainer.global_step == 0 or not (trainer.is_global_zero or is_sharded(pl_module)):
            return
        # The grid of the last step when every_n_steps divides it (the same picture: sampled once)
        fresh = self.last_grid is not None and self._last_step == trainer.global_step
        grid = self.last_grid if fresh and self.last_grid is not None else self.render(trainer, pl_module)
        if self._path is not None and trainer.is_global_zero:
            path = save_png(grid, self._path, upscale=self.upscale)
            steps = f"{self.last_steps} sampling steps"
            if self.last_steps < self.num_steps:  # max_cost is set
                steps = (
                    f"{self.last_steps} of {self.num_steps} sampling steps: max_cost {self.max_cost:g} of the training"
                )
            print(f"sample grid ({len(self._labels(pl_module))} images, one row per class, {steps}) written to {path}")


def _batch_size(batch: Any) -> Optional[int]:
    """Images in a training batch (``{"x": ...}`` or a tuple whose first item is the images)."""
    x = (
        batch.get("x")
        if isinstance(batch, Mapping)
        else batch[0]
        if isinstance(batch, (tuple, list)) and batch
        else None
    )
    return int(x.shape[0]) if isinstance(x, Tensor) and x.ndim > 0 else None
