"""Distributed training of DiT: DDP, FSDP (FSDP1) and FSDP2, a sharded EMA, consolidation.

Strategies (see docs/distributed.md for which to pick):

* :class:`DiTDDPStrategy` -- DDP with DiT's settings: ``gradient_as_bucket_view=True``,
  ``find_unused_parameters=False`` (every trainable parameter gets a gradient at every step;
  the fixed ``pos_embed`` and the EMA copy have ``requires_grad=False`` and are not reduced),
  and ``static_graph`` only where it is compatible (not with gradient accumulation).
* :class:`DiTFSDPStrategy` -- Lightning's FSDPStrategy (FSDP1, GPU only in Lightning 2.6)
  wrapping every :class:`~dit_lightning.models.DiTBlock` and each whole DiT (the trained one
  and its EMA) in their own FSDP units, ``use_orig_params=True`` (the frozen ``pos_embed`` sits
  in the same flat parameter as trained weights), optional activation checkpointing per block
  and explicit parameter / reduction dtypes.
* :class:`DiTFSDP2Strategy` -- Lightning's ModelParallelStrategy as pure data-parallel FSDP2
  (``fully_shard`` per block, then per DiT, in ``DiTModule.configure_model``), with an optional
  hybrid (HSDP) layout and ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``. Runs on CPU
  (gloo) as well as GPU (NCCL).

The EMA is sharded exactly like the model (it is a second DiT with the same FSDP units), so
:func:`ema_update_` lerps local shards into local shards: no gathering, no extra memory. It is
saved in (sharded) checkpoints with the model and gathered only by :func:`consolidate` (a
sharded checkpoint directory -> a single-file ``{model, ema, opt, args}`` reference checkpoint)
or :func:`gather_dit` (a collective that returns a plain, unsharded DiT).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from .models import DiT, DiTBlock
from .models.flops import DiTShape, dit_params, shape_of

log = logging.getLogger(__name__)

DTypeName = Literal["float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _dtype(name: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower().replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of float32, bfloat16, float16") from None


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _dit_children(module: nn.Module) -> list[tuple[str, DiT]]:
    """The DiT networks held by a LightningModule (``model``, ``ema``...), outermost only."""
    found: list[tuple[str, DiT]] = []
    for name, m in module.named_modules():
        if isinstance(m, DiT) and not any(name.startswith(f"{n}.") for n, _ in found):
            found.append((name, m))
    return found


# ======================================================================================
# DDP
# ======================================================================================


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
    ) -> None:
        kwargs: dict[str, Any] = dict(
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
        )
        if bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = bucket_cap_mb
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, start_method=start_method, **kwargs)

    def setup(self, trainer: Any) -> None:
        if self._ddp_kwargs.get("static_graph") and trainer.accumulate_grad_batches > 1:
            rank_zero_warn(
                f"static_graph=True is not compatible with accumulate_grad_batches={trainer.accumulate_grad_batches} "
                "(DDP's no_sync breaks the static graph): training with static_graph=False"
            )
            self._ddp_kwargs["static_graph"] = False
        super().setup(trainer)


# ======================================================================================
# FSDP1 (Lightning's FSDPStrategy, GPU only in Lightning 2.6)
# ======================================================================================

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
        activation_checkpointing: recompute every DiTBlock in the backward pass (FSDP's
            ``activation_checkpointing_policy={DiTBlock}``); replaces the model's own
            ``activation_checkpointing`` setting (which also works under FSDP).
        state_dict_type: "sharded" (a checkpoint directory, one file per rank, fast; turn it
            into one file with ``dit-lightning consolidate``) or "full" (one file gathered on
            rank 0).
        param_dtype, reduce_dtype: FSDP mixed precision (e.g. bfloat16 compute, float32
            gradient reduction). Default: the Lightning precision plugin decides.
        cpu_offload: keep sharded parameters and gradients in host memory.
    """

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

            pd = _dtype(param_dtype)
            mixed = MixedPrecision(param_dtype=pd, reduce_dtype=_dtype(reduce_dtype) or pd, buffer_dtype=pd)
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout,
            cpu_offload=cpu_offload,
            mixed_precision=mixed,
            auto_wrap_policy=dit_wrap_policy(),
            activation_checkpointing_policy={DiTBlock} if activation_checkpointing else None,
            sharding_strategy=sharding_strategy,
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
            for name, net in _dit_children(lm):
                if net.checkpoint_blocks:
                    rank_zero_warn(
                        f"{name}: the strategy checkpoints every DiTBlock; ignoring the model's "
                        f"activation_checkpointing (blocks {list(net.checkpoint_blocks)})"
                    )
                    net.set_activation_checkpointing(None)
        super().setup(trainer)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        wrapped = super()._setup_model(model)
        from types import MethodType

        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # FSDP1 forwards attribute lookups to the wrapped DiT, so ``unit.forward_with_cfg``
        # would call the inner, unwrapped forward on sharded weights: bind it to the unit.
        for unit in FSDP.fsdp_modules(wrapped):
            if isinstance(unit.module, DiT):
                unit.forward_with_cfg = MethodType(DiT.forward_with_cfg, unit)
        return wrapped


# ======================================================================================
# FSDP2 (ModelParallelStrategy + fully_shard)
# ======================================================================================


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
            param_dtype=_dtype(param_dtype),
            reduce_dtype=_dtype(reduce_dtype),
            reshard_after_forward=reshard_after_forward,
            hybrid_shard_size=hybrid_shard_size,
            sync_module_states=sync_module_states,
        )

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


def _broadcast_from_rank0(module: nn.Module, device: torch.device) -> None:
    tensors = [t.data for t in list(module.parameters()) + list(module.buffers())]
    if not tensors or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    module.to(device)
    for t in [t.data for t in list(module.parameters()) + list(module.buffers())]:
        dist.broadcast(t, src=0)


def _fsdp2_mesh(mesh: Any, hybrid_shard_size: Optional[int], device: torch.device) -> Any:
    if not hybrid_shard_size:
        return mesh
    from torch.distributed.device_mesh import init_device_mesh

    world = mesh.size()
    if world % hybrid_shard_size:
        raise ValueError(f"hybrid_shard_size={hybrid_shard_size} does not divide the {world} data-parallel ranks")
    return init_device_mesh(device.type, (world // hybrid_shard_size, hybrid_shard_size), mesh_dim_names=("replicate", "shard"))


def shard_dit(
    net: DiT,
    mesh: Any = None,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    reshard_after_forward: bool = True,
    root_reshard_after_forward: Optional[bool] = None,
) -> DiT:
    """``fully_shard`` every block, then the whole DiT (in place; returns ``net``).

    The root unit holds the embedders, ``pos_embed`` and the final layer. ``forward_with_cfg``
    is registered as an FSDP forward method so classifier-free-guided sampling gathers the
    root parameters too.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    block_kwargs: dict[str, Any] = {"mesh": mesh}
    root_kwargs: dict[str, Any] = {"mesh": mesh}
    if param_dtype is not None or reduce_dtype is not None:
        block_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        # The network returns float32 (the loss is computed in fp32); inside, the blocks pass
        # activations in the compute dtype.
        low = param_dtype not in (None, torch.float32)
        root_kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=torch.float32 if low else None
        )
    for block in net.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **block_kwargs)
    root = reshard_after_forward if root_reshard_after_forward is None else root_reshard_after_forward
    fully_shard(net, reshard_after_forward=root, **root_kwargs)
    register_fsdp_forward_method(net, "forward_with_cfg")
    return net


def is_fsdp2(module: nn.Module) -> bool:
    """True if any parameter of ``module`` is a DTensor (it was ``fully_shard``-ed)."""
    return any(_is_dtensor(p) for p in module.parameters())


def is_sharded(module: nn.Module) -> bool:
    """True under FSDP2 (DTensor parameters) or FSDP1 (FSDP units): a forward, ``sample`` or
    :func:`full_state_dict` is then a collective that every rank must run."""
    return is_fsdp2(module) or bool(_fsdp1_units(module))


def configure_sharding(pl_module: Any) -> bool:
    """Apply FSDP2 to a DiTModule when its trainer uses a ModelParallelStrategy (called from
    ``DiTModule.configure_model``; idempotent). Returns True if the module is sharded."""
    trainer = getattr(pl_module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None)
    if not isinstance(strategy, ModelParallelStrategy):
        return False
    if is_fsdp2(pl_module):
        return True
    mesh = strategy.device_mesh
    if mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"DiT has no tensor-parallel plan, but the ModelParallelStrategy has tensor_parallel_size="
            f"{mesh['tensor_parallel'].size()} (its 'auto' default on one node): use "
            "dit_lightning.distributed.DiTFSDP2Strategy, or ModelParallelStrategy(data_parallel_size=<world size>, "
            "tensor_parallel_size=1)"
        )
    opts = dict(getattr(strategy, "fsdp_options", {}))
    device = strategy.root_device
    dp_mesh = _fsdp2_mesh(mesh["data_parallel"], opts.pop("hybrid_shard_size", None), device)
    sync = opts.pop("sync_module_states", True)
    after_forward = opts.get("reshard_after_forward", True)
    for name, net in _dit_children(pl_module):
        if sync:
            _broadcast_from_rank0(net, device)
        trained = any(p.requires_grad for p in net.parameters())
        # The trained network's root unit is needed again at the start of the backward: keep
        # it gathered (FSDP2's recommendation). Frozen copies (the EMA) always reshard.
        shard_dit(
            net,
            dp_mesh,
            param_dtype=opts.get("param_dtype"),
            reduce_dtype=opts.get("reduce_dtype"),
            reshard_after_forward=after_forward if trained else True,
            root_reshard_after_forward=not trained,
        )
    n = sum(p.numel() for p in pl_module.parameters())
    local = sum((p.to_local() if _is_dtensor(p) else p).numel() for p in pl_module.parameters())
    rank_zero_info(f"FSDP2: sharded {n:,} parameter elements over {dp_mesh.size()} ranks ({local:,} on rank 0)")
    return True


# ======================================================================================
# EMA, gradient norm, clipping under sharding
# ======================================================================================


def _fsdp1_units(module: nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return []
    return [u for u in FSDP.fsdp_modules(module) if getattr(u, "_handle", None) is not None]


@torch.no_grad()
def ema_update_(ema: nn.Module, model: nn.Module, weight: float) -> None:
    """``ema <- ema + weight * (model - ema)`` for every parameter, without gathering.

    * unsharded (single device, DDP): one ``torch._foreach_lerp_`` over the parameters;
    * FSDP2: the same on the local shards of the DTensors (identical layouts: the EMA is a
      second DiT sharded with the same units);
    * FSDP1: on the local shards of the flat parameters, unit by unit (the EMA and the
      model are wrapped identically by :func:`dit_wrap_policy`).
    """
    e_units, m_units = _fsdp1_units(ema), _fsdp1_units(model)
    if e_units or m_units:
        n_params = len(list(ema.parameters()))
        covered = sum(len(u._handle.flat_param._fqns) for u in e_units)
        if len(e_units) != len(m_units) or covered != n_params:
            raise RuntimeError(
                "FSDP1: the EMA and the model must each be wrapped in FSDP units of their own "
                "(auto_wrap_policy with DiT and DiTBlock: dit_lightning.distributed.DiTFSDPStrategy)"
            )
        e_flat = [u._handle.flat_param._local_shard for u in e_units]
        m_flat = [u._handle.flat_param._local_shard for u in m_units]
        if any(a.shape != b.shape for a, b in zip(e_flat, m_flat)):
            raise RuntimeError("FSDP1: the EMA and model flat parameters have different layouts")
        torch._foreach_lerp_(e_flat, [t.detach() for t in m_flat], weight)
        return
    e_params, m_params = list(ema.parameters()), list(model.parameters())
    if len(e_params) != len(m_params):
        raise RuntimeError(f"EMA has {len(e_params)} parameters, the model {len(m_params)}")
    e_local, m_local = [], []
    for e, m in zip(e_params, m_params):
        if _is_dtensor(e) or _is_dtensor(m):
            if not (_is_dtensor(e) and _is_dtensor(m)) or e.placements != m.placements or e.device_mesh != m.device_mesh:
                raise RuntimeError("the EMA must be sharded exactly like the model (same FSDP2 units and mesh)")
            e, m = e.to_local(), m.to_local()
        e_local.append(e)
        m_local.append(m.detach())
    torch._foreach_lerp_(e_local, m_local, weight)


def grad_norm(parameters: Iterable[Tensor], strategy: Any = None) -> Optional[Tensor]:
    """The global 2-norm of the gradients (float32 scalar, the same on every rank), or None
    without gradients. A collective under FSDP: call it on every rank."""
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if isinstance(strategy, FSDPStrategy):
        # FSDP1 with use_orig_params: gradients are this rank's shards of the flat gradients.
        root = strategy.model
        local = torch.zeros((), dtype=torch.float32, device=strategy.root_device)
        for g in grads:
            local += g.detach().float().square().sum()
        from torch.distributed.fsdp import ShardingStrategy

        if getattr(root, "sharding_strategy", None) != ShardingStrategy.NO_SHARD:
            dist.all_reduce(local, group=getattr(root, "process_group", None))
        return local.sqrt()
    if not grads:
        return None
    if any(_is_dtensor(g) for g in grads):
        from torch.nn.utils import get_total_norm

        norm = get_total_norm(grads, 2.0, foreach=True)
        return (norm.full_tensor() if _is_dtensor(norm) else norm).float()
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))


def clip_gradients(pl_module: Any, optimizer: Any, gradient_clip_val: Optional[float], gradient_clip_algorithm: Optional[str]) -> None:
    """``configure_gradient_clipping`` that also clips by norm under FSDP.

    Lightning's FSDPPrecision refuses ``gradient_clip_algorithm="norm"`` (a per-rank
    ``clip_grad_norm_`` over shards would be wrong): FSDP1 uses the root module's
    ``clip_grad_norm_`` (global norm over all shards); FSDP2 gradients are DTensors, for which
    ``torch.nn.utils.clip_grad_norm_`` computes the global norm itself. Everything else goes
    through Lightning's own clipping.
    """
    if not gradient_clip_val:
        return
    algorithm = str(gradient_clip_algorithm or "norm").lower()
    trainer = getattr(pl_module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None)
    if algorithm == "norm":
        if isinstance(strategy, FSDPStrategy):
            strategy.model.clip_grad_norm_(gradient_clip_val)
            return
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if any(_is_dtensor(p) for p in params):
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val, foreach=True)
            return
    pl_module.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm)


# ======================================================================================
# Gathering and consolidation
# ======================================================================================


def full_state_dict(net: nn.Module, rank0_only: bool = False) -> dict[str, Tensor]:
    """The complete (unsharded) state dict of a possibly sharded module, on the CPU.

    A collective under FSDP (every rank must call it); ``rank0_only`` leaves it empty elsewhere.
    """
    if _fsdp1_units(net):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        def clean(name: str) -> str:
            return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")

        with FSDP.summon_full_params(net, writeback=False, rank0_only=rank0_only, offload_to_cpu=True):
            if rank0_only and dist.get_rank() != 0:
                return {}
            named = list(net.named_parameters()) + list(net.named_buffers())
            return {clean(k): v.detach().cpu().clone() for k, v in named}
    if not is_fsdp2(net):
        return {k: v.detach().cpu() for k, v in net.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    sd = get_model_state_dict(net, options=opts)
    return {k: v.detach().cpu() for k, v in sd.items()}


def gather_dit(net: nn.Module) -> DiT:
    """A plain, unsharded copy of a (sharded) DiT on every rank, e.g. to sample on one rank.
    A collective under FSDP."""
    from .models.checkpoint import _clean, infer_dit_config

    sd = _clean(full_state_dict(net))
    cfg = infer_dit_config(sd)
    cfg["num_heads"] = getattr(net, "num_heads", cfg["num_heads"])
    cfg["class_dropout_prob"] = getattr(net, "class_dropout_prob", cfg["class_dropout_prob"])
    plain = DiT(**cfg)
    plain.load_state_dict(sd, strict=True)
    return plain.eval()


def is_sharded_checkpoint(path: Union[str, Path]) -> bool:
    """A torch.distributed.checkpoint directory (as saved by FSDP/ModelParallel strategies)."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def _optimizer_by_index(opt: dict[str, Any]) -> dict[str, Any]:
    """An FQN-keyed optimiser state dict (torch.distributed.checkpoint) re-keyed to parameter
    positions, as ``torch.optim.Optimizer.state_dict()`` (and the reference checkpoints) store it:
    position i = the i-th parameter of the param groups, in order."""
    index: dict[str, int] = {}
    groups = []
    for group in opt.get("param_groups", []):
        ids = []
        for name in group["params"]:
            index.setdefault(name, len(index))
            ids.append(index[name])
        groups.append({**group, "params": ids})
    state = {index[name]: value for name, value in opt.get("state", {}).items() if name in index}
    return {"state": state, "param_groups": groups}


def load_sharded_checkpoint(path: Union[str, Path], tmp_dir: Optional[Union[str, Path]] = None) -> dict[str, Any]:
    """Read a sharded (DCP) Lightning checkpoint directory into one process: returns
    ``{"state_dict": full tensors, "optimizer_states": [FQN-keyed], **metadata}``.

    The shards are merged through a temporary file in ``tmp_dir`` (default: next to the
    checkpoint) with ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise ValueError(f"'{path}' is not a sharded checkpoint directory (no .metadata file)")
    fd, tmp = tempfile.mkstemp(prefix=".consolidate.", suffix=".tmp", dir=str(tmp_dir or path.parent))
    os.close(fd)
    try:
        dcp_to_torch_save(path, tmp)
        data = torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
    finally:
        os.unlink(tmp)
    out: dict[str, Any] = {"state_dict": data.pop("state_dict", {})}
    out["optimizer_states"] = [data.pop(k) for k in sorted((k for k in data if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))]
    meta = path / "meta.pt"
    if meta.is_file():
        out.update({k: v for k, v in torch.load(meta, map_location="cpu", weights_only=True).items() if k not in out})
    return out


def consolidate(
    checkpoint: str,
    output: str,
    format: Literal["reference", "raw"] = "reference",
    include_optimizer: bool = True,
) -> str:
    """Turn a sharded checkpoint directory (FSDP2 / FSDP1 ``state_dict_type="sharded"``) into a
    single-file checkpoint a plain DiT loads with ``strict=True``.

    Args:
        checkpoint: the checkpoint directory (e.g. ``checkpoints/last.ckpt/``); a single-file
            checkpoint is exported as by ``dit-lightning export``.
        output: the ``.pt`` file to write (atomically).
        format: ``reference`` writes ``{model, ema, opt, args}`` like the reference training
            script (EMA under ``ema``); ``raw`` writes the EMA state dict alone, like the
            released ``DiT-XL-2-256x256.pt``.
        include_optimizer: keep the AdamW state under ``opt``, keyed by parameter position
            over the trainable parameters (reference format only).

    Runs in one process, without a process group; needs host memory for the whole state.
    """
    from .export import export_checkpoint
    from .models.checkpoint import _clean, _strip, atomic_torch_save, infer_dit_config, to_reference_format

    if not is_sharded_checkpoint(checkpoint):
        return export_checkpoint(checkpoint, output, format=format, include_optimizer=include_optimizer)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    ckpt = load_sharded_checkpoint(checkpoint, tmp_dir=Path(output).parent)
    sd = _clean(ckpt["state_dict"])
    model_sd, ema_sd = _strip(sd, "model."), _strip(sd, "ema.")
    if not model_sd:
        raise ValueError(f"'{checkpoint}' holds no DiT weights under 'model.' (keys: {sorted(sd)[:6]})")
    ema_sd = ema_sd or model_sd
    if format == "raw":
        obj: dict[str, Any] = {k: v.detach().cpu().contiguous() for k, v in ema_sd.items()}
    else:
        opt = None
        if include_optimizer and ckpt["optimizer_states"]:
            opt = _optimizer_by_index(ckpt["optimizer_states"][0])
        hp = ckpt.get("hyper_parameters")
        args = {"model_config": infer_dit_config(model_sd), **(dict(hp) if isinstance(hp, dict) else {})}
        args = {k: v for k, v in args.items() if isinstance(v, (int, float, str, bool, list, tuple, dict, type(None)))}
        args.update({k: ckpt[k] for k in ("epoch", "global_step") if isinstance(ckpt.get(k), int)})
        obj = to_reference_format(model_sd, ema_sd, args=args, opt=opt)
    atomic_torch_save(obj, Path(output))
    print(f"consolidated {checkpoint} -> {output} ({format} format, {len(ema_sd)} tensors)")
    return output


# ======================================================================================
# Memory per device
# ======================================================================================

_GIB = 1024**3


def memory_per_device(
    model: Union[str, DiTShape] = "DiT-XL/2",
    world_size: int = 8,
    strategy: Literal["ddp", "full_shard", "shard_grad_op", "hybrid_shard"] = "full_shard",
    shard_group: Optional[int] = None,
    ema: bool = True,
) -> dict[str, float]:
    """GiB per device of the fp32 parameters, gradients, AdamW moments and EMA (activations,
    temporary all-gather buffers and the CUDA context excluded).

    ``full_shard``: everything / world; ``shard_grad_op``: parameters whole (gathered from the
    forward to the backward), the rest / world; ``hybrid_shard``: everything / ``shard_group``
    (the ranks of a node); ``ddp``: everything whole. The EMA is sharded like the parameters at
    rest under every FSDP variant (it is never gathered during training).
    """
    s = shape_of(model) if isinstance(model, str) else model
    n = dit_params(s)
    trainable = dit_params(s, include_pos_embed=False)
    group = {"ddp": 1, "full_shard": world_size, "shard_grad_op": world_size}.get(strategy, shard_group or world_size)
    if strategy == "hybrid_shard" and shard_group is None:
        raise ValueError("hybrid_shard needs shard_group (e.g. the GPUs per node)")
    params = 4 * n / (1 if strategy in ("ddp", "shard_grad_op") else group)
    out = {
        "params": params / _GIB,
        "grads": 4 * trainable / group / _GIB,
        "optimizer": 8 * trainable / group / _GIB,
        "ema": (4 * n / group / _GIB) if ema else 0.0,
    }
    out["total"] = sum(out.values())
    return out


__all__ = [
    "DiTDDPStrategy",
    "DiTFSDP2Strategy",
    "DiTFSDPStrategy",
    "clip_gradients",
    "configure_sharding",
    "consolidate",
    "dit_wrap_policy",
    "ema_update_",
    "full_state_dict",
    "gather_dit",
    "grad_norm",
    "is_fsdp2",
    "is_sharded",
    "is_sharded_checkpoint",
    "load_sharded_checkpoint",
    "memory_per_device",
    "shard_dit",
]
