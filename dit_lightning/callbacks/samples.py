"""A callback that samples a fixed class-conditional grid and shows it in TensorBoard / a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

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
    write it to ``output`` as a PNG.

    Args:
        every_n_steps: 0 samples only at the end of fit.
        classes: the rows; default the first ``min(10, num_classes)`` classes.
        per_class: images per row.
        num_steps: sampling steps (few keep it cheap).
        sampler: "ddpm" or "ddim".
        cfg_scale: classifier-free guidance scale.
        seed: fixes the noise, so grids of successive steps are comparable.
        output: PNG path written at the end of fit (None: the loggers only); ``{log_dir}`` is the
            run's directory (``outputs/demo/version_N``).
        upscale: nearest-neighbour magnification of the PNG and of the logged grid (the logged
            grid is magnified to at least 256 pixels across, so small images stay visible).
    """

    def __init__(
        self,
        every_n_steps: int = 0,
        classes: Optional[list[int]] = None,
        per_class: int = 8,
        num_steps: int = 50,
        sampler: Sampler = "ddpm",
        cfg_scale: float = 1.0,
        seed: int = 0,
        output: Optional[str] = None,
        upscale: int = 1,
    ) -> None:
        self.every_n_steps = every_n_steps
        self.classes = classes
        self.per_class = per_class
        self.num_steps = num_steps
        self.sampler = sampler
        self.cfg_scale = cfg_scale
        self.seed = seed
        self.output = output
        self.upscale = upscale
        self.last_grid: Optional[Tensor] = None

    def output_locations(self, trainer: L.Trainer, stage: str) -> list[tuple[Path, str, str]]:
        """Where this callback writes in ``stage``: (directory, what, the option that sets it)."""
        if stage != "fit" or not self.output:
            return []
        return [(run_path(self.output, trainer).parent, "sample grid's directory", "the SampleGrid's output")]

    def _labels(self, pl_module) -> list[int]:
        classes = self.classes if self.classes is not None else list(range(min(10, pl_module.model.num_classes)))
        return [c for c in classes for _ in range(self.per_class)]

    @torch.no_grad()
    def render(self, trainer: L.Trainer, pl_module) -> Tensor:
        latents = pl_module.sample(
            self._labels(pl_module),
            num_steps=self.num_steps,
            sampler=self.sampler,
            cfg_scale=self.cfg_scale,
            seed=self.seed,
        )
        images = pl_module.decode(latents)
        self.last_grid = make_grid_image(images, nrow=self.per_class)
        if trainer.is_global_zero and getattr(self, "_logged_step", None) != trainer.global_step:
            self._logged_step = trainer.global_step  # the end of fit renders the last step again
            factor = max(self.upscale, -(-256 // self.last_grid.shape[-1]))
            shown = self.last_grid.repeat_interleave(factor, dim=1).repeat_interleave(factor, dim=2)
            log_image(trainer, "samples/grid", shown, trainer.global_step)
        return self.last_grid

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        # Under FSDP sampling gathers shards (a collective): every rank renders, rank 0 logs.
        renders = trainer.is_global_zero or is_sharded(pl_module)
        if self.every_n_steps > 0 and step > 0 and step % self.every_n_steps == 0 and renders:
            # Several micro-batches share one optimiser step: sample once per step.
            if getattr(self, "_last_step", None) != step:
                self._last_step = step
                self.render(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.global_step == 0 or not (trainer.is_global_zero or is_sharded(pl_module)):
            return
        grid = self.render(trainer, pl_module)
        if self.output and trainer.is_global_zero:
            path = save_png(grid, run_path(self.output, trainer), upscale=self.upscale)
            print(f"sample grid ({len(self._labels(pl_module))} images, one row per class) written to {path}")
