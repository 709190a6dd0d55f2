"""Convert checkpoints between this project's Lightning format and the reference DiT formats."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from .models.checkpoint import atomic_torch_save, infer_dit_config, read_checkpoint, to_reference_format


def export_checkpoint(checkpoint: str, output: str, format: Literal["reference", "raw"] = "reference", include_optimizer: bool = True) -> str:
    """Export a checkpoint for the reference sampling scripts and other DiT users.

    Args:
        checkpoint: a Lightning checkpoint of DiTModule (or any supported DiT checkpoint).
        output: the ``.pt`` file to write (atomically).
        format: ``reference`` writes ``{model, ema, opt, args}`` (EMA weights under ``ema``);
            ``raw`` writes the EMA state dict alone, like the released ``DiT-XL-2-256x256.pt``.
        include_optimizer: keep the optimiser state under ``opt`` (reference format only).
    """
    ckpt = read_checkpoint(checkpoint)
    model_sd, ema_sd = ckpt["model"], ckpt["ema"] or ckpt["model"]
    if format == "raw":
        obj = {k: v.detach().cpu().contiguous() for k, v in ema_sd.items()}
    else:
        opt = None
        if include_optimizer:
            raw = torch.load(checkpoint, map_location="cpu", weights_only=True)
            states = raw.get("optimizer_states") if isinstance(raw, dict) else None
            opt = states[0] if states else raw.get("opt") if isinstance(raw, dict) else None
        args = {"model_config": infer_dit_config(model_sd), **(ckpt["args"] or {})}
        args = {k: v for k, v in args.items() if isinstance(v, (int, float, str, bool, list, tuple, dict, type(None)))}
        obj = to_reference_format(model_sd, ema_sd, args=args, opt=opt)
    atomic_torch_save(obj, Path(output))
    print(f"exported {checkpoint} -> {output} ({format} format, {len(ema_sd)} tensors)")
    return output
