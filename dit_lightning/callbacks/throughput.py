"""Images/s, tokens/s, data-loader stalls and MFU of DiT training.

Why not Lightning's :class:`~lightning.pytorch.callbacks.ThroughputMonitor`: it calls
``torch.cuda.synchronize()`` after every batch (which removes the CPU/GPU overlap it is
measuring), counts data-loading time as compute, needs a ``flops_per_batch`` attribute
and takes its peak from :func:`~lightning.fabric.utilities.throughput.get_available_flops`,
which does not know the H200. This callback keeps Lightning's conventions (``device/``
per-device keys, global = sum over ranks, the trainer's logging cadence) and reuses
``get_available_flops`` as the fallback peak table (see :mod:`.hardware`), but times the
training step and the wait for the next batch separately, with CUDA events on GPUs.
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import dataclass
from typing import Any, Optional

import lightning
import lightning as L
import torch
from torch import Tensor

from ..planner.hardware import peak_flops_for, tf32_enabled
from ..precision import DTypeLike, compute_dtype, to_dtype
from .media import log_text

log = logging.getLogger(__name__)


def device_peak_flops(device: torch.device, precision: DTypeLike) -> Optional[float]:
    """Peak dense FLOP/s of ``device`` for matmuls at ``precision`` (any spelling, or a dtype): the
    project's GPU table first (:mod:`dit_lightning.planner.hardware`), then Lightning's
    :func:`get_available_flops`; None on CPU (no meaningful peak to assume)."""
    if device.type != "cuda":
        return None
    dtype = to_dtype(precision)
    name = torch.cuda.get_device_name(device)
    peak = peak_flops_for(name, dtype, tf32=tf32_enabled())
    if peak is not None:
        return peak
    from lightning.fabric.utilities.throughput import get_available_flops

    fallback = get_available_flops(device, dtype)
    return float(fallback) if fallback else None


# When the trainer logs nothing (log_every_n_steps=0), still close a window this often so the
# list of pending CUDA events stays short and the end-of-fit summary has data.
_FALLBACK_WINDOW_STEPS = 50


# ---- helpers shared with the memory monitor -------------------------------------------------
def log_every_n_steps(trainer: L.Trainer) -> int:
    """The Trainer's ``log_every_n_steps`` (Lightning's logger connector sets it; the class does not declare it)."""
    return trainer.log_every_n_steps  # type: ignore[attr-defined]


def step_cadence(trainer: L.Trainer) -> int:
    """Optimiser steps between the points where the step's results are read: the logging cadence,
    or every ``_FALLBACK_WINDOW_STEPS`` when the Trainer logs nothing."""
    every = log_every_n_steps(trainer)
    return every if every > 0 else _FALLBACK_WINDOW_STEPS


def is_log_step(trainer: L.Trainer, stepped: bool) -> bool:
    """True on the micro-batch that completes an optimiser step Lightning logs at: with
    ``log_every_n_steps=N`` Lightning writes its step metrics when ``global_step % N == 0``
    after the step, so ours land on the same x as ``train/loss``."""
    every = log_every_n_steps(trainer)
    return stepped and every > 0 and trainer.global_step % every == 0


def logging_step(trainer: L.Trainer) -> int:
    """The x-axis value Lightning's own step metrics use (as LearningRateMonitor does)."""
    loop = getattr(trainer, "fit_loop", None)
    stepped = getattr(getattr(loop, "epoch_loop", None), "_batches_that_stepped", None)
    return int(stepped) if stepped is not None else trainer.global_step


def log_to_loggers(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    if not metrics:
        return
    step = logging_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def gather_rows(trainer: L.Trainer, values: list[float]) -> Tensor:
    """One row of floats per rank, (world_size, len(values)) on the CPU. A collective: every
    rank must call it at the same point (our windows close at the same steps everywhere)."""
    device = trainer.strategy.root_device
    dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    row = torch.tensor(values, dtype=dtype, device=device)
    if trainer.world_size > 1:
        row = trainer.strategy.all_gather(row)
    return row.reshape(-1, len(values)).double().cpu()


def batch_size_of(batch: Any) -> int:
    """Images in a batch: ``len(batch["x"])`` for the latent batches, else the first tensor."""
    if isinstance(batch, dict):
        x = batch.get("x")
        if isinstance(x, Tensor):
            return int(x.shape[0])
        batch = list(batch.values())
    if isinstance(batch, Tensor):
        return int(batch.shape[0])
    if isinstance(batch, (list, tuple)):
        for item in batch:
            if isinstance(item, Tensor):
                return int(item.shape[0])
    raise TypeError(f"cannot infer the batch size of a {type(batch).__name__}")


class FitSummaryPart:
    """Mixin of the monitors that contribute to the one-line summary printed at the end of fit."""

    summary: bool = True
    summary_line: Optional[str] = None
    _summary_order: int = 0

    def _summary_reset(self) -> None:
        self._summary_ready = False
        self._summary_done = False
        self.summary_line = None

    def summary_parts(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        raise NotImplementedError


def _device_description(trainer: L.Trainer) -> str:
    device = trainer.strategy.root_device
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        name = f"CPU {platform.machine()} (torch threads={torch.get_num_threads()})"
    else:
        name = device.type
    return f"{trainer.world_size}x {name}"


def _model_description(pl_module: L.LightningModule) -> str:
    shape = getattr(pl_module, "shape", None)
    model = getattr(pl_module, "model", None)
    if shape is None or not hasattr(shape, "depth"):
        return type(pl_module).__name__
    hparams = getattr(pl_module, "hparams", None)
    name = (hparams.get("model") if isinstance(hparams, dict) else None) or "DiT"
    desc = (
        f"{name} depth={shape.depth} hidden={shape.hidden_size} heads={shape.num_heads} "
        f"patch={shape.patch_size} latent={shape.in_channels}x{shape.input_size}x{shape.input_size}"
    )
    recomputed = len(getattr(model, "checkpoint_blocks", ()) or ())
    if recomputed:
        desc += f" recompute={recomputed}/{shape.depth} blocks"
    return desc


def print_fit_summary(trainer: L.Trainer, pl_module: L.LightningModule) -> Optional[str]:
    """Build the summary line once every monitor has its end-of-fit numbers, print it on rank 0
    and add it to TensorBoard as text ``summary``; returns the line (on every rank)."""
    # Trainer.callbacks is set by Lightning's callback connector, not declared on the class.
    parts_cbs = [cb for cb in trainer.callbacks if isinstance(cb, FitSummaryPart)]  # type: ignore[attr-defined]
    if not parts_cbs or not all(getattr(cb, "_summary_ready", False) for cb in parts_cbs):
        return None
    if any(getattr(cb, "_summary_done", False) for cb in parts_cbs):
        return None
    for cb in parts_cbs:
        cb._summary_done = True
    if not any(cb.summary for cb in parts_cbs):
        return None
    parts = [f"dit-lightning fit: {_device_description(trainer)} {trainer.precision}", _model_description(pl_module)]
    for cb in sorted((c for c in parts_cbs if c.summary), key=lambda c: c._summary_order):
        parts.extend(cb.summary_parts(trainer, pl_module))
    parts.append(f"torch {torch.__version__}, lightning {lightning.__version__}")
    line = " | ".join(parts)
    for cb in parts_cbs:
        cb.summary_line = line
    if trainer.is_global_zero:
        print(line, flush=True)
        log_text(trainer, "summary", line, step=trainer.global_step)
    return line


# ---- timing -------------------------------------------------------------------------------
class _Clock:
    """Timestamps: ``perf_counter`` on the host, or CUDA events on the GPU timeline.

    Events are recorded in the stream without waiting for it, so the host keeps running ahead
    of the GPU; they are read (one ``synchronize`` of the last event) only when a logging
    window closes. A host timer with a sync per batch would measure the same intervals but
    stall the CPU/GPU pipeline every step; a host timer without syncs would measure kernel
    *launch* time, and the GPU work would leak into whatever the host does next (the batch
    copy, the next ``next(dataloader)``).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def wait(self, mark: Any) -> None:
        if self.cuda and mark is not None:
            mark.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            return start.elapsed_time(end) / 1000.0
        return end - start


@dataclass
class _Batch:
    prev: Any  # end of the previous batch (or of validation): start of the wait for this one
    start: Any
    end: Any
    images: int
    stepped: bool
    measured: bool


def window_metrics(
    rows: Tensor,
    steps: int,
    tokens_per_image: Optional[int] = None,
    flops_per_image: Optional[tuple[float, float]] = None,
    peak_flops: Optional[float] = None,
) -> dict[str, float]:
    """Tags of one window from per-rank rows ``[images, micro_batches, compute_s, wait_s]``.

    Global rates are sums of the per-rank rates (Lightning's convention); ``device/`` rates and
    the fractions are means over ranks. MFU/HFU use the compute time only: the data wait is
    reported apart (end-to-end utilisation = mfu x (1 - data_wait_fraction)).
    """
    images, batches, compute, wait = rows.double().unbind(dim=1)
    wall = compute + wait
    dev_images = images / wall
    m = {
        "throughput/images_per_sec": dev_images.sum().item(),
        "throughput/device/images_per_sec": dev_images.mean().item(),
        "throughput/steps_per_sec": steps / wall.mean().item(),
        "throughput/device/batches_per_sec": (batches / wall).mean().item(),
        "throughput/images_per_step": images.sum().item() / steps,
        "throughput/data_wait_fraction": (wait / wall).mean().item(),
    }
    if tokens_per_image:
        m["throughput/tokens_per_sec"] = m["throughput/images_per_sec"] * tokens_per_image
        m["throughput/device/tokens_per_sec"] = m["throughput/device/images_per_sec"] * tokens_per_image
    if flops_per_image is not None:
        useful, executed = flops_per_image
        achieved = (images * useful / compute).mean().item()
        m["throughput/device/tflops"] = achieved / 1e12
        if peak_flops:
            m["throughput/mfu"] = achieved / peak_flops
            m["throughput/hfu"] = (images * executed / compute).mean().item() / peak_flops
    return m


class DiTThroughputMonitor(FitSummaryPart, L.Callback):
    """Log images/s, tokens/s, optimiser steps/s, data-loader wait and MFU/HFU every
    ``trainer.log_every_n_steps`` optimiser steps, plus ``img/s`` in the progress bar.

    Each micro-batch is timed from ``on_train_batch_start`` to ``on_train_batch_end``
    (compute: forward, backward, optimiser step) and from the previous batch's end to its start
    (wait: fetching the batch, moving it to the device, and callbacks that run between
    batches); validation and the first ``warmup_steps`` optimiser steps are left out.
    Images per optimiser step = micro-batch x ``accumulate_grad_batches`` x world size.

    FLOPs per image come from ``pl_module.flops_per_image()`` = (useful, executed): ``mfu``
    counts the useful forward+backward FLOPs, ``hfu`` also the forward passes that activation
    checkpointing re-runs. The peak is per device for the trainer's precision (see
    :func:`device_peak_flops`; the compute dtype is the strategy's ``param_dtype`` when it sets one, see
    :func:`dit_lightning.precision.compute_dtype`); on CPU, and on GPUs not in the tables, the MFU
    tags are only logged when ``peak_flops`` is given.

    Args:
        peak_flops: peak FLOP/s of one device, overriding the lookup (required for MFU on CPU).
        warmup_steps: optimiser steps excluded at the start of fit (CUDA/cuDNN autotuning,
            ``torch.compile``).
        prog_bar: show ``img/s`` (global images per second) in the progress bar.
        summary: contribute to (and print) the end-of-fit summary line.
    """

    _summary_order = 0

    def __init__(
        self,
        peak_flops: Optional[float] = None,
        warmup_steps: int = 1,
        prog_bar: bool = True,
        summary: bool = True,
    ) -> None:
        super().__init__()
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"peak_flops must be positive, got {peak_flops}")
        self.peak_flops_override = peak_flops
        self.warmup_steps = max(0, warmup_steps)
        self.prog_bar = prog_bar
        self.summary = summary
        self.peak_flops: Optional[float] = None
        self.flops_per_image: Optional[tuple[float, float]] = None
        self.tokens_per_image: Optional[int] = None
        self.fit_stats: dict[str, float] = {}
        self._clock: Optional[_Clock] = None
        self._summary_reset()
        self._reset_state()

    def _reset_state(self) -> None:
        self._batches: list[_Batch] = []
        self._prev: Any = None
        self._start: Any = None
        self._step_at_start = 0
        self._steps_seen = 0
        self._totals = dict(images=0.0, wall=0.0, compute=0.0, wait=0.0, steps=0.0, useful=0.0, executed=0.0)

    # ---- set-up ---------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._summary_reset()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After configure_model: TF32 flags, compilation and checkpointed blocks are final.
        device = trainer.strategy.root_device
        self._clock = _Clock(device)
        self._reset_state()
        self.fit_stats = {}
        self.peak_flops = self.peak_flops_override or device_peak_flops(device, compute_dtype(trainer))
        flops = getattr(pl_module, "flops_per_image", None)
        if callable(flops):
            value = flops()
            self.flops_per_image = (
                (float(value[0]), float(value[1])) if isinstance(value, tuple) else (float(value),) * 2
            )
        else:
            self.flops_per_image = None
        self.tokens_per_image = _tokens_per_image(pl_module)
        if self.peak_flops is None and self.flops_per_image is not None:
            where = "CPU" if device.type == "cpu" else f"{device} ({compute_dtype(trainer)})"
            log.info("no peak FLOP/s known for %s: MFU not logged (pass peak_flops to enable it)", where)

    # ---- timing hooks -----------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._clock is None:
            return
        self._start = self._clock.mark()
        self._step_at_start = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._clock is None or self._start is None:
            return
        end = self._clock.mark()
        stepped = trainer.global_step > self._step_at_start
        measured = self._steps_seen >= self.warmup_steps
        self._batches.append(_Batch(self._prev, self._start, end, batch_size_of(batch), stepped, measured))
        self._prev, self._start = end, None
        if not stepped:
            return
        self._steps_seen += 1
        if is_log_step(trainer, stepped):
            metrics = self._close_window(trainer)
            if metrics:
                log_to_loggers(trainer, metrics)
                if self.prog_bar:
                    value = metrics["throughput/images_per_sec"]
                    pl_module.log(
                        "img/s", value, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1
                    )
        elif log_every_n_steps(trainer) <= 0 and trainer.global_step % _FALLBACK_WINDOW_STEPS == 0:
            self._close_window(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The next wait starts now: the validation run itself is neither compute nor data wait.
        if self._clock is not None and not trainer.sanity_checking and self._prev is not None:
            self._prev = self._clock.mark()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._clock is None:
            return
        self._close_window(trainer)  # the steps after the last logged one count in the totals
        t = self._totals
        if t["steps"] > 0 and t["wall"] > 0:
            self.fit_stats = {
                "images_per_sec": t["images"] / t["wall"],
                "steps_per_sec": t["steps"] / t["wall"],
                "images_per_step": t["images"] / t["steps"],
                "data_wait_fraction": t["wait"] / t["wall"],
                "steps": t["steps"],
            }
            if self.flops_per_image is not None and t["compute"] > 0:
                self.fit_stats["device_tflops"] = t["useful"] / t["compute"] / 1e12
                if self.peak_flops:
                    self.fit_stats["mfu"] = t["useful"] / t["compute"] / self.peak_flops
                    self.fit_stats["hfu"] = t["executed"] / t["compute"] / self.peak_flops
        self._batches = []

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._summary_ready = True
        print_fit_summary(trainer, pl_module)

    # ---- windows ----------------------------------------------------------------------------
    def _close_window(self, trainer: L.Trainer) -> dict[str, float]:
        batches, self._batches = self._batches, []
        measured = [b for b in batches if b.measured]
        steps = sum(b.stepped for b in measured)
        # Same on every rank (warm-up and steps are counted identically), so either all ranks
        # reach the collective below or none does.
        if steps == 0 or self._clock is None:
            return {}
        self._clock.wait(batches[-1].end)
        compute = sum(self._clock.seconds(b.start, b.end) for b in measured)
        wait = sum(self._clock.seconds(b.prev, b.start) for b in measured if b.prev is not None)
        images = sum(b.images for b in measured)
        rows = gather_rows(trainer, [images, len(measured), max(compute, 1e-9), max(wait, 0.0)])
        metrics = window_metrics(rows, steps, self.tokens_per_image, self.flops_per_image, self.peak_flops)
        t = self._totals
        t["images"] += rows[:, 0].sum().item()
        t["compute"] += rows[:, 2].mean().item()
        t["wait"] += rows[:, 3].mean().item()
        t["wall"] += (rows[:, 2] + rows[:, 3]).mean().item()
        t["steps"] += steps
        if self.flops_per_image is not None:
            # FLOPs of an average device: sum over ranks / world size
            t["useful"] += rows[:, 0].mean().item() * self.flops_per_image[0]
            t["executed"] += rows[:, 0].mean().item() * self.flops_per_image[1]
        return metrics

    # ---- summary ----------------------------------------------------------------------------
    def summary_parts(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        s = self.fit_stats
        if not s:
            return [f"throughput n/a (no optimiser step after the {self.warmup_steps} warm-up steps)"]
        per_step = s["images_per_step"]
        micro = per_step / (trainer.accumulate_grad_batches * trainer.world_size)
        parts = [
            f"batch {micro:g}x{trainer.accumulate_grad_batches}x{trainer.world_size}={per_step:g}",
            f"{s['images_per_sec']:.1f} img/s ({s['steps_per_sec']:.2f} steps/s over {int(s['steps'])} steps)",
        ]
        if "mfu" in s:
            peak = self.peak_flops or 0.0
            dtype = compute_dtype(trainer)
            on_cuda = trainer.strategy.root_device.type == "cuda"
            kind = "tf32" if dtype == torch.float32 and on_cuda and tf32_enabled() else str(dtype).replace("torch.", "")
            parts.append(
                f"MFU {_percent(s['mfu'])} HFU {_percent(s['hfu'])} of {peak / 1e12:.4g} TFLOP/s {kind}/device"
            )
        elif "device_tflops" in s:
            parts.append(f"{s['device_tflops']:.4g} TFLOP/s/device (MFU n/a: unknown peak, set peak_flops)")
        parts.append(f"data wait {_percent(s['data_wait_fraction'])}")
        return parts


def _percent(x: float) -> str:
    # tiny models on big peaks (CPU tests, a toy DiT on an H200) would all print "0.0%"
    return f"{x:.1%}" if x >= 1e-3 or x == 0 else f"{x * 100:.2g}%"


def _tokens_per_image(pl_module: L.LightningModule) -> Optional[int]:
    """(H / p)^2 from the model's input size and patch size."""
    model = getattr(pl_module, "model", None)
    size, patch = getattr(model, "input_size", None), getattr(model, "patch_size", None)
    if isinstance(size, int) and isinstance(patch, int) and patch > 0:
        return (size // patch) ** 2
    shape = getattr(pl_module, "shape", None)
    return getattr(shape, "tokens", None)
