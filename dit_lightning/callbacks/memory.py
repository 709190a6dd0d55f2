"""Device and host memory of DiT training, per logging window, plus the end-of-fit summary.

Lightning's :class:`~lightning.pytorch.callbacks.DeviceStatsMonitor` logs the whole
``torch.cuda.memory_stats()`` dict of rank 0 only, never resets the peaks (so a one-off spike
hides everything after it) and has nothing on CPU; this callback logs the few numbers that
explain an OOM, reduced over ranks, with window peaks, and the process RSS everywhere.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Optional

import lightning as L
import torch

from .throughput import FitSummaryPart, gather_rows, is_log_step, log_to_loggers, print_fit_summary

GiB = float(2**30)

# (tag suffix, torch.cuda.memory_stats key, is bytes). "peak" keys are peaks since the last
# torch.cuda.reset_peak_memory_stats(), i.e. within the logging window; the counters are
# cumulative since the process started (reset_peak_memory_stats leaves them alone).
_CUDA_STATS = (
    ("allocated_gib", "allocated_bytes.all.current", True),
    ("reserved_gib", "reserved_bytes.all.current", True),
    ("peak_allocated_gib", "allocated_bytes.all.peak", True),
    ("peak_reserved_gib", "reserved_bytes.all.peak", True),
    ("alloc_retries", "num_alloc_retries", False),
    ("ooms", "num_ooms", False),
)
_CPU_STATS = (("cpu_rss_gib", True), ("cpu_peak_rss_gib", True))
_NAMES = [name for name, _, _ in _CUDA_STATS] + [name for name, _ in _CPU_STATS]


def cpu_rss_bytes() -> Optional[int]:
    """Current resident set size of this process (Linux ``/proc/self/statm``), else None."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def cpu_peak_rss_bytes() -> Optional[int]:
    """Peak resident set size of this process since it started (``getrusage``), else None.

    Data-loader workers are other processes and are not included.
    """
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS: bytes, Linux: KiB


def memory_row(device: torch.device) -> list[float]:
    """This rank's numbers in :data:`_NAMES` order (NaN where not available)."""
    nan = float("nan")
    row: list[float] = []
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        for _, key, is_bytes in _CUDA_STATS:
            value = float(stats.get(key, 0))
            row.append(value / GiB if is_bytes else value)
    else:
        row.extend([nan] * len(_CUDA_STATS))
    # current before peak: the peak read afterwards can only be larger
    rss = cpu_rss_bytes()
    peak = cpu_peak_rss_bytes()
    row.append(rss / GiB if rss is not None else nan)
    row.append(max(peak, rss or 0) / GiB if peak is not None else nan)
    return row


def _max_over_ranks(rows: torch.Tensor) -> list[float]:
    filled = torch.where(torch.isnan(rows), torch.full_like(rows, -math.inf), rows)
    best = filled.max(dim=0).values
    return [v if v != -math.inf else math.nan for v in best.tolist()]


class GPUMemoryMonitor(FitSummaryPart, L.Callback):
    """Log memory every ``trainer.log_every_n_steps`` optimiser steps and print a one-line
    summary (peak memory, images/s, MFU) at the end of fit.

    On CUDA: ``memory/allocated_gib``, ``reserved_gib``, ``peak_allocated_gib``,
    ``peak_reserved_gib`` (peaks within the window: they are reset after each log),
    ``alloc_retries`` and ``ooms`` (cumulative counts of the caching allocator). Everywhere:
    ``memory/cpu_rss_gib`` and ``memory/cpu_peak_rss_gib`` of the training process, so the
    ``memory/`` section of the dashboard has data on a laptop too. Values are the max over
    ranks (the rank that runs out first is the one that matters).

    Args:
        per_rank: also log every rank's values as ``memory/rank{r}/...``.
        reset_peak: reset the CUDA peaks after each log (window peaks); False gives peaks
            since the start of the process.
        summary: contribute to (and print) the end-of-fit summary line.
    """

    _summary_order = 1

    def __init__(self, per_rank: bool = False, reset_peak: bool = True, summary: bool = True) -> None:
        super().__init__()
        self.per_rank = per_rank
        self.reset_peak = reset_peak
        self.summary = summary
        self.fit_peaks: dict[str, float] = {}
        self._step_at_start = 0
        self._summary_reset()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._summary_reset()
        self.fit_peaks = {}

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_start = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if is_log_step(trainer, trainer.global_step > self._step_at_start):
            log_to_loggers(trainer, self._measure(trainer))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Whatever ran after the last log (the final validation...) counts in the fit peaks.
        # Here, not in on_fit_end: the strategy's teardown (model and optimiser to CPU) runs
        # between the two.
        self._measure(trainer)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._summary_ready = True
        print_fit_summary(trainer, pl_module)

    def _measure(self, trainer: L.Trainer) -> dict[str, float]:
        """Gather this window's numbers from all ranks (a collective), update the fit peaks,
        reset the CUDA window peaks; returns the tags to log."""
        device = trainer.strategy.root_device
        rows = gather_rows(trainer, memory_row(device))
        if device.type == "cuda" and self.reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
        metrics: dict[str, float] = {}
        for name, value in zip(_NAMES, _max_over_ranks(rows)):
            if math.isnan(value):
                continue
            metrics[f"memory/{name}"] = value
            # window peaks -> fit peaks; counters are cumulative, so their max is the last value
            self.fit_peaks[name] = max(self.fit_peaks.get(name, value), value)
        if self.per_rank:
            for rank, row in enumerate(rows.tolist()):
                for name, value in zip(_NAMES, row):
                    if not math.isnan(value):
                        metrics[f"memory/rank{rank}/{name}"] = value
        if device.type == "cuda":
            self.fit_peaks["total_gib"] = torch.cuda.get_device_properties(device).total_memory / GiB
        return metrics

    def summary_parts(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        p = self.fit_peaks
        ranks = f" (max over {trainer.world_size} ranks)" if trainer.world_size > 1 else ""
        parts = []
        if "peak_allocated_gib" in p:
            parts.append(
                f"peak GPU memory {p['peak_allocated_gib']:.2f} GiB allocated / {p['peak_reserved_gib']:.2f} GiB "
                "reserved"
                f" of {p.get('total_gib', float('nan')):.1f} GiB{ranks}, {int(p.get('alloc_retries', 0))} alloc "
                "retries,"
                f" {int(p.get('ooms', 0))} OOMs"
            )
        if "cpu_peak_rss_gib" in p:
            parts.append(f"peak CPU RSS {p['cpu_peak_rss_gib']:.2f} GiB{ranks}")
        return parts
