"""Auto-fit: the fastest setting that fits the memory a run really has, and the safer settings to
back off to when a step runs out of memory anyway. The decisions only (library layer: no
Lightning); :mod:`dit_lightning.callbacks.autofit` applies them to a Trainer.

A *setting* is what auto-fit may choose per device: the micro-batch (and with it the gradient
accumulation, since micro-batch x devices x accumulation stays the configured global batch), how
many blocks recompute their activations, and the precision (only before training starts). A
:class:`FitProblem` holds everything the planner needs about the run (the network, the global
batch, the devices, the strategy, the memory budget per device) and what the user set
explicitly, which auto-fit never changes.

* :func:`decide`: the planner's fastest setting that fits (:func:`~dit_lightning.planner.recommend`),
  its runner-up and the table the CLI prints; :class:`NothingFits` (a ``ValueError``) with the
  smallest memory found and the levers that would close the gap when nothing does.
* :func:`next_safer`: the setting to back off to after an out-of-memory error: more recomputed
  blocks first, then half the micro-batch with twice the accumulation, each time predicted to
  need at least ``backoff_reduction`` less memory than the setting that failed.
* :func:`next_faster`: the one step toward a faster setting that "speed up when safe" tries.
* :func:`cuda_budget`, :func:`device_gpu_spec`: reading the device (what counts as out of memory, and
  freeing a failed pass's memory: :mod:`dit_lightning.device_memory`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union, cast

import torch

from .planner.hardware import GPUSpec, spec_for_device_name
from .planner.memory import (
    CUDA_CONTEXT_BYTES,
    AttentionKind,
    DeviceKind,
    GiB,
    MemoryPlan,
    MiB,
    OptimizerName,
    PlanOptions,
    Sharding,
    Strategy,
    checkpointed_block_indices,
    plan_memory,
)
from .planner.recommend import Recommendation, checkpoint_spelling, estimate_step_time, nominal_spec, recommend
from .precision import best_mixed_precision, lightning_precision

CheckpointPin = Union[int, str, list[int], tuple[int, ...]]


@dataclass
class AutoFitConfig:
    """``--auto_fit``: ``true``, or these options (``--auto_fit.memory_gib 6``...).

    Args:
        enabled: choose the micro-batch (and accumulation), the recomputed blocks and, if unset, the
            precision before training, from the memory each device really has. Settings given
            explicitly are kept.
        memory_gib: the memory budget per device in GiB: needed on CPU; on CUDA it replaces the free
            memory read from the device (e.g. to leave room for another job).
        margin_gib: kept free on CUDA below the free memory read at start (other processes, allocator
            spikes the planner does not model).
        oom_recovery: back off and redo the step when a training step runs out of memory (default:
            on with ``enabled``; ``true`` turns it on without choosing a setting at start).
        max_backoffs: back-offs allowed in a run; one more out-of-memory error stops it (with a
            checkpoint of the last completed step).
        backoff_reduction: each back-off chooses a setting predicted to need at least this fraction
            less memory than the one that failed.
        speed_up_after: "speed up when safe" (off by default): after this many steps without a
            change, if the measured peak stays below ``speed_up_below`` of the capacity, try the next
            faster setting once, and keep it only if the next as many steps stay below the capacity.
        speed_up_below: the fraction of the capacity under which the measured peak counts as far below.
    """

    enabled: bool = True
    memory_gib: Optional[float] = None
    margin_gib: float = 1.0
    oom_recovery: Optional[bool] = None
    max_backoffs: int = 4
    backoff_reduction: float = 0.05
    speed_up_after: Optional[int] = None
    speed_up_below: float = 0.7

    def __post_init__(self) -> None:
        if self.memory_gib is not None and self.memory_gib <= 0:
            raise ValueError(f"--auto_fit.memory_gib must be > 0, got {self.memory_gib}")
        if self.margin_gib < 0 or self.max_backoffs < 0:
            raise ValueError("--auto_fit.margin_gib and --auto_fit.max_backoffs must be >= 0")
        if not 0 < self.backoff_reduction < 1 or not 0 < self.speed_up_below < 1:
            raise ValueError("--auto_fit.backoff_reduction and --auto_fit.speed_up_below must be in (0, 1)")
        if self.speed_up_after is not None and self.speed_up_after < 1:
            raise ValueError(f"--auto_fit.speed_up_after must be >= 1 steps, got {self.speed_up_after}")

    @property
    def recovery(self) -> bool:
        """Whether out-of-memory recovery is on."""
        return self.enabled if self.oom_recovery is None else bool(self.oom_recovery)

    @classmethod
    def of(cls, value: Union[None, bool, dict, AutoFitConfig]) -> Optional[AutoFitConfig]:
        """The configuration of a ``--auto_fit`` value (None when auto-fit and recovery are both off)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        config = value if isinstance(value, AutoFitConfig) else cls(**dict(value))
        return config if (config.enabled or config.recovery) else None


@dataclass(frozen=True)
class Setting:
    """What auto-fit chooses per device."""

    precision: str
    micro_batch: int
    accumulate_grad_batches: int
    activation_checkpointing: str  # the model's spelling: none, first:N, all (or the user's own)
    checkpointed_blocks: int

    def label(self, world_size: int = 1) -> str:
        devices = f"{world_size} devices" if world_size > 1 else "1 device"
        return (
            f"micro-batch {self.micro_batch} x {devices} x {self.accumulate_grad_batches} accumulation, "
            f"recompute {self.activation_checkpointing} ({self.checkpointed_blocks} blocks), {self.precision}"
        )

    def short(self) -> str:
        return (
            f"{self.micro_batch}x{self.accumulate_grad_batches} recompute {self.activation_checkpointing} "
            f"{self.precision}"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Setting:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


# ---- the problem -----------------------------------------------------------------------------------


@dataclass
class FitProblem:
    """A run as the planner sees it, and what its user pinned.

    ``shape`` holds the network's :class:`~dit_lightning.planner.memory.PlanOptions` fields, as
    :func:`~dit_lightning.callbacks.autofit.build_problem` reads them off the DiT (``latent_size``,
    ``depth``, ``hidden_size``, ``num_heads``, ``patch_size``...). ``precision``,
    ``accumulate_grad_batches`` and ``activation_checkpointing`` are the user's explicit settings
    (None: auto-fit chooses). :meth:`options` is the run as the planner's options.
    """

    shape: dict[str, Any]
    global_batch: int
    world_size: int = 1
    device: DeviceKind = "cuda"
    budget_bytes: Optional[int] = None
    budget_source: str = ""
    gpu: Optional[GPUSpec] = None  # for the time model; None: a nominal device (relative times)
    bf16: bool = True  # the device computes in bf16 (when auto-fit chooses the precision)
    model_name: str = "custom"  # for messages
    strategy: Strategy = "ddp"
    sharding: Sharding = "FULL_SHARD"
    shard_group: Optional[int] = None
    ddp_gradient_as_bucket_view: bool = False
    optimizer: OptimizerName = "adamw"
    fused_optimizer: Optional[bool] = None
    ema: bool = True
    attention: AttentionKind = "auto"
    precision: Optional[str] = None
    accumulate_grad_batches: Optional[int] = None
    activation_checkpointing: Optional[CheckpointPin] = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.global_batch % self.world_size:
            raise ValueError(
                f"global_batch_size {self.global_batch} is not divisible by {self.world_size} devices: choose a "
                f"multiple of {self.world_size}"
            )
        if self.accumulate_grad_batches is not None and self.per_device % self.accumulate_grad_batches:
            raise ValueError(
                f"global_batch_size {self.global_batch} is not divisible by {self.world_size} device(s) x "
                f"{self.accumulate_grad_batches} accumulation steps"
            )

    @property
    def per_device(self) -> int:
        return self.global_batch // self.world_size

    @property
    def depth(self) -> int:
        return int(self.shape["depth"])

    @property
    def pinned(self) -> dict[str, Any]:
        """The explicit settings auto-fit keeps, by option name."""
        out: dict[str, Any] = {}
        if self.precision is not None:
            out["trainer.precision"] = self.precision
        if self.accumulate_grad_batches is not None:
            out["trainer.accumulate_grad_batches"] = self.accumulate_grad_batches
        if self.activation_checkpointing is not None:
            out["model.activation_checkpointing"] = self.activation_checkpointing
        return out

    def with_budget(self, budget_bytes: int, source: str) -> FitProblem:
        return dataclasses.replace(self, budget_bytes=int(budget_bytes), budget_source=source, _cache={})

    def unpinned(self) -> FitProblem:
        return dataclasses.replace(
            self, precision=None, accumulate_grad_batches=None, activation_checkpointing=None, _cache={}
        )

    # ---- settings and their predictions ------------------------------------------------------------
    def setting(self, precision: str, micro_batch: int, checkpointing: Union[int, CheckpointPin]) -> Setting:
        """A setting at this global batch: recompute the first N blocks (an int) or the model's spelling."""
        if self.per_device % micro_batch:
            raise ValueError(f"micro-batch {micro_batch} does not divide the per-device batch {self.per_device}")
        if isinstance(checkpointing, int) and not isinstance(checkpointing, bool):
            spelling, blocks = checkpoint_spelling(checkpointing, self.depth), checkpointing
        else:
            blocks = len(checkpointed_block_indices(checkpointing, self.depth))
            listed = cast(Sequence[int], checkpointing)
            spelling = checkpointing if isinstance(checkpointing, str) else "blocks " + ",".join(map(str, listed))
        return Setting(precision, micro_batch, self.per_device // micro_batch, str(spelling), blocks)

    def _checkpoint_arg(self, s: Setting) -> Any:
        """What the planner reads for a setting's recomputed blocks: the user's own pin as given
        (a number, a spelling or a list of blocks), else the setting's spelling."""
        pin = self.activation_checkpointing
        if pin is not None:
            return list(pin) if isinstance(pin, (list, tuple)) else pin
        if s.activation_checkpointing.startswith("blocks "):  # a list of blocks, spelled for display
            return [int(i) for i in s.activation_checkpointing.removeprefix("blocks ").split(",") if i]
        return s.activation_checkpointing

    def options(self, s: Optional[Setting] = None) -> PlanOptions:
        """The run as the planner's options: the user's pins (what :func:`recommend` keeps), or with
        ``s`` that setting's micro-batch, accumulation, precision and recomputed blocks."""
        pin = self.activation_checkpointing
        o = PlanOptions(
            model="custom",
            **self.shape,
            world_size=self.world_size,
            strategy=self.strategy,
            sharding=self.sharding,
            shard_group=self.shard_group,
            ddp_gradient_as_bucket_view=self.ddp_gradient_as_bucket_view,
            optimizer=self.optimizer,
            fused_optimizer=self.fused_optimizer,
            ema=self.ema,
            attention=self.attention,
            device=self.device,
            precision=None if self.precision is None else lightning_precision(self.precision),
            accumulate_grad_batches=self.accumulate_grad_batches,
            activation_checkpointing=list(pin) if isinstance(pin, tuple) else pin,
        )
        if s is None:
            return o
        return o.replace(
            micro_batch=s.micro_batch,
            accumulate_grad_batches=s.accumulate_grad_batches,
            precision=lightning_precision(s.precision),
            activation_checkpointing=self._checkpoint_arg(s),
        )

    def plan(self, s: Setting) -> MemoryPlan:
        key = ("plan", s)
        if key not in self._cache:
            budget_gib = None if self.budget_bytes is None else self.budget_bytes / GiB
            self._cache[key] = plan_memory(self.options(s), memory_gib=budget_gib)
        return self._cache[key]

    def peak(self, s: Setting) -> int:
        """Predicted bytes per device (what the budget is compared with)."""
        return self.plan(s).total

    def fits(self, s: Setting, budget: Optional[int] = None) -> bool:
        limit = self.budget_bytes if budget is None else budget
        return limit is None or self.peak(s) <= limit

    @property
    def time_spec(self) -> GPUSpec:
        if self.gpu is not None:
            return self.gpu
        gib = (self.budget_bytes or GiB) / GiB
        return nominal_spec(gib, self.device, bf16=self.bf16)

    def step_time(self, s: Setting) -> float:
        """Estimated seconds per optimiser step (relative only on a nominal device)."""
        key = ("time", s)
        if key not in self._cache:
            self._cache[key], _, _ = estimate_step_time(self.options(s), self.time_spec, self.global_batch)
        return self._cache[key]

    def micro_batches(self) -> list[int]:
        """The micro-batches auto-fit may use, largest first."""
        if self.accumulate_grad_batches is not None:
            return [self.per_device // self.accumulate_grad_batches]
        return [d for d in range(self.per_device, 0, -1) if self.per_device % d == 0]

    def checkpoint_options(self) -> list[Any]:
        """The recomputed-block settings auto-fit may use, fewest first."""
        if self.activation_checkpointing is not None:
            return [self.activation_checkpointing]
        return list(range(self.depth + 1))


# ---- reading the device ----------------------------------------------------------------------------


def cuda_budget(index: int, margin_gib: float) -> tuple[int, str]:
    """(bytes per device the planner may fill, how they were read) for CUDA device ``index``:
    the free memory (``torch.cuda.mem_get_info``), plus what this process already holds that the
    planner counts itself (the CUDA context; memory its caching allocator reserved), minus the margin."""
    free, total = torch.cuda.mem_get_info(index)
    reserved = torch.cuda.memory_reserved(index)
    budget = free + reserved + CUDA_CONTEXT_BYTES - int(margin_gib * GiB)
    source = (
        f"cuda:{index} has {free / GiB:.1f} of {total / GiB:.1f} GiB free; + the {CUDA_CONTEXT_BYTES // MiB} MiB "
        f"CUDA context the planner counts itself, - the {margin_gib:g} GiB margin (--auto_fit.margin_gib)"
    )
    return budget, source


def device_gpu_spec(index: int) -> tuple[Optional[GPUSpec], bool]:
    """(the GPU table's entry for CUDA device ``index`` or None, whether it computes in bf16)."""
    spec = spec_for_device_name(torch.cuda.get_device_name(index))
    return spec, (spec.supports_bf16 if spec is not None else bool(torch.cuda.is_bf16_supported()))


# ---- the decision ----------------------------------------------------------------------------------


@dataclass
class Decision:
    """The chosen setting, its runner-up and how they were found."""

    problem: FitProblem
    chosen: Setting
    runner_up: Optional[Setting]
    feasible: bool
    ranking: list[
        Setting
    ]  # every setting evaluated (the fewest recomputed blocks that fit per micro-batch), fastest first
    resumed_from_step: Optional[int] = None  # the setting came from a checkpoint's record

    def row(self, s: Setting) -> tuple[str, ...]:
        p = self.problem
        t0 = p.step_time(self.chosen)
        return (
            f"{s.micro_batch} x {p.world_size} x {s.accumulate_grad_batches}",
            f"{s.activation_checkpointing} ({s.checkpointed_blocks}/{p.depth})",
            s.precision,
            _size(p.peak(s)),
            f"{p.step_time(s):.3f} s" if p.gpu is not None else f"{p.step_time(s) / t0:.2f}x",
        )

    def table(self, recovery: Optional[str] = None) -> str:
        """The table the CLI prints: chosen setting, predicted peak, runner-up, budget, kept settings."""
        p = self.problem
        head = ("", "micro x devices x accum", "recomputed blocks", "precision", "predicted peak", "step time")
        rows = [("chosen", *self.row(self.chosen))]
        if self.runner_up is not None:
            rows.append(("runner-up", *self.row(self.runner_up)))
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        budget = _size(p.budget_bytes) if p.budget_bytes is not None else "no budget"
        lines = [
            f"auto-fit: {p.model_name} ({p.depth} blocks) on {p.world_size} {p.device} device(s), global batch "
            f"{p.global_batch}; budget {budget} per device ({p.budget_source})",
        ]
        if self.resumed_from_step is not None:
            lines.append(
                f"  resuming with the setting in force at step {self.resumed_from_step} (the checkpoint's record)"
            )
        lines += ["  " + fmt.format(*head).rstrip()] + ["  " + fmt.format(*r).rstrip() for r in rows]
        if p.pinned:
            lines.append("  kept as given: " + ", ".join(f"{k}={v}" for k, v in p.pinned.items()))
        if p.gpu is None:
            lines.append("  step times relative to the chosen setting (no GPU type: a nominal device)")
        if recovery:
            lines.append(f"  {recovery}")
        return "\n".join(lines)

    def hparams(self) -> dict[str, Any]:
        """Flat hyper-parameters for the loggers."""
        p, s = self.problem, self.chosen
        out: dict[str, Any] = {
            "auto_fit/micro_batch": s.micro_batch,
            "auto_fit/accumulate_grad_batches": s.accumulate_grad_batches,
            "auto_fit/activation_checkpointing": s.activation_checkpointing,
            "auto_fit/precision": s.precision,
            "auto_fit/predicted_peak_gib": round(p.peak(s) / GiB, 4),
            "auto_fit/budget_gib": None if p.budget_bytes is None else round(p.budget_bytes / GiB, 4),
            "auto_fit/budget_source": p.budget_source,
            "auto_fit/kept": ", ".join(f"{k}={v}" for k, v in p.pinned.items()) or "none",
        }
        if self.runner_up is not None:
            out["auto_fit/runner_up"] = self.runner_up.short()
            out["auto_fit/runner_up_peak_gib"] = round(p.peak(self.runner_up) / GiB, 4)
        return out


def _size(n: Optional[int]) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.2f} GiB" if n >= GiB // 4 else f"{n / MiB:.2f} MiB"


class NothingFits(ValueError):
    """No setting fits the budget: raised before any step, with the smallest memory found and the levers."""


def _recommend(problem: FitProblem) -> Recommendation:
    return recommend(
        problem.options(),  # the pins pinned, the rest searched
        gpu=problem.time_spec,
        global_batch=problem.global_batch,
        memory_gib=None if problem.budget_bytes is None else problem.budget_bytes / GiB,
        top=10_000,
    )


def decide(problem: FitProblem) -> Decision:
    """The planner's fastest setting that fits ``problem``'s budget (keeping its pins) and the
    runner-up; raises :class:`NothingFits` (with the levers) when none does."""
    if problem.budget_bytes is None:
        raise ValueError("auto-fit needs a memory budget per device (--auto_fit.memory_gib on CPU)")
    rec = _recommend(problem)
    pin = problem.activation_checkpointing
    ranking = []
    for c in rec.alternatives:
        ranking.append(problem.setting(c.precision, c.micro_batch, pin if pin is not None else c.checkpointed_blocks))
    if not rec.feasible:
        raise NothingFits(nothing_fits_message(problem, ranking))
    chosen = problem.setting(rec.precision, rec.micro_batch, pin if pin is not None else rec.checkpointed_blocks)
    runner_up = next((s for s in ranking if s != chosen and problem.fits(s)), None)
    return Decision(problem, chosen, runner_up, True, ranking)


def nothing_fits_message(problem: FitProblem, ranking: list[Setting]) -> str:
    """What needs how much, and which levers would close the gap."""
    p = problem
    smallest = min(ranking, key=p.peak)
    need, budget = p.peak(smallest), p.budget_bytes or 0
    plan = p.plan(smallest)
    lines = [
        f"auto-fit: nothing fits. {p.model_name} ({p.depth} blocks) at global batch {p.global_batch} on "
        f"{p.world_size} {p.device} device(s) needs at least {_size(need)} per device ({smallest.label(p.world_size)}; "
        f"{_size(plan.static)} of it weights, gradients, optimiser states and EMA), and the budget is "
        f"{_size(budget)} ({p.budget_source}). No step was run.",
        f"The {_size(need - budget)} gap, and the smallest memory per device with each lever (* closes it):",
    ]
    levers: list[str] = []

    def smallest_of(q: FitProblem) -> int:
        opts = q.checkpoint_options()
        return min(q.peak(q.setting(prec, m, opts[-1])) for prec in _precisions(q) for m in q.micro_batches()[-1:])

    if p.pinned:
        free = smallest_of(p.unpinned())
        if free < need:
            levers.append(f"leave {', '.join(p.pinned)} to auto-fit: {_size(free)}" + _fits(free, budget))
    if p.ema:
        q = dataclasses.replace(p, ema=False, _cache={})
        levers.append(f"no EMA (--model.ema false): {_size(smallest_of(q))}" + _fits(smallest_of(q), budget))
    if p.device == "cuda" and (p.precision == "32-true"):
        q = dataclasses.replace(p, precision=best_mixed_precision(p.bf16), _cache={})
        levers.append(f"--trainer.precision {q.precision}: {_size(smallest_of(q))}" + _fits(smallest_of(q), budget))
    if p.world_size > 1 and p.strategy == "ddp":
        q = dataclasses.replace(p, strategy="fsdp", sharding="FULL_SHARD", _cache={})
        levers.append(
            "FSDP full sharding over the same devices (--trainer.strategy dit_lightning.distributed.DiTFSDPStrategy, "
            f"or DiTFSDP2Strategy): {_size(smallest_of(q))}" + _fits(smallest_of(q), budget)
        )
    elif p.strategy == "ddp":
        for n in (2, 4, 8):
            if p.global_batch % n:
                continue
            q = dataclasses.replace(p, world_size=n, strategy="fsdp", sharding="FULL_SHARD", _cache={})
            if smallest_of(q) <= budget:
                levers.append(
                    f"{n} devices with FSDP full sharding (each holds 1/{n} of the state): {_size(smallest_of(q))} *"
                )
                break
    margin = " plus the margin" if p.device == "cuda" else ""
    levers.append(f"a device with {_size(need)} free for the run{margin} *, or a smaller model")
    lines += [f"  - {lever}" for lever in levers]
    return "\n".join(lines)


def _fits(n: int, budget: int) -> str:
    return " *" if n <= budget else ""


def _precisions(p: FitProblem) -> list[str]:
    if p.precision is not None:
        return [p.precision]
    if p.device == "cpu":
        return ["32-true"]
    return [best_mixed_precision(p.bf16)]


# ---- back off, speed up ----------------------------------------------------------------------------


def next_safer(problem: FitProblem, current: Setting, reduction: float = 0.05) -> Optional[Setting]:
    """The setting to redo a step with after ``current`` ran out of memory: predicted to need at
    least ``reduction`` less memory. More recomputed blocks at the same micro-batch first (the
    fewest that achieve it), then half the micro-batch with twice the accumulation (with the
    fewest recomputed blocks that achieve it), and so on. Precision and explicit settings stay.
    None when no such setting is left."""
    target = problem.peak(current) * (1.0 - reduction)
    if problem.activation_checkpointing is None:
        for k in range(current.checkpointed_blocks + 1, problem.depth + 1):
            s = problem.setting(current.precision, current.micro_batch, k)
            if problem.peak(s) <= target:
                return s
    if problem.accumulate_grad_batches is None:
        for m in (d for d in problem.micro_batches() if d <= current.micro_batch // 2):
            for k in problem.checkpoint_options():
                s = problem.setting(current.precision, m, k)
                if problem.peak(s) <= target:
                    return s
    return None


def next_faster(problem: FitProblem, current: Setting, capacity: int, measured: int) -> Optional[Setting]:
    """The fastest setting (same precision, explicit settings kept) that is faster than ``current``
    and whose predicted peak, scaled by how the measured peak of ``current`` compares with its
    prediction, stays within ``capacity``; None if there is none."""
    scale = measured / max(1, problem.peak(current))
    t0 = problem.step_time(current)
    best: Optional[Setting] = None
    for m in problem.micro_batches():
        for k in problem.checkpoint_options():
            s = problem.setting(current.precision, m, k)
            if problem.peak(s) * scale > capacity:
                continue
            if problem.step_time(s) < t0 * 0.99 and (best is None or problem.step_time(s) < problem.step_time(best)):
                best = s
            break  # more recomputed blocks at this micro-batch: only slower
    return best
