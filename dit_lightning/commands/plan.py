"""``dit-lightning plan``: the planner as a command (a rich table in the terminal, or JSON)."""

from __future__ import annotations

import sys
from typing import Any, Literal, Optional, Union

from ..planner.memory import (
    CheckpointArg,
    DeviceKind,
    MemoryPlan,
    OptimizerName,
    Precision,
    Sharding,
    Strategy,
    plan_memory,
)
from ..planner.recommend import Recommendation, recommend
from ..planner.report import render_memory, render_recommendation


def plan(
    model: str = "DiT-XL/2",
    latent_size: int = 32,
    micro_batch: int = 32,
    precision: Optional[Precision] = None,
    activation_checkpointing: CheckpointArg = "none",
    strategy: Optional[Strategy] = None,
    sharding: Optional[Sharding] = None,
    world_size: int = 1,
    optimizer: OptimizerName = "adamw",
    ema: bool = True,
    accumulate_grad_batches: int = 1,
    gpu: Optional[str] = None,
    memory_gib: Optional[float] = None,
    attention: Literal["auto", "flash", "math"] = "auto",
    device: DeviceKind = "cuda",
    fit: bool = False,
    global_batch: int = 256,
    fit_micro_batch: Optional[int] = None,
    steps: int = 400_000,
    mfu: Optional[float] = None,
    price_per_gpu_hour: Optional[float] = None,
    format: Literal["table", "json"] = "table",
    depth: Optional[int] = None,
    hidden_size: Optional[int] = None,
    num_heads: Optional[int] = None,
    patch_size: Optional[int] = None,
    in_channels: int = 4,
    num_classes: int = 1000,
) -> Union[MemoryPlan, Recommendation]:
    """Plan the GPU memory of DiT training, or (``--fit``) recommend the fastest setup that fits.

    Args:
        model: a registered name (``DiT-XL/2``) or ``custom`` with depth/hidden_size/num_heads/patch_size.
        latent_size: latent side: 32 for 256px images, 64 for 512px.
        micro_batch: per-GPU batch of one forward/backward (plan mode).
        precision: 32-true, 16-mixed or bf16-mixed (plan mode default bf16-mixed; fit: searched).
        activation_checkpointing: recomputed blocks: a number (the first N), none, half or all (plan mode).
        strategy: ddp or fsdp (plan mode default ddp; fit: searched when not given).
        sharding: FSDP sharding: FULL_SHARD or SHARD_GRAD_OP (fit: searched when not given).
        world_size: number of GPUs (data parallel).
        optimizer: adamw (2 fp32 states), adamw8bit (bitsandbytes) or sgd (momentum).
        ema: keep the fp32 EMA copy of the weights.
        accumulate_grad_batches: gradient accumulation (plan mode; >1 keeps gradients alive).
        gpu: rtx3090, rtx4090, rtx-a6000, l4, l40s, v100-32gb, a100-40gb, a100-80gb, h100-80gb, h100-pcie, h200.
        memory_gib: a memory budget in GiB (instead of, or overriding, the GPU's memory).
        attention: SDPA kernel family (auto = flash-type, O(T); math = the T x T matrix).
        device: cuda (adds context, workspaces, fragmentation headroom) or cpu.
        fit: recommend micro-batch, accumulation, precision, checkpointing and strategy.
        global_batch: target global batch for --fit (micro x world x accumulation, exactly).
        fit_micro_batch: pin the micro-batch in --fit mode.
        steps: optimiser steps of the run, for the time and cost estimate.
        mfu: measured utilisation of executed FLOPs (default 0.35 for 16-bit, 0.12 for fp32/TF32).
        price_per_gpu_hour: price of one GPU-hour, for the cost estimate.
        format: table (rich) or json.
        depth: override the named model's depth (or set it for custom).
        hidden_size: override the hidden size.
        num_heads: override the number of heads.
        patch_size: override the patch size.
        in_channels: latent channels (4 for the SD VAE).
        num_classes: number of classes (1000 for ImageNet).
    """
    shape: dict[str, Any] = dict(
        depth=depth,
        hidden_size=hidden_size,
        num_heads=num_heads,
        patch_size=patch_size,
        in_channels=in_channels,
        num_classes=num_classes,
    )
    if fit:
        result: Union[MemoryPlan, Recommendation] = recommend(
            model,
            gpu=gpu,
            num_gpus=world_size,
            global_batch=global_batch,
            latent_size=latent_size,
            precision=precision,
            strategy=strategy,
            sharding=sharding,
            micro_batch=fit_micro_batch,
            optimizer=optimizer,
            ema=ema,
            memory_gib=memory_gib,
            mfu=mfu,
            steps=steps,
            price_per_gpu_hour=price_per_gpu_hour,
            **shape,
        )
    else:
        result = plan_memory(
            model,
            latent_size=latent_size,
            micro_batch=micro_batch,
            precision=precision or "bf16-mixed",
            activation_checkpointing=activation_checkpointing,
            strategy=strategy or "ddp",
            sharding=sharding or "FULL_SHARD",
            world_size=world_size,
            optimizer=optimizer,
            ema=ema,
            accumulate_grad_batches=accumulate_grad_batches,
            gpu=gpu,
            memory_gib=memory_gib,
            attention=attention,
            device=device,
            **shape,
        )
    if format == "json":
        sys.stdout.write(result.to_json() + "\n")
    elif isinstance(result, Recommendation):
        render_recommendation(result)
    else:
        render_memory(result)
    return result
