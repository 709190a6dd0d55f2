"""The strategies DiT trains with: DDP, FSDP1 and FSDP2, configured for DiT (see docs/distributed.md).

* :class:`DiTDDPStrategy` -- DDP with DiT's settings: ``gradient_as_bucket_view=True``,
  ``find_unused_parameters=False`` (every trainable parameter gets a gradient at every step;
  the fixed ``pos_embed`` and the EMA copy have ``requires_grad=False`` and are not reduced),
  ``static_graph`` only where it is compatible (not with gradient accumulation), and the
  gradient ``communication`` (PyTorch's bf16 / fp16 / PowerSGD comm hooks, :mod:`.communication`;
  PowerSGD's state is saved with every checkpoint and resumes bit for bit).
* :class:`DiTFSDPStrategy` -- Lightning's FSDPStrategy (FSDP1, GPU only in Lightning 2.6)
  wrapping every :class:`~dit_lightning.models.DiTBlock` and each whole DiT (the trained one
  and its EMA) in their own FSDP units, ``use_orig_params=True`` (the frozen ``pos_embed`` sits
  in the same flat parameter as trained weights) and explicit parameter / reduction dtypes.
* :class:`DiTFSDP2Strategy` -- Lightning's ModelParallelStrategy as pure data-parallel FSDP2
  (``fully_shard`` per block, then per DiT, in ``DiTModule.configure_model``: :mod:`.sharding`),
  with an optional hybrid (HSDP) layout and ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``.
  Runs on CPU (gloo) as well as GPU (NCCL).

Activation checkpointing has one knob under every strategy: the model's own
(``model.activation_checkpointing``).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation, rank_zero_warn
from torch import nn

from ..atomic import commit_directory, recover_directory, staging_directory
from ..communication import FSDP_NO_POWERSGD, POWERSGD_WARMUP_STEPS
from ..models import DiT, DiTBlock
from ..precision import DTypeName, optional_dtype
from .communication import PowerSGDCheckpoint, check_backend, check_communication, comm_hook
from .sharding import _dit_children

POWERSGD_KEY = "powersgd"  # the checkpoint's entry: every rank's PowerSGD state
# What the DDP strategy's `communication` is called under FSDP: the CLI adds it to "has no option 'communication'"
_FSDP_HINTS = {"communication": FSDP_NO_POWERSGD}


class DiTDDPStrategy(DDPStrategy):
    """DDP with the settings that matter for DiT, single or multi node (``num_nodes``).

    Args:
        gradient_as_bucket_view: gradients are views into the all-reduce buckets (saves one
            copy of the gradients, ~4 bytes/parameter).
        static_graph: let DDP cache the graph (DiT's graph is static: same parameters every
            step). Lightning + PyTorch crash with ``static_graph=True`` and
            ``accumulate_grad_batches > 1`` (DDP's ``no_sync`` skips the reductions its static
            graph expects), so it is switched off, with a warning, under accumulation.
        find_unused_parameters: keep False: every trainable DiT parameter receives a gradient
            (``pos_embed`` and the EMA are ``requires_grad=False`` and are not reduced at all).
        bucket_cap_mb: DDP bucket size (default 25 MB).
        process_group_backend: "nccl" on GPU, "gloo" on CPU (default: chosen by device).
        communication: how gradients are all-reduced (PyTorch's DDP comm hooks): none (fp32),
            bf16 / fp16 (cast to 16 bits: half the bytes, rounding of the summed gradient),
            powersgd (rank-r approximation of every matrix with error feedback: ~100x fewer bytes),
            or powersgd:R (rank R); the planner's spellings (dit_lightning.communication).
        powersgd_rank: PowerSGD's matrix_approximation_rank (default 4, or the R of powersgd:R).
        powersgd_warmup_steps: optimiser steps of plain all-reduce before PowerSGD starts (PyTorch's
            start_powerSGD_iter; default 1000, at least 2).
    """

    def __init__(
        self,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        bucket_cap_mb: Optional[float] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        communication: str = "none",  # checked by the project's rule (a Literal would answer in jsonargparse's words)
        powersgd_rank: Optional[int] = None,
        powersgd_warmup_steps: Optional[int] = None,
    ) -> None:
        self.communication, self.powersgd_rank = check_communication(
            communication, powersgd_rank, powersgd_warmup_steps
        )
        self.powersgd_warmup_steps = POWERSGD_WARMUP_STEPS if powersgd_warmup_steps is None else powersgd_warmup_steps
        self.powersgd: Optional[PowerSGDCheckpoint] = None  # built with the DDP model (setup)
        self._powersgd_restore: Optional[dict[str, Any]] = None  # this rank's state from a checkpoint
        kwargs: dict[str, Any] = dict(
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
        )
        if bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = bucket_cap_mb
        super().__init__(
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method, **kwargs
        )

    def setup(self, trainer: Any) -> None:
        if self._ddp_kwargs.get("static_graph") and trainer.accumulate_grad_batches > 1:
            rank_zero_warn(
                f"static_graph=True is not compatible with accumulate_grad_batches={trainer.accumulate_grad_batches} "
                "(DDP's no_sync breaks the static graph): training with static_graph=False"
            )
            self._ddp_kwargs["static_graph"] = False
        check_backend(self.communication, self._get_process_group_backend())
        super().setup(trainer)

    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks on CUDA only (a PyTorch 1.8 limit): PyTorch's hooks run on gloo too.
        if self.communication == "none":
            return super()._register_ddp_hooks()
        from torch.nn.parallel import DistributedDataParallel

        assert isinstance(self.model, DistributedDataParallel)
        state: Any
        hook: Any
        if self.communication == "powersgd":
            self.powersgd = PowerSGDCheckpoint(
                self.model.module, rank=self.powersgd_rank, warmup_steps=self.powersgd_warmup_steps
            )
            if self._powersgd_restore is not None:
                self.powersgd.load_state_dict(self._powersgd_restore)
                self._powersgd_restore = None
            state, hook = self.powersgd, PowerSGDCheckpoint.hook
        else:
            state, hook = comm_hook(self.communication)
        _register_ddp_comm_hook(self.model, ddp_comm_state=state, ddp_comm_hook=hook)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """PowerSGD's error feedback is each rank's own: every rank's state goes into rank 0's file
        (a collective: every rank saves, as Lightning's ``Trainer.save_checkpoint`` does)."""
        if self.powersgd is not None:
            own = self.powersgd.state_dict()
            states: list[Any] = [None] * self.world_size
            if self.world_size > 1:
                torch.distributed.gather_object(own, states if self.global_rank == 0 else None, dst=0)
            else:
                states = [own]
            if self.global_rank == 0:
                assert all(s is not None for s in states)
                # P and Q are all-reduced, equal on every rank: kept once
                shared = {k: v for k, v in states[0].items() if k != "error"}
                checkpoint = {**checkpoint, POWERSGD_KEY: {**shared, "error": [s["error"] for s in states]}}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.pop(POWERSGD_KEY, None)
        if self.communication != "powersgd":
            return checkpoint
        if saved is None:
            # no PowerSGD state (another communication, or an older run): PowerSGD's warm-up counts the run's steps
            saved = {"iter": int(checkpoint.get("global_step", 0)), "rng": None}
        errors = saved.get("error") or []
        if errors and len(errors) != self.world_size:
            rank_zero_warn(
                f"the checkpoint's PowerSGD error feedback is of {len(errors)} ranks, this run has {self.world_size}: "
                "starting it from zero (the run continues, not bit for bit)"
            )
        own = {
            **saved,
            "error": errors[self.global_rank] if len(errors) == self.world_size else {},
            "p": saved.get("p", {}),
            "q": saved.get("q", {}),
            "rank": saved.get("rank", self.powersgd_rank),
        }
        if self.powersgd is not None:  # hooks already registered (a restore after setup)
            self.powersgd.load_state_dict(own)
        else:
            self._powersgd_restore = own
        return checkpoint


ShardingName = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]


def dit_wrap_policy() -> Any:
    """FSDP1 auto-wrap policy: one unit per DiTBlock and one per whole DiT.

    Wrapping each DiT (not only its blocks) keeps the trained network and its EMA in separate
    flat parameters with identical layouts, so the EMA update is a lerp of local shards.
    """
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return ModuleWrapPolicy({DiTBlock, DiT})


class DiTFSDPStrategy(FSDPStrategy):
    """FSDP1 for DiT (GPU only in Lightning 2.6.6; use :class:`DiTFSDP2Strategy` on CPU).

    Args:
        sharding_strategy: FULL_SHARD (ZeRO-3: parameters, gradients and optimiser state
            sharded), SHARD_GRAD_OP (ZeRO-2: parameters stay gathered between forward and
            backward), HYBRID_SHARD (full shard inside a node, replicate across nodes),
            _HYBRID_SHARD_ZERO2, NO_SHARD (like DDP).
        activation_checkpointing: deprecated: activation checkpointing has one knob, the model's
            (``model.activation_checkpointing: all``, or selected blocks), which works under FSDP1
            too. ``True`` still recomputes every block, through that knob, with a warning.
        state_dict_type: "sharded" (a checkpoint directory, one file per rank, fast; turn it
            into one file with ``dit-lightning consolidate``) or "full" (one file gathered on
            rank 0).
        param_dtype: FSDP mixed precision: the dtype of the gathered parameters, i.e. of the
            compute (e.g. bfloat16). Default: the Lightning precision plugin decides.
        reduce_dtype: the dtype of the gradient reduction (e.g. float32); default: param_dtype.
        cpu_offload: keep sharded parameters and gradients in host memory.
    """

    unknown_option_hints = _FSDP_HINTS  # the CLI's fix for --trainer.strategy.communication

    def __init__(
        self,
        sharding_strategy: ShardingName = "FULL_SHARD",
        activation_checkpointing: bool = False,
        state_dict_type: Literal["full", "sharded"] = "sharded",
        param_dtype: Optional[DTypeName] = None,
        reduce_dtype: Optional[DTypeName] = None,
        cpu_offload: bool = False,
        limit_all_gathers: bool = True,
        forward_prefetch: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        mixed = None
        if param_dtype is not None or reduce_dtype is not None:
            from torch.distributed.fsdp import MixedPrecision

            pd = optional_dtype(param_dtype)
            mixed = MixedPrecision(param_dtype=pd, reduce_dtype=optional_dtype(reduce_dtype) or pd, buffer_dtype=pd)
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout,
            cpu_offload=cpu_offload,
            mixed_precision=mixed,
            auto_wrap_policy=dit_wrap_policy(),
            # Lightning's annotation omits "_HYBRID_SHARD_ZERO2", which it accepts (ShardingStrategy[name]).
            sharding_strategy=sharding_strategy,  # type: ignore[arg-type]
            state_dict_type=state_dict_type,
            # pos_embed (frozen) shares a flat parameter with trained weights: FSDP1 accepts
            # mixed requires_grad only with use_orig_params=True.
            use_orig_params=True,
            limit_all_gathers=limit_all_gathers,
            forward_prefetch=forward_prefetch,
        )
        self._dit_activation_checkpointing = activation_checkpointing

    def setup(self, trainer: Any) -> None:
        lm = self.lightning_module
        if self._dit_activation_checkpointing and lm is not None:
            rank_zero_deprecation(
                "DiTFSDPStrategy(activation_checkpointing=True) is deprecated: set model.activation_checkpointing: all "
                "(the one activation-checkpointing knob, which also selects blocks). Recomputing every block now."
            )
            for _, net in _dit_children(lm):
                net.set_activation_checkpointing("all")
        super().setup(trainer)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        wrapped = super()._setup_model(model)
        from types import MethodType

        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # FSDP1 forwards attribute lookups to the wrapped DiT, so ``unit.forward_with_cfg``
        # would call the inner, unwrapped forward on sharded weights: bind it to the unit.
        for unit in FSDP.fsdp_modules(wrapped):
            if isinstance(unit.module, DiT):
                # torch types module attributes as Tensor | Module; any object can be set.
                unit.forward_with_cfg = MethodType(DiT.forward_with_cfg, unit)  # type: ignore[assignment]
        return wrapped


class DiTFSDP2Strategy(ModelParallelStrategy):
    """FSDP2 data parallelism for DiT through Lightning's ModelParallelStrategy (CPU or GPU).

    Every DiTBlock, then each whole DiT (the trained network and the EMA), becomes an FSDP2
    unit (``fully_shard``) in ``DiTModule.configure_model``. Parameters are DTensors sharded
    along dim 0 over the data-parallel ranks; gradients are reduce-scattered; the optimiser
    state and the EMA exist only as shards.

    Args:
        data_parallel_size: ranks that share the data; "auto" = all ranks (unlike the plain
            ModelParallelStrategy, whose "auto" is the number of nodes: DiT has no tensor
            parallel plan, so every rank is a data-parallel rank).
        param_dtype: dtype of the gathered parameters, i.e. of the forward/backward compute
            (``bfloat16`` with ``precision: 32-true`` is FSDP2's native mixed precision:
            fp32 master shards, bf16 all-gathers and matmuls).
        reduce_dtype: dtype of the gradient reduce-scatter (``float32`` keeps full-precision
            gradient averaging under bf16 compute).
        reshard_after_forward: free gathered block parameters after the forward (ZeRO-3);
            False keeps them until the backward (ZeRO-2 like, SHARD_GRAD_OP: more memory,
            one all-gather per step less).
        hybrid_shard_size: HSDP: shard within groups of this many ranks (e.g. the GPUs of a
            node) and replicate across groups; None shards over all ranks.
        sync_module_states: broadcast rank 0's initial weights before sharding (as DDP
            does), so ranks built with different seeds still train one model.
        save_distributed_checkpoint: True saves a sharded checkpoint directory
            (torch.distributed.checkpoint; ``dit-lightning consolidate`` makes one file);
            False gathers a single-file checkpoint on rank 0.
    """

    unknown_option_hints = _FSDP_HINTS  # the CLI's fix for --trainer.strategy.communication

    def __init__(
        self,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        param_dtype: Optional[DTypeName] = None,
        reduce_dtype: Optional[DTypeName] = "float32",
        reshard_after_forward: bool = True,
        hybrid_shard_size: Optional[int] = None,
        sync_module_states: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.fsdp_options = dict(
            param_dtype=optional_dtype(param_dtype),
            reduce_dtype=optional_dtype(reduce_dtype),
            reshard_after_forward=reshard_after_forward,
            hybrid_shard_size=hybrid_shard_size,
            sync_module_states=sync_module_states,
        )

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """A sharded checkpoint directory is written beside its target and renamed into place, so a
        kill during the save (a signal's grace period running out, pre-emption) leaves the previous
        checkpoint whole: Lightning writes the shards over the old ones in place."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        if self.global_rank == 0:
            recover_directory(path)  # a save killed between its two renames left the previous checkpoint beside
        # one staging directory, made and named by rank 0, into which every rank writes its shards
        staging = Path(self.broadcast(str(staging_directory(path)) if self.global_rank == 0 else ""))
        super().save_checkpoint(checkpoint, staging, storage_options)
        self.barrier("dit_sharded_save_written")
        if self.global_rank == 0:
            commit_directory(staging, path)  # the previous checkpoint is moved aside, deleted once this one is in place
        self.barrier("dit_sharded_save_done")
