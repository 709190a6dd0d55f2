"""Measure the real peak memory of a training step, to validate the planner.

On CUDA the caching allocator keeps the statistic (``torch.cuda.max_memory_allocated``). On
CPU PyTorch keeps none, so :func:`cpu_allocator_peak` runs the step under the profiler with
``profile_memory=True``: PyTorch's CPU allocator then reports every allocation and free
(tensor storages and the scratch buffers kernels take from it), and the running sum of
those events gives the exact peak of bytes allocated through PyTorch during the call, the
CPU counterpart of ``max_memory_allocated``. It does not see memory that libraries take
from malloc themselves (BLAS packing buffers, Python objects), which is small and not what
the planner predicts. Peak RSS would mix all of that in and, with glibc keeping freed pages,
hardly moves on a second step.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch import Tensor

from ..precision import autocast, is_fp16


def cpu_allocator_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn()`` and return ``(result, peak)``: the peak of bytes allocated by PyTorch's CPU
    allocator during the call, above what was allocated when it started.

    The allocations and frees come from the profiler's memory events, read from its public
    Chrome-trace export (``[memory]`` instant events with their ``Bytes``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        result = fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    memory = sorted(
        (e["ts"], int(e["args"]["Bytes"]))
        for e in events
        if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0  # 0: CPU
    )
    current = peak = 0
    for _, nbytes in memory:
        current += nbytes
        peak = max(peak, current)
    return result, peak


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared storages once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


class TrainingStep:
    """One optimiser step of the project's training objective, without a Trainer.

    It runs what ``DiTModule.training_step`` and Lightning's automatic optimisation run: the
    module's hybrid diffusion loss (keyed timesteps, noise and label dropout) under the
    precision's autocast, backward (through a GradScaler for ``16-mixed`` on CUDA), the
    module's optimiser, ``zero_grad(set_to_none=True)`` and the EMA update.
    """

    def __init__(
        self,
        module: Any,
        batch: dict[str, Tensor],
        precision: str = "32-true",
        optimizer: Optional[torch.optim.Optimizer] = None,
    ) -> None:
        self.module = module
        self.batch = batch
        self.precision = precision
        self.device = batch["x"].device
        self.optimizer = optimizer if optimizer is not None else _as_optimizer(module.configure_optimizers())
        use_scaler = is_fp16(precision) and self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda") if use_scaler else None
        self.step_index = 0
        module.train()

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device.type, self.precision)

    def __call__(self) -> float:
        m = self.module
        with self.autocast():
            loss = m.diffusion_loss(m.model, self.batch, self.step_index, train=True)["loss"]
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        m.update_ema()
        self.step_index += 1
        return float(loss.detach())

    def state_bytes(self) -> int:
        """Bytes held between steps: weights, EMA weights, optimiser states, the batch."""
        m = self.module
        tensors = list(m.model.parameters()) + list(m.model.buffers())
        if m.ema is not None:
            tensors += list(m.ema.parameters()) + list(m.ema.buffers())
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
        tensors += [v for v in self.batch.values() if torch.is_tensor(v)]
        return tensor_bytes(tensors)


def _as_optimizer(configured: Any) -> torch.optim.Optimizer:
    if isinstance(configured, dict):
        return configured["optimizer"]
    return configured


def measure_cpu_step_peak(step: TrainingStep, warmup: int = 1) -> int:
    """Peak bytes allocated on CPU during one step after ``warmup`` steps (which create the
    optimiser states), including the state that lives between steps."""
    for _ in range(warmup):
        step()
    _, dynamic = cpu_allocator_peak(step)
    return step.state_bytes() + dynamic
