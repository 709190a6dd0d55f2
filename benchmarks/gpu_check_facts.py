"""What a ``dit-lightning fit`` of the GPU check really ran with, written by each rank as JSON.

Loaded by the runs of ``benchmarks/gpu_check.py`` as ``--trainer.callbacks`` entry
``gpu_check_facts.RunFacts`` (``benchmarks/`` is on their PYTHONPATH). It records what the
configuration cannot prove by itself: the precision plugin and whether its GradScaler is active,
the compute dtype and the peak FLOP/s the throughput monitor took, whether AdamW is fused,
whether the network is compiled, checkpointed and wrapped by FSDP1/FSDP2, whether deterministic
algorithms are on and which kernels warned that they have no deterministic implementation.

With ``sync_audit``, CUDA's sync-debug mode (``torch.cuda.set_sync_debug_mode("warn")``) is on while
the run trains, and every synchronising CUDA operation is recorded with the optimiser step it
happened in and the Python line that made it (``host_syncs`` in the JSON): the training step may make
them only at the steps Lightning logs (issue 24's rule), which the GPU check verifies.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

from dit_lightning.atomic import write_text
from dit_lightning.callbacks import DiTThroughputMonitor, GPUMemoryMonitor
from dit_lightning.distributed import is_fsdp2
from dit_lightning.distributed.sharding import _fsdp1_units
from dit_lightning.planner.hardware import tf32_enabled
from dit_lightning.precision import compute_dtype, grad_scaler

NONDETERMINISTIC = "does not have a deterministic implementation"
SYNCHRONIZING = "called a synchronizing CUDA operation"


def _callbacks(trainer: Any) -> list:
    """The Trainer's callbacks (set by Lightning's callback connector; the class does not declare them)."""
    return list(trainer.callbacks)


class RunFacts(L.Callback):
    """Write ``<output>_rank<r>.json`` at the start and the end of training.

    Args:
        output: path prefix of the JSON files (one per rank).
    """

    def __init__(self, output: str, sync_audit: bool = False) -> None:
        super().__init__()
        self.output = output
        self.sync_audit = sync_audit
        self._syncs: list[tuple[int, str]] = []  # (optimiser steps done, file:line) of each synchronisation
        self._trainer: Optional[L.Trainer] = None
        self.facts: dict[str, Any] = {}
        self._warnings: list[str] = []
        self._show: Optional[Any] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Kernels without a deterministic implementation warn under Trainer(deterministic="warn").
        self._show = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            text = str(message)
            if NONDETERMINISTIC in text and text not in self._warnings:
                self._warnings.append(text.splitlines()[0][:300])
            if SYNCHRONIZING in text and self._trainer is not None:
                self._syncs.append((self._trainer.global_step, f"{filename}:{lineno}"))
                return  # one per synchronisation: recorded, not printed
            if self._show is not None:
                self._show(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        warnings.filterwarnings("always", message=f".*{NONDETERMINISTIC}.*")
        warnings.filterwarnings("always", message=f".*{SYNCHRONIZING}.*")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._show is not None:
            warnings.showwarning = self._show

    def _write(self, trainer: L.Trainer) -> None:
        path = Path(f"{self.output}_rank{trainer.global_rank}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(self.facts, indent=2, default=str))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        model = getattr(pl_module, "model", None)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        defaults = getattr(optimizer, "defaults", {}) if optimizer is not None else {}
        scaler = grad_scaler(trainer)
        throughput = next((c for c in _callbacks(trainer) if isinstance(c, DiTThroughputMonitor)), None)
        self.facts = {
            "precision": str(trainer.precision),
            "precision_plugin": type(trainer.precision_plugin).__name__,
            "grad_scaler": scaler is not None,
            "compute_dtype": str(compute_dtype(trainer)).replace("torch.", ""),
            "strategy": type(trainer.strategy).__name__,
            "sharding_strategy": str(getattr(getattr(trainer.strategy, "model", None), "sharding_strategy", "")),
            "world_size": trainer.world_size,
            "global_rank": trainer.global_rank,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "fused": bool(defaults.get("fused")),
            "foreach": defaults.get("foreach"),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "tf32": tf32_enabled(),
            "compiled": bool(getattr(model, "_compiled", False)),
            "checkpoint_blocks": len(getattr(model, "checkpoint_blocks", ()) or ()),
            "fsdp2": bool(model is not None and is_fsdp2(model)),
            "fsdp1_units": len(_fsdp1_units(pl_module)),
            "peak_flops": getattr(throughput, "peak_flops", None),
        }
        self._write(trainer)
        if self.sync_audit and device.type == "cuda":
            self._trainer = trainer
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._trainer is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._trainer = None
            self.facts["host_syncs"] = self._sync_report(trainer)
        scaler = grad_scaler(trainer)
        throughput = next((c for c in _callbacks(trainer) if isinstance(c, DiTThroughputMonitor)), None)
        memory = next((c for c in _callbacks(trainer) if isinstance(c, GPUMemoryMonitor)), None)
        device = trainer.strategy.root_device
        stats = {k: v for k, v in (getattr(throughput, "fit_stats", None) or {}).items() if math.isfinite(float(v))}
        self.facts.update(
            global_step=trainer.global_step,
            loss_scale=float(scaler.get_scale()) if scaler is not None else None,
            throughput=stats,
            memory_peaks=dict(getattr(memory, "fit_peaks", None) or {}),
            max_memory_allocated_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            nondeterministic_kernels=list(self._warnings),
        )
        self._write(trainer)

    def _sync_report(self, trainer: L.Trainer) -> dict[str, Any]:
        """The synchronisations per optimiser step, split by who made them (this package or others)."""
        every = int(getattr(trainer, "log_every_n_steps", 0) or 0)
        ours: dict[str, int] = {}
        theirs: dict[str, int] = {}
        quiet: dict[int, list[str]] = {}  # package syncs during steps Lightning does not log
        for step, where in self._syncs:
            mine = "/dit_lightning/" in where
            place = where.split("/dit_lightning/")[-1] if mine else where.rsplit("site-packages/", 1)[-1]
            (ours if mine else theirs)[place] = (ours if mine else theirs).get(place, 0) + 1
            # Lightning logs after step s when s % every == 0 (counted after it): reads at that point
            # belong to the logged step, any other is on the hot path
            logged = every > 0 and step % every == 0
            if mine and not logged:
                quiet.setdefault(step, []).append(place)
        return {
            "log_every_n_steps": every,
            "steps": trainer.global_step,
            "total": len(self._syncs),
            "package": ours,
            "others": dict(sorted(theirs.items(), key=lambda kv: -kv[1])[:12]),
            "package_outside_logged_steps": {str(k): v for k, v in quiet.items()},
        }
