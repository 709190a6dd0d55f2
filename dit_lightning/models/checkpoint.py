"""Reading and writing DiT weights in the formats users meet.

- raw state dict: the released ``DiT-XL-2-256x256.pt`` (EMA weights, no wrapper keys);
- reference training format: ``{"model", "ema", "opt", "args"}``;
- Lightning checkpoints of :class:`~dit_lightning.module.DiTModule` (``state_dict`` with
  ``model.`` and ``ema.`` prefixes).

Everything loads with ``torch.load(weights_only=True)``; writes are atomic (temporary file,
fsync, rename) so a killed export never leaves a truncated file behind.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from .dit import DIT_CONFIGS

StateDict = dict[str, Tensor]


def atomic_torch_save(obj: Any, path: Union[str, Path]) -> None:
    """``torch.save`` that either leaves the complete file at ``path`` or nothing new."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _strip(sd: StateDict, prefix: str) -> StateDict:
    return {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}


def _clean(sd: StateDict) -> StateDict:
    """Drop wrappers' prefixes (torch.compile's ``_orig_mod.``, DDP's ``module.``)."""
    out = {}
    for k, v in sd.items():
        for p in ("_orig_mod.", "module."):
            k = k.replace(p, "")
        out[k] = v
    return out


def read_checkpoint(path: Union[str, Path]) -> dict[str, Optional[StateDict]]:
    """Load any supported checkpoint; returns ``{"model": sd, "ema": sd or None, "args": dict or None}``.

    For a raw released state dict the weights are EMA weights: they come back as both
    ``model`` and ``ema``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    try:
        # The reference scripts store their argparse.Namespace under "args": allow just that class.
        with torch.serialization.safe_globals([argparse.Namespace]):
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, pickle of arbitrary objects, not a torch file...
        raise ValueError(f"could not read checkpoint '{path}' with torch.load(weights_only=True): {e}") from e
    if not isinstance(ckpt, dict):
        raise ValueError(f"checkpoint '{path}' holds a {type(ckpt).__name__}, not a state dict")
    if "state_dict" in ckpt and isinstance(ckpt["state_dict"], dict):  # Lightning
        sd = _clean(ckpt["state_dict"])
        model, ema = _strip(sd, "model."), _strip(sd, "ema.")
        hp = ckpt.get("hyper_parameters")
        return {"model": model, "ema": ema or None, "args": dict(hp) if isinstance(hp, dict) else None}
    if "model" in ckpt and isinstance(ckpt["model"], dict):  # reference training format
        args = ckpt.get("args")
        args = vars(args) if isinstance(args, argparse.Namespace) else args
        return {
            "model": _clean(ckpt["model"]),
            "ema": _clean(ckpt["ema"]) if isinstance(ckpt.get("ema"), dict) else None,
            "args": args if isinstance(args, dict) else None,
        }
    if "pos_embed" in ckpt or any(k.startswith("blocks.") for k in ckpt):  # raw (released) weights
        sd = _clean(ckpt)
        return {"model": sd, "ema": sd, "args": None}
    raise ValueError(
        f"checkpoint '{path}' is not a DiT checkpoint: expected a raw DiT state dict, "
        f"{{model, ema, opt, args}} or a Lightning checkpoint; found keys {sorted(ckpt)[:8]}"
    )


def infer_dit_config(sd: StateDict) -> dict[str, Any]:
    """Recover the constructor arguments of the DiT that produced a state dict."""
    try:
        hidden = sd["pos_embed"].shape[-1]
        tokens = sd["pos_embed"].shape[1]
        w = sd["x_embedder.proj.weight"]
        table = sd["y_embedder.embedding_table.weight"].shape[0]
        out_features = sd["final_layer.linear.weight"].shape[0]
        mlp_hidden = sd["blocks.0.mlp.fc1.weight"].shape[0]
        attn_dim = sd["blocks.0.attn.qkv.weight"].shape[0] // 3
    except KeyError as e:
        raise ValueError(f"not a DiT state dict: missing {e}") from None
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    patch, in_channels = w.shape[-1], w.shape[1]
    grid = int(round(tokens**0.5))
    out_channels = out_features // (patch * patch)
    learn_sigma = out_channels == 2 * in_channels
    qk_norm = "blocks.0.attn.q_norm.weight" in sd
    # DiT builds int(hidden * mlp_ratio) channels and fc1 rows / hidden can round below the
    # exact ratio (61 / 56 * 56 = 60.99...): nudge it up so the stored width is rebuilt.
    mlp_ratio = mlp_hidden / hidden
    while int(hidden * mlp_ratio) < mlp_hidden:
        mlp_ratio = math.nextafter(mlp_ratio, math.inf)
    cfg = {
        "input_size": grid * patch,
        "patch_size": patch,
        "in_channels": in_channels,
        "hidden_size": hidden,
        "depth": depth,
        "mlp_ratio": mlp_ratio,
        "learn_sigma": learn_sigma,
        "qk_norm": qk_norm,
    }
    # The label table has a null row iff the model was trained with label dropout; the
    # released and reference models always are, so assume it (num_classes = rows - 1).
    cfg["num_classes"] = table - 1
    cfg["class_dropout_prob"] = 0.1
    named = [n for n, c in DIT_CONFIGS.items() if c["depth"] == depth and c["hidden_size"] == hidden and c["patch_size"] == patch]
    cfg["num_heads"] = DIT_CONFIGS[named[0]]["num_heads"] if named else max(1, hidden // 64)
    if attn_dim != hidden:  # head-pruned: exact heads with QK-norm (its weight has the head size)
        cfg["attn_dim"] = attn_dim
        head = sd["blocks.0.attn.q_norm.weight"].shape[0] if qk_norm else (64 if attn_dim % 64 == 0 else attn_dim)
        cfg["num_heads"] = attn_dim // head
    return cfg


def describe(cfg: dict[str, Any]) -> str:
    keys = ("depth", "hidden_size", "patch_size", "in_channels", "input_size", "num_classes", "learn_sigma")
    return ", ".join(f"{k}={cfg[k]}" for k in keys if k in cfg)


def check_dit_weights(model: nn.Module, sd: StateDict, source: str = "checkpoint") -> None:
    """Raise a ValueError naming both architectures if ``sd`` does not fit ``model`` exactly."""
    own = model.state_dict()
    sd = _clean(sd)
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    mismatched = [k for k in own if k in sd and tuple(own[k].shape) != tuple(sd[k].shape)]
    if missing or unexpected or mismatched:
        try:
            theirs = describe(infer_dit_config(sd))
        except ValueError:
            theirs = "not a DiT"
        mine = describe(
            {k: getattr(model, k) for k in ("depth", "hidden_size", "patch_size", "in_channels", "input_size", "num_classes", "learn_sigma")}
        )
        detail = "; ".join(
            part
            for part in (
                f"missing {missing[:4]}" if missing else "",
                f"unexpected {unexpected[:4]}" if unexpected else "",
                f"shape mismatch at {mismatched[:4]}" if mismatched else "",
            )
            if part
        )
        raise ValueError(
            f"{source} holds another architecture ({theirs}) than the configured model ({mine}): {detail}. "
            "Configure the model to match the checkpoint (or sample with the architecture inferred from it)."
        )


def load_dit_weights(model: nn.Module, sd: StateDict, source: str = "checkpoint") -> None:
    """``load_state_dict(strict=True)`` with an error that says which architecture the
    checkpoint holds when it is not the configured one."""
    check_dit_weights(model, sd, source)
    model.load_state_dict(_clean(sd), strict=True)


def to_reference_format(
    model_sd: StateDict, ema_sd: Optional[StateDict], args: Optional[dict] = None, opt: Optional[dict] = None
) -> dict[str, Any]:
    """The reference training-checkpoint layout ``{model, ema, opt, args}`` (EMA under ``ema``)."""
    out: dict[str, Any] = {
        "model": {k: v.detach().cpu().contiguous() for k, v in model_sd.items()},
        "ema": {k: v.detach().cpu().contiguous() for k, v in (ema_sd or model_sd).items()},
        "args": dict(args or {}),
    }
    if opt is not None:
        out["opt"] = opt
    return out
