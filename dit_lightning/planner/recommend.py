"""``--fit``: the fastest configuration that fits a GPU, with time and cost estimates.

The search enumerates precision x strategy x micro-batch (every divisor of the per-GPU
batch, so ``micro x world x accumulate == global`` exactly) and, for each, the smallest
number of checkpointed blocks that fits (selective checkpointing: memory falls
monotonically with every recomputed block, so a bisection finds the minimum). Candidates are
ranked by the estimated step time:

    micro   = max(micro x executed FLOPs per image / (utilisation x dense peak), kernels x launch)
    step    = accumulation x micro + exposed communication + optimizer/EMA

with the executed FLOPs of :func:`dit_lightning.models.flops.training_flops` (recompute
included); an assumed utilisation (stated, overridable with a measured MFU) that is reached
from 4096 tokens per micro-batch and falls as sqrt(tokens / 4096) below (small matmuls do
not fill a GPU); a launch-bound floor of 5 us per kernel; the communication the backward pass
(DDP) or the whole micro-batch (FSDP) does not hide, over the GPUs' interconnect
(:mod:`.communication`); the memory-bound AdamW + EMA pass at 70% of the memory bandwidth.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

from ..communication import fsdp_reduce_dtype, parse_communication
from ..models.flops import training_flops
from ..precision import TrainingPrecision, best_mixed_precision, is_mixed, to_dtype
from .communication import CommunicationPlan, plan_communication
from .hardware import GPUS, GPUSpec, gpu_spec, local_gpu
from .memory import (
    GiB,
    MemoryPlan,
    PlanOptions,
    Sharding,
    Strategy,
    checkpointed_block_indices,
    plan_memory,
    repa_costs,
)

# Assumed hardware utilisation of executed FLOPs, relative to the dense peak of the precision.
DEFAULT_MFU: dict[TrainingPrecision, float] = {"bf16-mixed": 0.35, "16-mixed": 0.35, "32-true": 0.12}
SATURATION_TOKENS = 4096  # tokens per micro-batch from which the assumed utilisation holds
LAUNCH_S = 5e-6  # per kernel: the floor of a micro-batch when kernels are tiny
KERNELS_PER_BLOCK = 80  # forward + backward kernels of one DiT block (recompute adds ~25)
OPTIMIZER_BYTES_PER_PARAM = 40  # AdamW reads p, g, m, v and writes p, m, v; EMA reads 2, writes 1 (fp32)
FSDP_EFFICIENCY = 0.95  # FSDP's copies into and out of its flat collective buffers (its traffic is priced apart)
TIE = 0.03  # step times within 3% are ties, decided for the simpler configuration


@dataclass
class Candidate:
    """One evaluated configuration (a row of the ranking)."""

    precision: str
    strategy: str
    sharding: Optional[str]
    micro_batch: int
    accumulate_grad_batches: int
    checkpointed_blocks: int
    fits: bool
    total_gib: float
    step_time_s: float
    images_per_s: float
    total_bytes: int = 0  # the predicted memory per device, exactly (total_gib is rounded)
    activation_checkpointing: str = "none"  # the model's spelling of the recomputed blocks
    communication_s: float = 0.0  # the step's exposed communication (included in step_time_s)

    @property
    def setting(self) -> tuple[str, int, str]:
        """(precision, micro-batch, activation checkpointing): what a run sets per device."""
        return (self.precision, self.micro_batch, self.activation_checkpointing)


def checkpoint_spelling(blocks: int, depth: int) -> str:
    """The model's spelling of "recompute the first N blocks": none, all or first:N."""
    if blocks <= 0:
        return "none"
    return "all" if blocks >= depth else f"first:{blocks}"


def nominal_spec(memory_gib: float, device: str = "cuda", bf16: bool = True) -> GPUSpec:
    """A stand-in device for a memory budget without a GPU type: step times are only relative."""
    return GPUSpec(
        "cpu" if device == "cpu" else "unknown GPU",
        memory_gib,
        memory_gib,
        bf16_tflops=100.0 if bf16 else 0.0,
        fp16_tflops=100.0,
        tf32_tflops=50.0,
        fp32_tflops=25.0,
        bandwidth_tbs=1.0,
        link_gbs=12.0,
    )


@dataclass
class Recommendation:
    """The fastest configuration that fits, its memory plan and time/cost estimates."""

    model: str
    gpu: Optional[str]
    world_size: int
    global_batch: int
    feasible: bool
    micro_batch: int
    accumulate_grad_batches: int
    precision: str
    checkpointed_blocks: int
    depth: int
    strategy: str
    sharding: Optional[str]
    step_time_s: float
    images_per_s: float
    assumed_utilisation: float
    model_flops_utilisation: float  # useful FLOPs (no recompute) over the dense peak
    steps: int
    hours: float
    gpu_hours: float
    price_per_gpu_hour: Optional[float]
    cost: Optional[float]
    memory: MemoryPlan
    lightning_args: list[str] = field(default_factory=list)
    alternatives: list[Candidate] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    activation_checkpointing: str = "none"  # the model's spelling of checkpointed_blocks
    device: str = "cuda"
    budget_gib: Optional[float] = None  # the memory per device the search fitted into
    nominal_device: bool = False  # no GPU type: step times are relative, not predictions
    command: str = ""  # a `dit-lightning fit --config ...` line (set by the plan command)
    communication: Optional[CommunicationPlan] = None  # the chosen setting's traffic
    # the chosen setting with each gradient reduction: communication -> (step s, exposed communication s)
    communication_options: dict[str, tuple[float, float]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["memory"] = self.memory.to_dict()
        return d

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


@dataclass
class StepTime:
    """One optimiser step's time, by part (seconds)."""

    step_s: float
    compute_s: float
    micro_s: float
    communication: CommunicationPlan
    optimizer_s: float
    utilisation: float
    useful_mfu: float


def _peak_tflops(spec: GPUSpec, precision: str) -> float:
    # fp32 matmuls run on TF32 tensor cores: the project enables TF32 by default
    return spec.dense_tflops(to_dtype(precision), tf32=True)


def estimate_step_time(
    options: PlanOptions, spec: GPUSpec, global_batch: int, mfu: Optional[float] = None
) -> tuple[float, float, float]:
    """(step seconds, assumed utilisation, useful MFU) of one optimiser step of ``options`` (its
    unset settings as :func:`plan_memory` plans them) at ``global_batch`` on GPUs ``spec``."""
    t = step_time(options, spec, global_batch, mfu)
    return t.step_s, t.utilisation, t.useful_mfu


def step_time(options: PlanOptions, spec: GPUSpec, global_batch: int, mfu: Optional[float] = None) -> StepTime:
    """:func:`estimate_step_time` by part: compute, exposed communication, optimiser."""
    o = options.planned()
    assert o.micro_batch is not None and o.precision is not None  # planned() sets them
    shape, world_size, micro_batch, precision = o.shape, o.world_size, o.micro_batch, o.precision
    checkpointed_blocks = len(checkpointed_block_indices(o.activation_checkpointing, shape.depth))
    useful, executed = training_flops(shape, recomputed_blocks=checkpointed_blocks)
    repa = repa_costs(o, micro_batch, is_mixed(precision))["flops"]  # REPA's projector and online encoder
    useful, executed = useful + repa, executed + repa
    util = DEFAULT_MFU[precision] if mfu is None else mfu
    peak = _peak_tflops(spec, precision) * 1e12
    per_gpu = global_batch // world_size
    n_micro = per_gpu // micro_batch
    eff = FSDP_EFFICIENCY if o.sharded else 1.0
    eff *= min(1.0, micro_batch * shape.tokens / SATURATION_TOKENS) ** 0.5
    kernels = shape.depth * KERNELS_PER_BLOCK + 25 * checkpointed_blocks + 60
    micro = max(micro_batch * executed / (util * eff * peak), kernels * LAUNCH_S)
    compute = n_micro * micro
    pc = o.param_counts()
    # the backward's share of a micro-batch: all but the forward (a third of the useful FLOPs)
    backward_share = 1 - useful / 3 / executed
    comm = plan_communication(
        o.replace(accumulate_grad_batches=n_micro),
        spec.name if spec.name in GPUS else None,
        micro_s=micro,
        backward_share=backward_share,
    )
    shard = world_size if o.strategy == "fsdp" else 1
    optim = OPTIMIZER_BYTES_PER_PARAM * pc["total"] / shard / (0.7 * spec.bandwidth_tbs * 1e12)
    step = compute + comm.exposed_s + optim
    useful_mfu = global_batch * useful / (step * world_size * peak)
    return StepTime(step, compute, micro, comm, optim, util, useful_mfu)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def recommend(
    options: Union[PlanOptions, str, None] = None,
    *,
    gpu: Optional[Union[str, GPUSpec]] = "rtx4090",
    global_batch: int = 256,
    memory_gib: Optional[float] = None,
    mfu: Optional[float] = None,
    steps: int = 400_000,
    price_per_gpu_hour: Optional[float] = None,
    top: int = 8,
    num_gpus: Optional[int] = None,
    **levers: Any,
) -> Recommendation:
    """Recommend the fastest configuration of ``world_size`` GPUs that fits at ``global_batch``.

    Args:
        options: the run (:class:`~dit_lightning.planner.memory.PlanOptions`), or a model name.
            Its ``precision``, ``strategy``, ``sharding``, ``micro_batch`` (or
            ``accumulate_grad_batches``) and ``activation_checkpointing`` pin a choice when set
            (the checkpointing pin takes the model's spellings); unset, they are searched. An unset
            ``ddp_gradient_as_bucket_view`` is True (the answer names DiTDDPStrategy). On a ``cpu``
            device the search keeps to 32-true unless a precision is pinned: 16-bit matmuls are slow
            on most CPUs.
        gpu: GPU type (its memory, peak compute, bandwidth): a name of the table, the name
            ``torch.cuda.get_device_name()`` prints, ``"auto"`` (this machine's device 0) or a
            :class:`GPUSpec`; ``memory_gib`` overrides its memory. Without a GPU type (None) a
            ``memory_gib`` budget is searched with a nominal device: the ranking holds, the times
            are only relative.
        global_batch: micro-batch x GPUs x accumulation, exactly; divisible by the number of GPUs.
        mfu: measured utilisation of the executed FLOPs (default 0.35 for 16-bit, 0.12 for fp32).
        steps, price_per_gpu_hour: for the time and cost of the run.
        top: how many alternatives to keep in the ranking.
        num_gpus: the data-parallel world size (the options' ``world_size``).
        levers: :class:`~dit_lightning.planner.memory.PlanOptions` fields to set or change, by name.
    """
    o = PlanOptions.of(options, **levers)
    if num_gpus is not None:
        o = o.replace(world_size=num_gpus)
    world = o.world_size
    if global_batch % world:
        raise ValueError(f"global batch {global_batch} is not divisible by {world} GPUs")
    nominal = False
    if isinstance(gpu, GPUSpec):
        spec = gpu
    elif gpu is not None and gpu.strip().lower() == "auto":
        _name, found, total_gib = local_gpu()
        spec = found if found is not None else nominal_spec(total_gib, "cuda")
        nominal = found is None
    elif gpu:
        spec = gpu_spec(gpu)
    elif memory_gib is not None:
        spec, nominal = nominal_spec(memory_gib, o.device), True
    else:
        raise ValueError(
            "recommend needs a GPU type (gpu: a name of the table, or 'auto' for this machine's GPU) or a memory "
            "budget (memory_gib): the search fits settings into a memory"
        )
    budget_gib = memory_gib if memory_gib is not None else spec.usable_gib
    per_gpu = global_batch // world
    depth = o.shape.depth
    bucket_view = True if o.ddp_gradient_as_bucket_view is None else o.ddp_gradient_as_bucket_view
    base = o.replace(ddp_gradient_as_bucket_view=bucket_view)

    precisions: list[TrainingPrecision]
    layouts: list[tuple[Strategy, Optional[Sharding]]]
    if o.precision is not None:
        precisions = [o.precision]
    elif o.device == "cpu":
        precisions = ["32-true"]
    else:
        precisions = [best_mixed_precision(spec.supports_bf16), "32-true"]
    pinned_blocks = (
        None if o.activation_checkpointing is None else checkpointed_block_indices(o.activation_checkpointing, depth)
    )
    if world == 1:
        layouts = [("ddp", None)]
    elif o.strategy == "ddp":
        layouts = [("ddp", None)]
    elif o.strategy == "fsdp":
        layouts = [("fsdp", o.sharding)] if o.sharding else [("fsdp", "SHARD_GRAD_OP"), ("fsdp", "FULL_SHARD")]
    else:
        layouts = [("ddp", None), ("fsdp", "SHARD_GRAD_OP"), ("fsdp", "FULL_SHARD")]
    if parse_communication(o.communication)[0] == "powersgd":
        if world > 1 and o.strategy == "fsdp":
            fsdp_reduce_dtype(o.communication)  # refused, in the words the FSDP strategies use
        layouts = [("ddp", None)]
    micro_batch = o.micro_batch
    if o.accumulate_grad_batches is not None:
        if per_gpu % o.accumulate_grad_batches:
            raise ValueError(
                f"{o.accumulate_grad_batches} accumulation steps do not divide the per-GPU batch {per_gpu} "
                f"({global_batch}/{world})"
            )
        if micro_batch is not None and micro_batch * o.accumulate_grad_batches != per_gpu:
            raise ValueError(
                f"micro-batch {micro_batch} x {o.accumulate_grad_batches} accumulation steps is not the per-GPU "
                f"batch {per_gpu} ({global_batch}/{world})"
            )
        micro_batch = per_gpu // o.accumulate_grad_batches
    micros = [micro_batch] if micro_batch else _divisors(per_gpu)
    if micro_batch and per_gpu % micro_batch:
        raise ValueError(
            f"micro-batch {micro_batch} does not divide the per-GPU batch {per_gpu} ({global_batch}/{world})"
        )

    def candidate(
        prec: TrainingPrecision, strat: Strategy, shard: Optional[Sharding], mb: int, k: Union[int, Sequence[int]]
    ) -> PlanOptions:
        """The run with one candidate's settings (k: the first k blocks, or the blocks listed)."""
        return base.replace(
            precision=prec,
            strategy=strat,
            sharding=shard or "FULL_SHARD",
            micro_batch=mb,
            accumulate_grad_batches=per_gpu // mb,
            activation_checkpointing=k,
        )

    def memory(
        prec: TrainingPrecision, strat: Strategy, shard: Optional[Sharding], mb: int, k: Union[int, Sequence[int]]
    ) -> MemoryPlan:
        return plan_memory(
            candidate(prec, strat, shard, mb, k), gpu=spec.name if spec.name in GPUS else None, memory_gib=budget_gib
        )

    evaluated: list[tuple[Candidate, MemoryPlan, PlanOptions]] = []
    for prec in precisions:
        for strat, shard in layouts:
            for mb in micros:
                if pinned_blocks is not None:  # the user's blocks: no search
                    plan_k, k = memory(prec, strat, shard, mb, list(pinned_blocks)), len(pinned_blocks)
                    fits = bool(plan_k.fits)
                # smallest k that fits: memory is non-increasing in k, so bisect on [0, depth]
                elif not memory(prec, strat, shard, mb, depth).fits:
                    plan_k, k = memory(prec, strat, shard, mb, depth), depth
                    fits = False
                else:
                    lo, hi = 0, depth
                    while lo < hi:
                        mid = (lo + hi) // 2
                        if memory(prec, strat, shard, mb, mid).fits:
                            hi = mid
                        else:
                            lo = mid + 1
                    k, plan_k, fits = lo, memory(prec, strat, shard, mb, lo), True
                run = candidate(prec, strat, shard, mb, list(pinned_blocks) if pinned_blocks is not None else k)
                timing = step_time(run, spec, global_batch, mfu)
                t = timing.step_s
                cand = Candidate(
                    precision=prec,
                    strategy=strat if world > 1 else "single device",
                    sharding=shard,
                    micro_batch=mb,
                    accumulate_grad_batches=per_gpu // mb,
                    checkpointed_blocks=k,
                    fits=fits,
                    total_gib=round(plan_k.total / GiB, 2),
                    step_time_s=round(t, 4),
                    images_per_s=round(global_batch / t, 2),
                    total_bytes=plan_k.total,
                    activation_checkpointing=(
                        str(o.activation_checkpointing)
                        if pinned_blocks is not None and not isinstance(o.activation_checkpointing, (list, tuple))
                        else checkpoint_spelling(k, depth)
                    ),
                    communication_s=round(timing.communication.exposed_s, 4),
                )
                evaluated.append((cand, plan_k, run))

    def rank(item: tuple[Candidate, MemoryPlan, PlanOptions]) -> tuple:
        c = item[0]
        return (not c.fits, c.step_time_s, c.accumulate_grad_batches, c.strategy == "fsdp", c.precision != "bf16-mixed")

    evaluated.sort(key=rank)
    # The time model is coarse: among candidates within TIE of the fastest, take the simplest
    # (DDP before FSDP, SHARD_GRAD_OP before FULL_SHARD, fewer accumulation steps, bf16).
    fastest = evaluated[0][0]
    close = [e for e in evaluated if e[0].fits == fastest.fits and e[0].step_time_s <= fastest.step_time_s * (1 + TIE)]
    close.sort(
        key=lambda e: (
            e[0].strategy == "fsdp",
            e[0].sharding == "FULL_SHARD",
            e[0].accumulate_grad_batches,
            e[0].precision != "bf16-mixed",
            e[0].step_time_s,
        )
    )
    best, best_plan, chosen = close[0]
    evaluated.remove(close[0])
    evaluated.insert(0, close[0])
    chosen_time = step_time(chosen, spec, global_batch, mfu)
    t, util, useful_mfu = chosen_time.step_s, chosen_time.utilisation, chosen_time.useful_mfu
    # what each gradient reduction would make of the chosen setting (the search keeps the run's own:
    # compression changes the training, so it is the user's call, priced here)
    options_time: dict[str, tuple[float, float]] = {}
    if world > 1:
        kinds = ("none", "bf16", "powersgd") if best.strategy == "ddp" else ("none", "bf16")
        for kind in kinds:
            alt = step_time(chosen.replace(communication=kind), spec, global_batch, mfu)
            options_time[kind] = (alt.step_s, alt.communication.exposed_s)
    hours = steps * t / 3600
    args = [
        f"--trainer.devices {world}",
        f"--trainer.precision {best.precision}",
        f"--trainer.accumulate_grad_batches {best.accumulate_grad_batches}",
        f"--data.global_batch_size {global_batch}",
        f"--model.activation_checkpointing {best.activation_checkpointing}",
    ]
    if world > 1:
        kind, named_rank = parse_communication(o.communication)
        if best.strategy == "ddp":  # the project's DDP strategy: gradient_as_bucket_view=True
            args += ["--trainer.strategy dit_lightning.distributed.DiTDDPStrategy"]
            if kind != "none":
                args += [f"--trainer.strategy.communication {kind}"]
                if named_rank is not None:
                    args += [f"--trainer.strategy.powersgd_rank {named_rank}"]
        else:  # FSDP1, one unit per DiTBlock and per DiT (model and EMA)
            args += [
                "--trainer.strategy dit_lightning.distributed.DiTFSDPStrategy",
                f"--trainer.strategy.sharding_strategy {best.sharding}",
            ]
            if kind != "none":
                args += [f"--trainer.strategy.reduce_dtype {fsdp_reduce_dtype(kind)}"]
    assumptions = [
        f"utilisation {util:.2f} of the dense {best.precision} peak ({_peak_tflops(spec, best.precision):g} "
        f"TFLOP/s on {spec.name}) applied to executed FLOPs"
        + (
            " (measured, given)"
            if mfu is not None
            else " (assumed default: 0.35 for 16-bit, 0.12 for fp32/TF32; documented DiT-XL/2 runs reach 12-38%)"
        ),
        f"utilisation reached from {SATURATION_TOKENS} tokens per micro-batch, x sqrt(tokens/{SATURATION_TOKENS}) "
        "below; "
        f"{LAUNCH_S * 1e6:g} us per kernel launch floor; AdamW + EMA at 70% of {spec.bandwidth_tbs} TB/s",
    ]
    if nominal:
        assumptions.insert(
            0,
            f"no GPU type: a {budget_gib:g} GiB budget on a nominal {spec.name} (the ranking holds; the step "
            "times are relative, not predictions)",
        )
    if o.device == "cpu" and o.precision is None:
        assumptions.append("CPU: 32-true only (16-bit matmuls are slower than fp32 on most CPUs)")
    if world > 1 and bucket_view:
        assumptions.append("DDP with gradient_as_bucket_view=True (no bucket copy of the gradients)")
    if world > 1:
        c = chosen_time.communication
        assumptions.append(
            f"communication: {c.bytes_sent / 1e9:.2f} GB sent per GPU per step over {c.link} (~{c.link_gbs:g} GB/s "
            f"effective): {c.seconds:.3f} s, {c.exposed_s:.3f} s of it not hidden by the "
            + ("backward pass (DDP overlaps its bucket all-reduces with it)" if c.strategy == "ddp" else "micro-batch")
        )
    return Recommendation(
        model=o.model,
        gpu=None if nominal else spec.name,
        world_size=world,
        global_batch=global_batch,
        feasible=best.fits,
        micro_batch=best.micro_batch,
        accumulate_grad_batches=best.accumulate_grad_batches,
        precision=best.precision,
        checkpointed_blocks=best.checkpointed_blocks,
        depth=depth,
        strategy=best.strategy,
        sharding=best.sharding,
        step_time_s=t,
        images_per_s=global_batch / t,
        assumed_utilisation=util,
        model_flops_utilisation=useful_mfu,
        steps=steps,
        hours=hours,
        gpu_hours=hours * world,
        price_per_gpu_hour=price_per_gpu_hour,
        cost=None if price_per_gpu_hour is None else hours * world * price_per_gpu_hour,
        memory=best_plan,
        lightning_args=args,
        alternatives=[e[0] for e in evaluated[:top]],
        assumptions=assumptions,
        activation_checkpointing=best.activation_checkpointing,
        device=o.device,
        budget_gib=budget_gib,
        nominal_device=nominal,
        communication=chosen_time.communication if world > 1 else None,
        communication_options=options_time,
    )
