"""Resource planner: predict the peak memory of a DiT training step and recommend a setup.

``PlanOptions`` describes a run (the network, the batch per device, every memory lever);
``plan_memory(options) -> MemoryPlan`` is the analytic memory model, ``recommend(options, gpu=...)
-> Recommendation`` searches the micro-batch, accumulation, precision, selective activation
checkpointing and strategy the options leave unset for the fastest configuration that fits.
Both also take a model name and the options' fields as keywords
(``plan_memory("DiT-XL/2", micro_batch=32)``). ``dit_lightning.commands.plan`` is the
``dit-lightning plan`` command (rich table or JSON). Pure PyTorch + stdlib at import time
(rich is imported only to print tables).
"""

from .hardware import GPUS, GPUSpec, gpu_spec
from .memory import (
    GiB,
    MemoryPlan,
    PlanOptions,
    block_activation_terms,
    param_counts,
    plan_memory,
    state_per_device,
)
from .recommend import Candidate, Recommendation, estimate_step_time, recommend
from .report import render_memory, render_recommendation

__all__ = [
    "GPUS",
    "Candidate",
    "GPUSpec",
    "GiB",
    "MemoryPlan",
    "PlanOptions",
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
