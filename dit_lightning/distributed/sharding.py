"""Sharding DiT with FSDP2 (``fully_shard``) and telling whether a module is sharded.

Every DiTBlock, then each whole DiT (the trained network and the EMA), becomes an FSDP2 unit, so
the EMA is sharded exactly like the model and its update is a lerp of local shards
(:func:`~dit_lightning.distributed.ops.ema_update_`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypeGuard

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from ..models import DiT

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _is_dtensor(t: Any) -> TypeGuard[DTensor]:
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


def _fsdp1_units(module: nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return []
    return [u for u in FSDP.fsdp_modules(module) if getattr(u, "_handle", None) is not None]


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
    return init_device_mesh(
        device.type, (world // hybrid_shard_size, hybrid_shard_size), mesh_dim_names=("replicate", "shard")
    )


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


def _mp_policy(opts: dict[str, Any]) -> dict[str, Any]:
    """The ``mp_policy`` keyword of an auxiliary module's ``fully_shard`` (none without dtypes)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if opts.get("param_dtype") is None and opts.get("reduce_dtype") is None:
        return {}
    low = opts.get("param_dtype") not in (None, torch.float32)
    return {
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=opts.get("param_dtype"),
            reduce_dtype=opts.get("reduce_dtype"),
            output_dtype=torch.float32 if low else None,
        )
    }


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
    from torch.distributed.fsdp import fully_shard

    for _, net in _dit_children(pl_module):
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
    for _name, child in pl_module.named_children():
        # trained modules beside the DiTs (REPA's projector, distillation's feature projections):
        # one FSDP2 unit each, so their gradients are reduced and their optimiser state sharded too
        if isinstance(child, DiT) or not any(p.requires_grad for p in child.parameters()):
            continue
        if sync:
            _broadcast_from_rank0(child, device)
        fully_shard(child, mesh=dp_mesh, reshard_after_forward=True, **_mp_policy(opts))
    n = sum(p.numel() for p in pl_module.parameters())
    local = sum((p.to_local() if _is_dtensor(p) else p).numel() for p in pl_module.parameters())
    rank_zero_info(f"FSDP2: sharded {n:,} parameter elements over {dp_mesh.size()} ranks ({local:,} on rank 0)")
    return True
