"""Distributed training of DiT, by concern: the strategies (:mod:`.strategies`), FSDP2 sharding
(:mod:`.sharding`) and the operations that work on sharded and unsharded modules alike
(:mod:`.ops`: the EMA update on local shards, gradient norm and clipping, gathering weights).

Sharded checkpoints are read and consolidated by :mod:`dit_lightning.checkpoints`; the memory per
device is the planner's (:func:`dit_lightning.planner.plan_memory`).
"""

from .ops import clip_gradients, ema_update_, full_state_dict, gather_dit, grad_norm
from .sharding import configure_sharding, is_fsdp2, is_sharded, shard_dit
from .strategies import DiTDDPStrategy, DiTFSDP2Strategy, DiTFSDPStrategy, dit_wrap_policy

__all__ = [
    "DiTDDPStrategy",
    "DiTFSDP2Strategy",
    "DiTFSDPStrategy",
    "clip_gradients",
    "configure_sharding",
    "dit_wrap_policy",
    "ema_update_",
    "full_state_dict",
    "gather_dit",
    "grad_norm",
    "is_fsdp2",
    "is_sharded",
    "shard_dit",
]
