"""Resource planner: predict the peak memory of a DiT training step and recommend a setup.

``plan_memory(...) -> MemoryPlan`` is the analytic memory model, ``recommend(...) ->
Recommendation`` searches micro-batch, accumulation, precision, selective activation
checkpointing and strategy for the fastest configuration that fits, ``plan(...)`` is the
``dit-lightning plan`` command (rich table or JSON). Pure PyTorch + stdlib at import time
(rich is imported only to print tables).
"""

from .hardware import GPUS, GPUSpec, gpu_spec
from .memory import GiB, MemoryPlan, block_activation_terms, param_counts, plan_memory, state_per_device
from .recommend import Candidate, Recommendation, estimate_step_time, recommend
from .report import render_memory, render_recommendation

__all__ = [
    "GPUS",
    "Candidate",
    "GPUSpec",
    "GiB",
    "MemoryPlan",
    "Recommendation",
    "block_activation_terms",
    "estimate_step_time",
    "gpu_spec",
    "param_counts",
    "plan_memory",
    "recommend",
    "render_memory",
    "render_recommendation",
    "state_per_device",
]
