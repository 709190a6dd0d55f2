"""Operations that work the same on plain, DDP, FSDP1 and FSDP2 modules: the EMA update on local
shards, the global gradient norm, clipping by norm, and gathering full weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy
from torch import Tensor, nn

from ..checkpoints.architecture import infer_dit_config
from ..checkpoints.formats import clean_state_dict
from ..models import DiT
from .sharding import _fsdp1_units, _is_dtensor, is_fsdp2

if TYPE_CHECKING:
    from torch.distributed.fsdp import FullyShardedDataParallel


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
    e_local: list[Tensor] = []
    m_local: list[Tensor] = []
    e: Tensor
    m: Tensor
    for e, m in zip(e_params, m_params):
        if _is_dtensor(e) or _is_dtensor(m):
            if (
                not (_is_dtensor(e) and _is_dtensor(m))
                or e.placements != m.placements
                or e.device_mesh != m.device_mesh
            ):
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


def clip_gradients(
    pl_module: Any, optimizer: Any, gradient_clip_val: Optional[float], gradient_clip_algorithm: Optional[str]
) -> None:
    """``configure_gradient_clipping`` that also clips by norm under FSDP.

    Lightning's FSDPPrecision refuses ``gradient_clip_algorithm="norm"`` (a per-rank
    ``clip_grad_norm_`` over shards would be wrong): FSDP1 uses the root module's
    ``clip_grad_norm_`` (global norm over all shards); FSDP2 gradients are DTensors, for which
    ``torch.nn.utils.clip_grad_norm_`` computes the global norm itself. Everything else goes
    through Lightning's own clipping.
    """
    if not gradient_clip_val:
        return
    # Lightning passes its GradClipAlgorithmType, whose str() is "GradClipAlgorithmType.NORM": read the value
    algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm").lower()
    trainer = getattr(pl_module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None)
    if algorithm == "norm":
        if isinstance(strategy, FSDPStrategy):
            # Under FSDPStrategy the root module is the FSDP1 wrapper (its clip_grad_norm_ uses the global norm).
            cast("FullyShardedDataParallel", strategy.model).clip_grad_norm_(gradient_clip_val)
            return
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if any(_is_dtensor(p) for p in params):
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val, foreach=True)
            return
    pl_module.clip_gradients(
        optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm
    )


def full_state_dict(net: nn.Module, rank0_only: bool = False) -> dict[str, Tensor]:
    """The complete (unsharded) state dict of a possibly sharded module, on the CPU.

    A collective under FSDP (every rank must call it); ``rank0_only`` leaves it empty elsewhere.
    """
    if _fsdp1_units(net):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        def clean(name: str) -> str:
            return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")

        # FSDP1 refuses to offload unsharded (NO_SHARD, e.g. one device) parameters; they are copied below
        offload = dist.get_world_size() > 1
        with FSDP.summon_full_params(net, writeback=False, rank0_only=rank0_only, offload_to_cpu=offload):
            if rank0_only and dist.get_rank() != 0:
                return {}
            named = list(net.named_parameters()) + list(net.named_buffers())
            return {clean(k): v.detach().cpu().clone() for k, v in named}
    if not is_fsdp2(net):
        return {k: v.detach().cpu() for k, v in net.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    sd = cast(dict[str, Tensor], get_model_state_dict(net, options=opts))  # a model's state: tensors only
    return {k: v.detach().cpu() for k, v in sd.items()}


def gather_dit(net: nn.Module) -> DiT:
    """A plain, unsharded copy of a (sharded) DiT on every rank, e.g. to sample on one rank.
    A collective under FSDP."""
    sd = clean_state_dict(full_state_dict(net))
    cfg = infer_dit_config(sd)
    cfg["num_heads"] = getattr(net, "num_heads", cfg["num_heads"])
    cfg["class_dropout_prob"] = getattr(net, "class_dropout_prob", cfg["class_dropout_prob"])
    plain = DiT(**cfg)
    plain.load_state_dict(sd, strict=True)
    return plain.eval()


@contextlib.contextmanager
def no_sync(strategy: Any) -> Iterator[None]:
    """Keep gradients local for a pass (DDP's ``no_sync``); a no-op for one device."""
    if strategy.world_size > 1 and hasattr(strategy, "block_backward_sync"):
        with strategy.block_backward_sync():
            yield
    else:
        yield


def first_failed_rank(trainer: Any, failed: bool) -> int:
    """The lowest rank whose attempt failed (-1: none), known to every rank: one collective, and only
    with several ranks (one device knows its own out-of-memory error without asking)."""
    if trainer.world_size <= 1:
        return 0 if failed else -1
    mine = float(trainer.world_size - trainer.global_rank if failed else 0)  # max picks the lowest failed rank
    top = float(trainer.strategy.reduce(torch.tensor(mine, device=trainer.strategy.root_device), reduce_op="max"))
    return int(trainer.world_size - top) if top > 0 else -1
