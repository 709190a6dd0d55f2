"""DiT architectures as plain dicts of constructor arguments: read off a live network
(:func:`model_config`), and built back (:func:`build_from_config`). Checkpoints record them."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from .dit import DiT, RMSNorm, SwiGLUFeedForward, mlp_channels, swiglu_hidden

# DiT constructor arguments that define the architecture (activation checkpointing does not).
ARCH_KEYS = (
    "input_size",
    "patch_size",
    "in_channels",
    "hidden_size",
    "depth",
    "num_heads",
    "mlp_ratio",
    "class_dropout_prob",
    "num_classes",
    "learn_sigma",
    "qk_norm",
    "attn_dim",
    "norm",
    "mlp",
    "pos_embed",
    "wo_shift",
    "class_token_dim",
)
# The block options at DiT's own values: a record leaves them out (records of DiT's block stay as they were).
BLOCK_DEFAULTS: dict[str, Any] = {"norm": "layernorm", "mlp": "gelu", "pos_embed": "sincos", "wo_shift": False}


def mlp_ratio_for(hidden_size: int, channels: int) -> float:
    """A float ``r`` with ``int(hidden_size * r) == channels`` exactly (what DiT computes),
    nudged by an ulp where ``channels / hidden_size`` rounds low (61 / 56 * 56 = 60.99...)."""
    r = channels / hidden_size
    while int(hidden_size * r) < channels:
        r = math.nextafter(r, math.inf)
    if int(hidden_size * r) != channels:
        raise ValueError(f"no mlp_ratio gives {channels} channels at hidden_size {hidden_size}")
    return r


def swiglu_mlp_ratio_for(hidden_size: int, channels: int) -> float:
    """A float ``r`` with ``int(2/3 * int(hidden_size * r)) == channels`` (what SwiGLU's width is, as
    LightningDiT computes it): the smallest GELU width whose two thirds round down to ``channels``."""
    width = max(1, (3 * channels) // 2 - 1)
    while swiglu_hidden(hidden_size, mlp_ratio_for(hidden_size, width)) < channels:
        width += 1
    r = mlp_ratio_for(hidden_size, width)
    if swiglu_hidden(hidden_size, r) != channels:
        raise ValueError(f"no mlp_ratio gives {channels} SwiGLU channels at hidden_size {hidden_size}")
    return r


def block_options(model: DiT) -> dict[str, Any]:
    """The block options of a live network that differ from DiT's (``{}`` for DiT's own block)."""
    options: dict[str, Any] = {}
    if len(model.blocks):
        block = model.blocks[0]
        options["norm"] = "rmsnorm" if isinstance(block.norm1, RMSNorm) else "layernorm"
        options["mlp"] = "swiglu" if isinstance(block.mlp, SwiGLUFeedForward) else "gelu"
        options["wo_shift"] = bool(block.wo_shift)
    else:
        options.update(norm=model.norm_kind, mlp=model.mlp_kind, wo_shift=model.wo_shift)
    options["pos_embed"] = "rope" if model.feat_rope is not None else "sincos"
    return {k: v for k, v in options.items() if v != BLOCK_DEFAULTS[k]}


def model_config(model: DiT) -> dict[str, Any]:
    """The constructor arguments that rebuild ``model``'s architecture (``attn_dim``, the width
    of q/k/v, only when it differs from ``hidden_size``, i.e. after head pruning; the block
    options only where they are not DiT's)."""
    attn = model.blocks[0].attn if len(model.blocks) else None
    options = block_options(model)
    ratio_for = swiglu_mlp_ratio_for if options.get("mlp") == "swiglu" else mlp_ratio_for
    mlp = ratio_for(model.hidden_size, mlp_channels(model.blocks[0])) if len(model.blocks) else model.mlp_ratio
    cfg: dict[str, Any] = {
        "input_size": model.input_size,
        "patch_size": model.patch_size,
        "in_channels": model.in_channels,
        "hidden_size": model.hidden_size,
        "depth": len(model.blocks),
        "num_heads": model.num_heads,
        "mlp_ratio": mlp,
        "class_dropout_prob": model.class_dropout_prob,
        "num_classes": model.num_classes,
        "learn_sigma": model.learn_sigma,
        "qk_norm": attn is not None and isinstance(attn.q_norm, (nn.LayerNorm, RMSNorm)),
    }
    if attn is not None and attn.num_heads * attn.head_dim != model.hidden_size:
        cfg["attn_dim"] = int(attn.num_heads * attn.head_dim)
    cfg.update(options)
    if model.class_token_dim is not None:  # REG's class token (a record without it: none)
        cfg["class_token_dim"] = model.class_token_dim
    return cfg


def build_from_config(
    cfg: dict[str, Any], device: Any = None, dtype: Optional[torch.dtype] = None, empty: bool = False
) -> DiT:
    """A DiT of configuration ``cfg`` (as :func:`model_config` / :func:`dit_config_of` return).
    ``empty``: built on the meta device and allocated uninitialised (weights about to be loaded)."""
    kwargs = {k: v for k, v in cfg.items() if k in ARCH_KEYS or k == "activation_checkpointing"}
    if not empty:
        return DiT(**kwargs).to(device=device, dtype=dtype)
    with torch.device("meta"):
        net = DiT(**kwargs)
    return net.to_empty(device=device or "cpu").to(dtype=dtype)
