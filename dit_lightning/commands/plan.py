"""``dit-lightning plan``: the planner as a command (a rich table in the terminal, JSON, or with
``--fit`` a hardware profile as YAML)."""

from __future__ import annotations

import sys
from typing import Literal, Optional, Union

from ..planner.hardware import INTERCONNECTS, gpu_names, gpu_spec, local_gpu
from ..planner.memory import (
    CheckpointArg,
    DeviceKind,
    MemoryPlan,
    OptimizerName,
    PlanOptions,
    Sharding,
    Strategy,
    plan_memory,
)
from ..planner.profiles import fit_command, render_yaml
from ..planner.recommend import Recommendation, recommend, step_time
from ..planner.report import communication_line, render_memory, render_recommendation
from ..precision import TrainingPrecision


def plan(
    model: str = "DiT-XL/2",
    latent_size: int = 32,
    micro_batch: int = 32,
    precision: Optional[TrainingPrecision] = None,
    activation_checkpointing: Optional[CheckpointArg] = None,
    strategy: Optional[Strategy] = None,
    sharding: Optional[Sharding] = None,
    world_size: int = 1,
    num_nodes: int = 1,
    shard_group: Optional[int] = None,
    fsdp2: bool = False,
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
    format: Literal["table", "json", "yaml"] = "table",
    depth: Optional[int] = None,
    hidden_size: Optional[int] = None,
    num_heads: Optional[int] = None,
    patch_size: Optional[int] = None,
    in_channels: int = 4,
    num_classes: int = 1000,
    qk_norm: bool = False,
    communication: str = "none",
    interconnect: Optional[str] = None,
    repa_projector_dim: Optional[int] = None,
    repa_feature_dim: int = 768,
    repa_encoder_params: int = 0,
) -> Union[MemoryPlan, Recommendation]:
    """Plan the GPU memory of DiT training, or (``--fit``) recommend the fastest setup that fits.

    Args:
        model: a registered name (``DiT-XL/2``) or ``custom`` with depth/hidden_size/num_heads/patch_size.
        latent_size: latent side: 32 for 256px images, 64 for 512px.
        micro_batch: per-GPU batch of one forward/backward (plan mode).
        precision: 32-true, 16-mixed or bf16-mixed (plan mode default bf16-mixed; fit: searched).
        activation_checkpointing: recomputed blocks, as the model takes them: none, all, half, first:N, every:K
            or a number N (plan mode default none; fit: searched when not given).
        strategy: ddp or fsdp (plan mode default ddp; fit: searched when not given).
        sharding: FSDP sharding: FULL_SHARD or SHARD_GRAD_OP (fit: searched when not given).
        world_size: number of GPUs (data parallel), over all nodes.
        num_nodes: nodes the GPUs are spread over (--format yaml writes trainer.num_nodes).
        shard_group: FSDP hybrid sharding (HSDP): shard within groups of this many GPUs (a node's).
        fsdp2: --format yaml writes FSDP as FSDP2 (DiTFSDP2Strategy) rather than FSDP1.
        optimizer: adamw (2 fp32 states), adamw8bit (bitsandbytes) or sgd (momentum).
        ema: keep the fp32 EMA copy of the weights.
        accumulate_grad_batches: gradient accumulation (plan mode; >1 keeps gradients alive).
        gpu: GPU_NAMES; the name torch.cuda.get_device_name() prints ("NVIDIA H100 80GB HBM3"); or auto (this
            machine's first GPU).
        memory_gib: a memory budget in GiB per GPU (instead of, or overriding, the GPU's memory).
        attention: SDPA kernel family (auto = flash-type, O(T); math = the T x T matrix).
        device: cuda (adds context, workspaces, fragmentation headroom) or cpu.
        fit: recommend micro-batch, accumulation, precision, checkpointing and strategy.
        global_batch: target global batch for --fit (micro x world x accumulation, exactly).
        fit_micro_batch: pin the micro-batch in --fit mode.
        steps: optimiser steps of the run, for the time and cost estimate.
        mfu: measured utilisation of executed FLOPs (default 0.35 for 16-bit, 0.12 for fp32/TF32).
        price_per_gpu_hour: price of one GPU-hour, for the cost estimate.
        format: table (rich), json, or yaml (with --fit: a hardware profile to pass as --config).
        depth: override the named model's depth (or set it for custom).
        hidden_size: override the hidden size.
        num_heads: override the number of heads.
        patch_size: override the patch size.
        in_channels: latent channels (4 for the SD VAE).
        num_classes: number of classes (1000 for ImageNet).
        qk_norm: the model's QK-norm (--model.qk_norm): LayerNorm of q and k, more saved tensors per block.
        communication: gradient reduction: none (fp32), bf16 or fp16 (DDP hook / FSDP reduce_dtype), powersgd or
            powersgd:R (DDP); priced in the step time.
        interconnect: the link between a node's GPUs (INTERCONNECT_NAMES), optionally +network between nodes
            (nvlink4+ib-ndr); default: the GPU's own.
        repa_projector_dim: REPA's projector width (--model.repa.projector_dim, 2048); unset: no REPA.
        repa_feature_dim: the REPA encoder's feature width (768 for DINOv2 ViT-B).
        repa_encoder_params: the REPA encoder's parameters when it runs online (86580480 for DINOv2 ViT-B/14);
            0: its features come from the store.
    """
    if format == "yaml" and not fit:
        raise ValueError("--format yaml writes a hardware profile of a recommendation: add --fit")
    if gpu is not None and gpu.strip().lower() == "auto":
        name, spec, total_gib = local_gpu()
        if spec is not None:
            gpu = spec.name
        else:  # a GPU the table does not list: its memory, with a nominal compute model
            gpu = None
            memory_gib = total_gib if memory_gib is None else memory_gib
        print(
            f"--gpu auto: {name} ({spec.name if spec else f'{total_gib:.1f} GiB, not in the table'})", file=sys.stderr
        )
    elif gpu is not None:
        gpu = gpu_spec(gpu).name  # any spelling the table knows, or a clear error
    # The run as the planner sees it; in plan mode its unset settings are plan_memory's defaults,
    # with --fit recommend searches them (--fit_micro_batch pins the micro-batch there).
    options = PlanOptions(
        model=model,
        latent_size=latent_size,
        depth=depth,
        hidden_size=hidden_size,
        num_heads=num_heads,
        patch_size=patch_size,
        in_channels=in_channels,
        num_classes=num_classes,
        qk_norm=qk_norm,
        micro_batch=fit_micro_batch if fit else micro_batch,
        accumulate_grad_batches=None if fit else accumulate_grad_batches,
        precision=precision,
        activation_checkpointing=activation_checkpointing,
        strategy=strategy,
        sharding=sharding,
        world_size=world_size,
        shard_group=shard_group,
        optimizer=optimizer,
        ema=ema,
        attention=attention,
        device=device,
        communication=communication,
        interconnect=interconnect,
        num_nodes=num_nodes,
        repa_projector_dim=repa_projector_dim,
        repa_feature_dim=repa_feature_dim,
        repa_encoder_params=repa_encoder_params,
    )
    result: Union[MemoryPlan, Recommendation]
    if fit:
        rec = recommend(
            options,
            gpu=gpu,
            global_batch=global_batch,
            memory_gib=memory_gib,
            mfu=mfu,
            steps=steps,
            price_per_gpu_hour=price_per_gpu_hour,
        )
        rec.command = fit_command(rec)
        result = rec
    else:
        result = plan_memory(options, gpu=gpu, memory_gib=memory_gib)
    if format == "json":
        sys.stdout.write(result.to_json() + "\n")
    elif format == "yaml" and isinstance(result, Recommendation):
        if world_size % num_nodes:
            raise ValueError(f"--world_size {world_size} is not a multiple of --num_nodes {num_nodes}")
        sys.stdout.write(render_yaml(result, num_nodes=num_nodes, fsdp2=fsdp2, shard_group=shard_group))
    elif isinstance(result, Recommendation):
        render_recommendation(result)
    else:
        render_memory(result)
        if gpu is not None and world_size > 1:  # the step's communication on this GPU's links
            from rich.console import Console

            timing = step_time(options, gpu_spec(gpu), micro_batch * world_size * accumulate_grad_batches)
            Console().print(communication_line(timing.communication, timing.step_s), soft_wrap=True)
    return result


# The help lists the GPU table as it is (one source: planner/hardware.py).
plan.__doc__ = (
    (plan.__doc__ or "").replace("GPU_NAMES", gpu_names()).replace("INTERCONNECT_NAMES", ", ".join(INTERCONNECTS))
)
