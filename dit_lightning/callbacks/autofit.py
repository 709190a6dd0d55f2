"""Auto-fit in a Lightning run: apply the planner's setting before the first step, and recover from
out-of-memory errors by redoing the step with a safer setting (:mod:`dit_lightning.autofit` decides).

:class:`AutoFit` is the callback (``dit-lightning fit --auto_fit true`` adds it; in Python, put it in
``Trainer(callbacks=[AutoFit(memory_gib=...)])`` with a :class:`~dit_lightning.data.LatentDataModule`).

**How a step is redone.** With recovery on, the run trains in *step mode*: the data module hands
each rank its whole share of an optimiser step (global batch / devices samples: the Trainer's
``accumulate_grad_batches`` is 1), and the callback puts the setting in force on the module
(``DiTModule.micro_batch_size``) and hands it the back-off (``DiTModule.out_of_memory_handler``). The
step itself is the module's own (``DiTModule.training_step``, the one training step of every run):
it splits the batch into micro-batches, runs their forward and backward passes, and when one raises
an out-of-memory error, nothing has changed yet but the gradients: they are dropped, the failed
pass's memory is freed, this callback moves the setting to the next safer one, and the module
splits the same samples again and redoes the step. Lightning then reduces the gradients through
the strategy, clips, steps the optimiser and the schedule, and the module updates the EMA, exactly
as in a run without auto-fit. The step counter, the samples, their keyed timesteps / noise / label
dropout (keyed on the step and the sample index, not on the split), the optimiser state, the EMA
and the learning-rate schedule are those of the step that failed, so the trajectory is that of a
run started with the safer setting, up to float reassociation.

Under DDP every micro-batch's backward pass keeps its gradients local (``no_sync``); after the last
one, one collective tells every rank whether any rank ran out of memory (so they all back off
together, to the same setting, and none waits in a reduction another rank never joins), and only
then does DDP all-reduce the gradients, through its own buckets. (This gives up DDP's overlap of
the all-reduce with the backward pass, and reads one flag per step on the host; on one device
neither happens.) FSDP shards its gradients inside the backward pass, so recovery is not available
there (the choice at start is).

The setting in force, the number of back-offs and what happened are the callback's state in every
checkpoint; a resumed run starts with the setting that worked. Loop counters are written in the
units a plain run with that setting would use, so a checkpoint of a step-mode run resumes without
auto-fit too (with the recorded setting).
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional, Union, cast

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

from ..autofit import (
    AutoFitConfig,
    Decision,
    FitProblem,
    NothingFits,
    Setting,
    cuda_budget,
    decide,
    device_gpu_spec,
    next_faster,
    next_safer,
)
from ..models import DiTShape, model_config
from ..planner.memory import CUDA_CONTEXT_BYTES, NCCL_BYTES, GiB
from ..precision import lightning_precision, to_dtype

if TYPE_CHECKING:
    from ..module import DiTModule


def _say(trainer: Optional[L.Trainer], text: str) -> None:
    """Print on global rank 0 (plain lines: they belong in batch logs too)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", 0)  # Lightning sets it from the environment at import
    if trainer.is_global_zero if trainer is not None else rank == 0:
        print(text, flush=True)


# ---- the run as the planner sees it -----------------------------------------------------------------


def strategy_layout(strategy: Any, world_size: int) -> dict[str, Any]:
    """The planner's view of a Lightning strategy (an instance or a name): ddp or fsdp, sharding,
    hybrid group, whether DDP keeps a bucket copy of the gradients, FSDP2's compute dtype."""
    out: dict[str, Any] = {"strategy": "ddp", "sharding": "FULL_SHARD", "shard_group": None}
    out["ddp_gradient_as_bucket_view"] = False
    if isinstance(strategy, FSDPStrategy):
        out["strategy"] = "fsdp"
        name = getattr(strategy.sharding_strategy, "name", str(strategy.sharding_strategy))
        out["sharding"] = "SHARD_GRAD_OP" if "GRAD_OP" in name or "ZERO2" in name else "FULL_SHARD"
    elif isinstance(strategy, ModelParallelStrategy):
        options = getattr(strategy, "fsdp_options", {})
        out["strategy"] = "fsdp"
        out["sharding"] = "FULL_SHARD" if options.get("reshard_after_forward", True) else "SHARD_GRAD_OP"
        out["shard_group"] = options.get("hybrid_shard_size")
        if options.get("param_dtype") is not None:
            out["precision"] = lightning_precision(options["param_dtype"])
    elif isinstance(strategy, DDPStrategy):
        out["ddp_gradient_as_bucket_view"] = bool(strategy._ddp_kwargs.get("gradient_as_bucket_view", False))
    elif isinstance(strategy, str) and "fsdp" in strategy.lower():
        out["strategy"] = "fsdp"
    return out


def build_problem(
    module: L.LightningModule,
    global_batch: int,
    world_size: int,
    device: str,
    strategy: Any,
    pins: dict[str, Any],
    budget: Optional[int] = None,
    source: str = "",
    gpu_index: Optional[int] = None,
) -> FitProblem:
    """A :class:`FitProblem` for a DiTModule: its network, the run's layout and the user's pins
    (``pins``: ``precision``, ``accumulate_grad_batches``, ``activation_checkpointing``)."""
    net = getattr(module, "model", None)
    if net is None or not hasattr(net, "blocks"):
        raise ValueError("auto-fit plans a DiT: the LightningModule needs the DiT as `.model` (DiTModule does)")
    shape = DiTShape.of(net)
    if shape.attn_dim not in (None, shape.hidden_size):
        raise ValueError("auto-fit: the planner does not model head-pruned DiTs (attn_dim); set the levers by hand")
    layout = strategy_layout(strategy, world_size)
    hparams = getattr(module, "hparams", {})
    precision = pins.get("precision")
    if precision is not None:
        try:  # any spelling ("bf16", 16, "bf16-true"...) in the planner's names
            precision = lightning_precision(to_dtype(precision))
        except ValueError:
            raise ValueError(
                f"auto-fit plans 32-true, 16-mixed or bf16-mixed training, not precision {precision!r}"
            ) from None
    if "precision" in layout:  # FSDP2 computes in param_dtype whatever trainer.precision says
        precision = layout.pop("precision")
    gpu, bf16 = (None, True)
    if device == "cuda" and torch.cuda.is_available():
        gpu, bf16 = device_gpu_spec(gpu_index or 0)
    optimizer = "adamw"
    factory = getattr(module, "optimizer_factory", None)
    if factory is not None:
        from ..optimizers import factory_class

        if factory_class(factory) is torch.optim.SGD:
            optimizer = "sgd"
    return FitProblem(
        shape=dict(
            latent_size=shape.input_size,
            depth=shape.depth,
            hidden_size=shape.hidden_size,
            num_heads=shape.num_heads,
            patch_size=shape.patch_size,
            in_channels=shape.in_channels,
            num_classes=shape.num_classes,
            learn_sigma=shape.learn_sigma,
            mlp_ratio=shape.mlp_ratio,
            qk_norm=model_config(net)["qk_norm"],
            norm=shape.norm,
            mlp=shape.mlp,
            pos_embed=shape.pos_embed,
            wo_shift=shape.wo_shift,
            class_token_dim=shape.class_token_dim,  # REG's class token: one more token per block
        ),
        global_batch=int(global_batch),
        world_size=int(world_size),
        device="cuda" if device == "cuda" else "cpu",
        budget_bytes=budget,
        budget_source=source,
        gpu=gpu,
        bf16=bf16,
        model_name=str(hparams.get("model", "DiT")) if hparams.get("model") != "custom" else "custom DiT",
        optimizer=optimizer,  # type: ignore[arg-type]
        ema=getattr(module, "ema", None) is not None,
        attention="math" if hparams.get("attention_backend") == "math" else "auto",
        precision=precision,
        accumulate_grad_batches=pins.get("accumulate_grad_batches"),
        activation_checkpointing=pins.get("activation_checkpointing"),
        **layout,
    )


def step_mode_obstacle(strategy: Any, module: L.LightningModule) -> Optional[str]:
    """Why out-of-memory recovery cannot run with this strategy and module (None: it can)."""
    from ..module import DiTModule

    if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)) or (
        isinstance(strategy, str) and "fsdp" in strategy.lower()
    ):
        return "FSDP reduces its sharded gradients inside the backward pass, so a rank cannot drop a failed step alone"
    if isinstance(strategy, str) and strategy.lower().startswith("deepspeed"):
        return "DeepSpeed runs its own optimiser step"
    if type(strategy).__name__.startswith("DeepSpeed"):
        return "DeepSpeed runs its own optimiser step"
    if isinstance(strategy, DDPStrategy) and strategy._ddp_kwargs.get("static_graph"):
        return "DDP's static_graph expects its own gradient reduction every step (set static_graph false)"
    if not isinstance(module, DiTModule) or type(module).training_step is not DiTModule.training_step:
        return f"{type(module).__name__} has its own training_step (auto-fit redoes DiTModule's)"
    return None


def _budget_of(config: AutoFitConfig, device: str, gpu_index: int) -> tuple[int, str]:
    if config.memory_gib is not None:
        return int(config.memory_gib * GiB), f"--auto_fit.memory_gib {config.memory_gib:g}"
    if device != "cuda":
        raise ValueError(
            f"--auto_fit on {device}: there is no free-memory reading to fit into; give the budget per device with "
            "--auto_fit.memory_gib (e.g. --auto_fit.memory_gib 8)"
        )
    return cuda_budget(gpu_index, config.margin_gib)


def recorded_setting(checkpoint: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The auto-fit state a checkpoint holds (None: it was not trained with auto-fit)."""
    state = (checkpoint.get("callbacks") or {}).get(AutoFit.__qualname__)
    return state if isinstance(state, dict) and "setting" in state else None


# ---- the callback -------------------------------------------------------------------------------------


class MemoryProbe:
    """The measured peak of a device in the planner's terms (comparable with ``FitProblem.peak``):
    on CUDA the caching allocator's peak reservation plus the context (and NCCL) the planner counts."""

    def __init__(self, device: torch.device, world_size: int = 1) -> None:
        self.device, self.world_size = device, world_size

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        extra = CUDA_CONTEXT_BYTES + (NCCL_BYTES if self.world_size > 1 else 0)
        return int(torch.cuda.max_memory_reserved(self.device)) + extra


class AutoFit(L.Callback):
    """Fit the run to the memory it has at start, and back off instead of dying on out-of-memory.

    The arguments are :class:`~dit_lightning.autofit.AutoFitConfig`'s (``--auto_fit.*``). Without the
    CLI, the decision is made in ``setup`` with the Trainer's precision; explicit settings are then the
    Trainer's ``accumulate_grad_batches`` when it is not 1 and the model's ``activation_checkpointing``
    when it is set.
    """

    def __init__(
        self,
        enabled: bool = True,
        memory_gib: Optional[float] = None,
        margin_gib: float = 1.0,
        oom_recovery: Optional[bool] = None,
        max_backoffs: int = 4,
        backoff_reduction: float = 0.05,
        speed_up_after: Optional[int] = None,
        speed_up_below: float = 0.7,
    ) -> None:
        self.config = AutoFitConfig(
            enabled,
            memory_gib,
            margin_gib,
            oom_recovery,
            max_backoffs,
            backoff_reduction,
            speed_up_after,
            speed_up_below,
        )
        self.decision: Optional[Decision] = None  # set by the CLI before the Trainer exists, else made in setup
        self.problem: Optional[FitProblem] = None
        self.pins: Optional[dict[str, Any]] = None  # the user's explicit settings (CLI); None: read in setup
        self.setting: Optional[Setting] = None  # in force
        self.backoffs = 0
        self.history: list[dict[str, Any]] = []
        self.probe: Optional[Any] = None  # .reset() / .peak() -> bytes; CUDA's by default
        self.step_mode = False
        self._speed: dict[str, Any] = {"done": False, "trial": None}
        self._since_change = 0
        self._loaded: Optional[dict[str, Any]] = None
        self._configured_accumulation: Optional[int] = None  # recovery without auto-fit: the run's own split
        self._between_steps = False

    @classmethod
    def from_config(cls, config: AutoFitConfig) -> AutoFit:
        return cls(**{f: getattr(config, f) for f in config.__dataclass_fields__})

    @property
    def recovery_description(self) -> str:
        if not self.step_mode:
            return "out-of-memory recovery: off"
        return (
            f"out-of-memory recovery: on (up to {self.config.max_backoffs} back-offs: more recomputed blocks, then "
            "half the micro-batch with twice the accumulation; the step is redone)"
        )

    # ---- set-up -----------------------------------------------------------------------------------
    def _device(self, trainer: L.Trainer) -> tuple[str, int]:
        root = trainer.strategy.root_device
        return ("cuda" if root.type == "cuda" else root.type), (root.index or 0)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        module = cast("DiTModule", pl_module)
        dm = getattr(trainer, "datamodule", None)
        device, index = self._device(trainer)
        configured_accumulation = int(self._configured_accumulation or trainer.accumulate_grad_batches)
        if self.pins is None:  # without the CLI: what the Trainer and the model were given
            self.pins = {"precision": _precision_name(trainer)}
            if configured_accumulation != 1:
                self.pins["accumulate_grad_batches"] = configured_accumulation
            if module.hparams.get("activation_checkpointing") is not None:
                self.pins["activation_checkpointing"] = module.hparams.get("activation_checkpointing")
        global_batch = getattr(dm, "global_batch_size", None)
        if global_batch is None:
            raise ValueError(
                "auto-fit needs the global batch: train with dit_lightning.data.LatentDataModule "
                "(data.global_batch_size)"
            )
        obstacle = step_mode_obstacle(trainer.strategy, module)
        if obstacle and self.config.oom_recovery:
            raise ValueError(f"--auto_fit.oom_recovery true cannot run here: {obstacle}")
        self.step_mode = self.config.recovery and obstacle is None
        if obstacle and self.config.recovery:
            _say(trainer, f"auto-fit: out-of-memory recovery is off: {obstacle}")

        # the budget: every rank reads its own device; all take the smallest
        problem = self.problem
        budget, source = (None, "")
        if self.config.enabled or self.config.speed_up_after:
            budget, source = _budget_of(self.config, device, index)
            if trainer.world_size > 1 and self.config.memory_gib is None:
                agreed = int(
                    trainer.strategy.reduce(
                        torch.tensor(float(budget), dtype=torch.float64, device=trainer.strategy.root_device),
                        reduce_op="min",
                    ).item()
                )
                if agreed < budget:
                    source += f"; the smallest of {trainer.world_size} ranks"
                budget = agreed
        if problem is None or problem.world_size != trainer.world_size or problem.global_batch != global_batch:
            problem = build_problem(
                module, global_batch, trainer.world_size, device, trainer.strategy, self.pins, budget, source, index
            )
        elif budget is not None and budget != problem.budget_bytes:
            # read again on every rank now that each holds its device: all decide from the same (smallest) budget
            problem = problem.with_budget(budget, source)
        self.problem = problem

        if self.config.enabled:
            before = self.decision
            if before is None or before.problem is not problem:
                if problem.precision is None:
                    problem.precision = _precision_name(trainer)  # the Trainer exists: its precision stays
                self.decision = decide(problem)
                if before is not None and before.resumed_from_step is not None:
                    self.decision.chosen, self.decision.resumed_from_step = before.chosen, before.resumed_from_step
                if before is None or before.chosen != self.decision.chosen:
                    _say(trainer, self.decision.table(self.recovery_description))
            assert self.decision is not None
            setting = self.decision.chosen
        else:
            setting = problem.setting(
                problem.precision or _precision_name(trainer),
                problem.per_device // configured_accumulation,
                module.hparams.get("activation_checkpointing") or 0,
            )
        self._check_precision(trainer, setting)
        self._agree(trainer, setting)
        self._apply(trainer, module, setting, initial=True)

    def _check_precision(self, trainer: L.Trainer, setting: Setting) -> None:
        if isinstance(trainer.strategy, ModelParallelStrategy):
            return  # FSDP2: the compute dtype is the strategy's
        if to_dtype(trainer.precision) != to_dtype(setting.precision):
            raise RuntimeError(
                f"auto-fit chose {setting.precision}, but the Trainer was built with {trainer.precision}: build the "
                "Trainer with the chosen precision (the CLI does), or set trainer.precision"
            )

    def _agree(self, trainer: L.Trainer, setting: Setting) -> None:
        """Every rank decides from the same inputs; make sure they did (a hash, min = max)."""
        if trainer.world_size <= 1:
            return
        code = float(zlib.crc32(setting.short().encode()) % (2**24))  # str hashes differ between processes
        t = torch.tensor(code, device=trainer.strategy.root_device)
        lo = trainer.strategy.reduce(t.clone(), reduce_op="min")
        hi = trainer.strategy.reduce(t.clone(), reduce_op="max")
        if float(lo) != float(hi):
            raise RuntimeError(
                "auto-fit: the ranks chose different settings (their devices differ?): give one budget to all with "
                "--auto_fit.memory_gib"
            )

    def _apply(self, trainer: L.Trainer, module: Any, setting: Setting, initial: bool = False) -> None:
        """Put ``setting`` in force: the model's recomputed blocks, the split of the step."""
        assert self.problem is not None
        spec = self.problem._checkpoint_arg(setting)
        module.model.set_activation_checkpointing(spec)
        module.hparams["activation_checkpointing"] = spec if not isinstance(spec, tuple) else list(spec)
        if self.step_mode:  # the module's step splits each batch by the setting in force
            module.micro_batch_size = setting.micro_batch
        self.setting = setting
        self._since_change = 0
        if self.probe is not None:
            self.probe.reset()
        if not initial:
            return
        dm = getattr(trainer, "datamodule", None)
        accumulation = 1 if self.step_mode else setting.accumulate_grad_batches
        if trainer.accumulate_grad_batches != accumulation:
            trainer.accumulate_grad_batches = accumulation
            if dm is not None and hasattr(dm, "setup"):
                dm.setup("fit")  # the per-rank batch follows the accumulation
        if self.step_mode:
            module.out_of_memory_handler = functools.partial(self._back_off, trainer, module)
            if dm is not None and getattr(dm, "val_batch_size", 0) is None:
                dm.val_batch_size = setting.micro_batch  # validation keeps the planned micro-batch
        if self.probe is None and trainer.strategy.root_device.type == "cuda":
            self.probe = MemoryProbe(trainer.strategy.root_device, trainer.world_size)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._loaded is not None:
            self._restore(trainer, pl_module)
        if self.config.speed_up_after and (self.probe is None or not self.step_mode):
            _say(
                trainer,
                "auto-fit: speed up when safe is off: it needs out-of-memory recovery and a memory reading (CUDA)",
            )
        if self.decision is not None and self.setting is not None:
            hparams = {**self.decision.hparams(), "auto_fit/oom_recovery": self.step_mode}
            hparams.update(
                {
                    "auto_fit/micro_batch": self.setting.micro_batch,
                    "auto_fit/accumulate_grad_batches": self.setting.accumulate_grad_batches,
                    "auto_fit/activation_checkpointing": self.setting.activation_checkpointing,
                }
            )
            for logger in trainer.loggers:
                logger.log_hyperparams(hparams)
        if self.probe is not None:
            self.probe.reset()

    def _restore(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Put the checkpoint's setting back in force (the one that worked), if it applies to this run."""
        state, self._loaded = self._loaded, None
        assert state is not None and self.problem is not None
        self.backoffs = int(state.get("backoffs", 0))
        self.history = list(state.get("history", []))
        self._speed = dict(state.get("speed_up", {"done": False, "trial": None}))
        recorded = Setting.from_dict(state["setting"])
        if recorded == self.setting:
            return
        p = self.problem
        pins = p.pinned
        usable = (
            recorded.micro_batch * recorded.accumulate_grad_batches == p.per_device
            and to_dtype(recorded.precision) == to_dtype(_precision_name(trainer))
            and pins.get("trainer.accumulate_grad_batches") in (None, recorded.accumulate_grad_batches)
            and (self.step_mode or recorded.accumulate_grad_batches == trainer.accumulate_grad_batches)
        )
        if pins.get("model.activation_checkpointing") is not None:
            usable = (
                usable
                and p.setting(recorded.precision, recorded.micro_batch, pins["model.activation_checkpointing"])
                == recorded
            )
        if not usable:
            _say(
                trainer,
                f"auto-fit: the checkpoint's setting ({recorded.short()}) does not apply to this run; keeping "
                f"{self.setting.short() if self.setting else 'the configured one'}",
            )
            return
        self._apply(trainer, module, recorded)
        _say(trainer, f"auto-fit: resumed with the checkpoint's setting: {recorded.label(trainer.world_size)}")

    # ---- after each step ------------------------------------------------------------------------
    def _log_setting(self, module: Any) -> None:
        s = self.setting
        assert s is not None
        for name, value in (
            ("backoffs", self.backoffs),
            ("micro_batch", s.micro_batch),
            ("accumulate_grad_batches", s.accumulate_grad_batches),
            ("checkpointed_blocks", s.checkpointed_blocks),
        ):
            module.log(f"auto_fit/{name}", float(value), on_step=True, on_epoch=False, batch_size=1)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.setting is None or not (self.step_mode or self.config.enabled):
            return
        self._log_setting(pl_module)
        if self.step_mode:
            self._after_step(trainer, pl_module)

    # ---- back off, speed up, give up -------------------------------------------------------------
    def _back_off(self, trainer: L.Trainer, module: Any, failure: str, step: int) -> None:
        assert self.problem is not None and self.setting is not None
        current = self.setting
        trial = self._speed.get("trial")
        if trial is not None:  # the faster setting being tried did not fit: back to the one that did
            safer: Optional[Setting] = Setting.from_dict(trial)
            self._speed = {"done": True, "trial": None}
            what = "the faster setting being tried ran out of memory"
        else:
            exhausted = self.backoffs >= self.config.max_backoffs
            safer = None if exhausted else next_safer(self.problem, current, self.config.backoff_reduction)
            if safer is None:
                self._give_up(trainer, current, failure, step, exhausted)
            self.backoffs += 1
            what = f"back-off {self.backoffs} of {self.config.max_backoffs}"
        assert safer is not None
        self.history.append(
            {"step": step, "from": current.to_dict(), "to": safer.to_dict(), "error": failure, "kind": what}
        )
        _say(
            trainer,
            f"auto-fit: out of memory at global step {step} ({failure}); {what}: {current.short()} "
            f"({_gib(self.problem.peak(current))} predicted) -> {safer.short()} ({_gib(self.problem.peak(safer))}); "
            f"redoing step {step}",
        )
        self._apply(trainer, module, safer)

    def _give_up(self, trainer: L.Trainer, current: Setting, failure: str, step: int, exhausted: bool) -> None:
        assert self.problem is not None
        self._between_steps = True  # the dropped attempt left nothing: save as of the end of the last step
        try:
            path = save_last_completed(trainer)
        finally:
            self._between_steps = False
        if exhausted:
            why = f"it has backed off {self.config.max_backoffs} times (--auto_fit.max_backoffs)"
            fix = "raise --auto_fit.max_backoffs, free memory on the device or use a larger one"
        else:
            kept = [k for k in self.problem.pinned if k != "trainer.precision"]
            why = "no safer setting is left" + (f" with {', '.join(kept)} kept as given" if kept else "")
            fix = (f"leave {', '.join(kept)} to auto-fit, " if kept else "") + "free memory or use a larger device"
        raise RuntimeError(
            f"auto-fit: out of memory at global step {step} ({failure}) with {current.label(trainer.world_size)}, "
            f"and {why}. The state after the {step} completed steps is saved in {path}: nothing is lost. To go on, "
            f"{fix}, and resume with --ckpt_path {path} (or `last`)"
        )

    def _after_step(self, trainer: L.Trainer, module: Any) -> None:
        self._since_change += 1
        after = self.config.speed_up_after
        if not after or self._speed.get("done") or self.probe is None or self.problem is None:
            return
        assert self.setting is not None
        capacity = self.problem.budget_bytes
        if capacity is None:
            return
        measured = float(self.probe.peak())
        if trainer.world_size > 1:
            measured = float(
                trainer.strategy.reduce(
                    torch.tensor(measured, dtype=torch.float64, device=trainer.strategy.root_device), reduce_op="max"
                )
            )
        trial = self._speed.get("trial")
        if trial is not None:
            if measured > capacity:
                back = Setting.from_dict(trial)
                self._speed = {"done": True, "trial": None}
                _say(
                    trainer, f"auto-fit: speed-up peaked at {_gib(measured)} > {_gib(capacity)}: back to {back.short()}"
                )
                self._apply(trainer, module, back)
            elif self._since_change >= after:
                self._speed = {"done": True, "trial": None}
                _say(trainer, f"auto-fit: speed-up kept: {self.setting.short()} peaked at {_gib(measured)}")
            return
        if self._since_change < after or measured >= self.config.speed_up_below * capacity:
            return
        faster = next_faster(self.problem, self.setting, int(capacity), int(measured))
        if faster is None:
            self._speed = {"done": True, "trial": None}
            return
        self._speed = {"done": False, "trial": self.setting.to_dict()}
        self.history.append(
            {"step": trainer.global_step, "from": self.setting.to_dict(), "to": faster.to_dict(), "kind": "speed-up"}
        )
        _say(
            trainer,
            f"auto-fit: step {trainer.global_step} peaked at {_gib(measured)} of {_gib(capacity)}: trying "
            f"{faster.short()} for {after} steps",
        )
        self._apply(trainer, module, faster)

    # ---- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.setting is None:
            return {}
        return {
            "setting": self.setting.to_dict(),
            "backoffs": self.backoffs,
            "history": list(self.history),
            "speed_up": dict(self._speed),
            "loop_accumulation": self.setting.accumulate_grad_batches,
            "step_mode": self.step_mode,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("setting"):
            self._loaded = dict(state_dict)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        loops = (checkpoint.get("loops") or {}).get("fit_loop")
        if not loops or not self.step_mode or self.setting is None:
            return
        if self._between_steps:
            # saved inside a step whose attempt was dropped: the batch counts as not begun (Lightning then
            # resumes with it, and counts the steps that were logged as they were)
            progress = loops["epoch_loop.batch_progress"]
            for part in ("current", "total"):
                progress[part]["ready"] = progress[part]["started"] = progress[part]["completed"]
                progress[part]["processed"] = progress[part]["completed"]
        # A step-mode batch is an optimiser step: write the counters a plain run with this setting keeps.
        _rescale_batches(loops, 1, self.setting.accumulate_grad_batches)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        loops = (checkpoint.get("loops") or {}).get("fit_loop")
        if not loops:
            return
        state = recorded_setting(checkpoint)
        saved = state.get("loop_accumulation") if state else _accumulation_of_data_state(loops, self.problem)
        target = 1 if self.step_mode else int(trainer.accumulate_grad_batches)
        if saved:
            _rescale_batches(loops, int(saved), target)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and self.step_mode:  # the module trains as configured again (e.g. a later fit)
            module = cast(Any, pl_module)
            module.micro_batch_size = module.out_of_memory_handler = None


# ---- helpers ------------------------------------------------------------------------------------------


def _precision_name(trainer: L.Trainer) -> str:
    """The Trainer's precision in the planner's names (32-true, 16-mixed, bf16-mixed)."""
    return lightning_precision(to_dtype(str(trainer.precision)))


def _gib(n: Union[int, float]) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 4 else f"{n / 1024**2:.2f} MiB"


def _counts(progress: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    for part in ("current", "total"):
        for field in ("ready", "started", "processed", "completed"):
            if field in progress.get(part, {}):
                yield progress[part], field


def _rescale_batches(loops: dict[str, Any], from_accumulation: int, to_accumulation: int) -> None:
    """Express the epoch's batch counters in batches of another accumulation: an optimiser step is
    ``accumulation`` batches of a plain run and one batch in step mode (counts before this epoch
    are left as they are)."""
    if from_accumulation == to_accumulation:
        return
    progress = loops.get("epoch_loop.batch_progress")
    if not progress:
        return
    current = dict(progress["current"])
    for holder, field in _counts(progress):
        if holder is progress["current"]:
            holder[field] = holder[field] // from_accumulation * to_accumulation
    for field in ("ready", "started", "processed", "completed"):
        if field in progress.get("total", {}):
            progress["total"][field] += progress["current"][field] - current[field]


def _accumulation_of_data_state(loops: dict[str, Any], problem: Optional[FitProblem]) -> Optional[int]:
    """The accumulation of a checkpoint without auto-fit's record, from its data loader state."""
    states = (loops.get("state_dict") or {}).get("combined_loader") or []
    state = states[0] if states else None
    if not isinstance(state, dict) or problem is None or not state.get("micro_batch_size"):
        return None
    per_step = int(state["micro_batch_size"]) * int(state.get("num_replicas", 1))
    return problem.global_batch // per_step if problem.global_batch % per_step == 0 else None


def save_last_completed(trainer: L.Trainer) -> str:
    """Save the state of the last completed step (between steps, or after a dropped attempt) where
    ``--ckpt_path last`` finds it: the run's ``last.ckpt`` (else a file in the run directory)."""
    checkpoints = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]  # type: ignore[attr-defined]
    target = next((c for c in checkpoints if c.dirpath), None)
    if target is not None and target.dirpath:
        name = "last.ckpt" if target.save_last else f"auto-fit-step-{trainer.global_step}.ckpt"
        path = os.path.join(target.dirpath, name)
    else:
        path = os.path.join(trainer.log_dir or trainer.default_root_dir, f"auto-fit-step-{trainer.global_step}.ckpt")
    trainer.save_checkpoint(path, weights_only=False)
    if target is not None and target.save_last:
        target.last_model_path = path
        refresh = getattr(target, "_refresh_link", None)
        if callable(refresh):
            refresh(trainer)
    return path


# ---- the CLI ----------------------------------------------------------------------------------------


def _device_kind(accelerator: Any) -> str:
    name = str(
        getattr(accelerator, "__class__", type(None)).__name__ if not isinstance(accelerator, str) else accelerator
    )
    name = name.lower()
    if name in ("gpu", "cuda") or "cuda" in name:
        return "cuda"
    if name == "auto" or name == "none":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available() else "cpu"
    return "mps" if "mps" in name else "cpu"


def _world_size(trainer_config: dict[str, Any], device: str) -> int:
    devices = trainer_config.get("devices", "auto")
    count = torch.cuda.device_count() if device == "cuda" else 1
    if isinstance(devices, (list, tuple)):
        n = len(devices)
    elif isinstance(devices, int):
        n = count if devices == -1 else devices
    else:
        text = str(devices).strip()
        n = count if text in ("auto", "-1") else (len(text.split(",")) if "," in text else int(text))
    return max(1, n) * int(trainer_config.get("num_nodes") or 1)


def _local_device_index(trainer_config: dict[str, Any]) -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    devices = trainer_config.get("devices")
    if isinstance(devices, (list, tuple)) and len(devices) > local_rank:
        return int(devices[local_rank])
    return local_rank


def _read_record(ckpt_path: Optional[str]) -> tuple[Optional[dict[str, Any]], int]:
    """The auto-fit setting a resumed checkpoint (a file or a sharded directory) recorded, and its step;
    (None, 0) when there is none or it cannot be read."""
    from ..checkpoints import read_training_state

    if not ckpt_path:
        return None, 0
    try:
        state = read_training_state(ckpt_path)
    except Exception:  # a fresh decision then; the run itself reports a checkpoint it cannot load
        return None, 0
    return recorded_setting(state.meta), state.step


def prepare_cli_fit(
    config: AutoFitConfig,
    model: L.LightningModule,
    datamodule: Any,
    trainer_config: dict[str, Any],
    explicit: dict[str, Any],
    ckpt_path: Optional[str] = None,
) -> tuple[AutoFit, dict[str, Any]]:
    """What ``dit-lightning fit --auto_fit ...`` does before the Trainer is built: read the memory,
    decide (or take the setting a resumed checkpoint recorded), print the table, and return the
    callback and the Trainer arguments it sets (``precision`` unless given, ``accumulate_grad_batches``).

    ``explicit``: the settings given in the configs or on the command line (``precision``,
    ``accumulate_grad_batches``, ``activation_checkpointing``), which are kept.
    """
    device = _device_kind(trainer_config.get("accelerator", "auto"))
    world = _world_size(trainer_config, device)
    strategy = trainer_config.get("strategy", "auto")
    pins = {k: v for k, v in explicit.items() if v is not None}
    callback = AutoFit.from_config(config)
    callback.pins = pins
    obstacle = step_mode_obstacle(strategy, model)
    if obstacle and config.oom_recovery:
        raise ValueError(f"--auto_fit.oom_recovery true cannot run here: {obstacle}")
    step_mode = config.recovery and obstacle is None
    callback.step_mode = step_mode
    global_batch = getattr(datamodule, "global_batch_size", None)
    if global_batch is None:
        raise ValueError("--auto_fit needs the global batch: data.global_batch_size of LatentDataModule")
    kwargs: dict[str, Any] = {}
    configured = int(trainer_config.get("accumulate_grad_batches") or 1)
    if config.enabled:
        index = _local_device_index(trainer_config)
        budget, source = _budget_of(config, device, index)
        problem = build_problem(model, global_batch, world, device, strategy, pins, budget, source, index)
        decision: Optional[Decision] = None
        record, step = _read_record(ckpt_path)
        if record is not None:
            recorded = Setting.from_dict(record["setting"])
            fits_run = recorded.micro_batch * recorded.accumulate_grad_batches == problem.per_device and all(
                pins.get(k) in (None, v)
                for k, v in (
                    ("precision", recorded.precision),
                    ("accumulate_grad_batches", recorded.accumulate_grad_batches),
                )
            )
            if fits_run:
                decision = Decision(problem, recorded, None, True, [recorded], resumed_from_step=step)
        if decision is None:
            decision = decide(problem)
        callback.problem, callback.decision = problem, decision
        if obstacle and config.recovery:
            _say(None, f"auto-fit: out-of-memory recovery is off: {obstacle}")
        _say(None, decision.table(callback.recovery_description))
        if "precision" not in pins and not isinstance(strategy, ModelParallelStrategy):
            kwargs["precision"] = decision.chosen.precision
        accumulation = decision.chosen.accumulate_grad_batches
    else:
        accumulation = configured
        if "accumulate_grad_batches" not in pins and configured != 1:
            pins["accumulate_grad_batches"] = configured
    kwargs["accumulate_grad_batches"] = 1 if step_mode else accumulation
    callback._configured_accumulation = accumulation
    return callback, kwargs


__all__ = [
    "AutoFit",
    "MemoryProbe",
    "NothingFits",
    "build_problem",
    "prepare_cli_fit",
    "save_last_completed",
    "step_mode_obstacle",
]
