"""REG's SiT checkpoints (Wu et al. 2025, github.com/Martinser/REG, ``models/sit.py``) as DiTs with a
class token (``DiT(class_token_dim=D)``).

REG's SiT is REPA's (github.com/sihyun-yu/REPA) plus the class token; its state dict differs from
this project's DiT in names, one row of ``pos_embed`` and its time convention:

- names: ``cls_projectors2.*`` -> ``cls_embedder.proj.*``, ``wg_norm.*`` -> ``cls_embedder.norm.*``
  (``final_layer.linear_cls.*`` keeps its name); REPA's projector ``projectors.*`` is dropped: it
  trains the alignment and sampling never uses it (a flow run of this project trains its own);
- ``pos_embed`` is (1, 1 + T, hidden) with the class token's zero row first: checked zero and dropped
  (the DiT puts the token first with no position embedding);
- time: REG (as REPA) runs from data (t = 0) to noise (t = 1) and predicts ``noise - data``, this
  project's flow objective (SiT's) from noise (t = 0) to data and predicts ``data - noise``. The
  network at time t here is REG's at ``1 - t``, negated. Both are exact changes of weights: the
  output layers (``final_layer.linear`` and ``linear_cls``) negated, and the sinusoidal embedding of
  ``1 - t``, per frequency f ``cos(f - f t) = cos f cos(f t) + sin f sin(f t)`` and ``sin(f - f t) =
  sin f cos(f t) - cos f sin(f t)``, a rotation of the embedding of t, folded into the first linear
  map of ``t_embedder`` (computed in float64). So the loaded network samples with every flow sampler
  and is REG's to rounding.

A REG ``train.py`` checkpoint (``{"model", "ema", "opt", "args"}``) or a raw REG state dict is read
(:func:`~.formats.read_checkpoint`) as the DiT it is, so ``load_dit``, ``sample``, ``predict``,
``init_from`` and the exports take it as any other; its arguments are read as SiT's (``prediction``
``v`` is velocity, ``path_type`` ``cosine`` REG's ``alpha = cos``, ``sigma = sin`` in its time, which
is the GVP path in ours; ``model: SiT-B/2`` names DiT-B/2's heads, as for SiT's own checkpoints). Its
optimiser state is left out: it is keyed by parameter position and covers REPA's projector.

Pure PyTorch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .formats import DiTCheckpoint

StateDict = dict[str, Tensor]  # (formats.StateDict; not imported: formats reads through this module)

REG_RENAMES = (("cls_projectors2.", "cls_embedder.proj."), ("wg_norm.", "cls_embedder.norm."))
_DROPPED = ("projectors.",)  # REPA's alignment projector: training only


def is_reg_state_dict(sd: StateDict) -> bool:
    """REG's SiT: its class-token entry ``cls_projectors2`` (this project's DiT calls it ``cls_embedder``)."""
    return "cls_projectors2.weight" in sd


def _reversed_time_embedding(weight: torch.Tensor) -> torch.Tensor:
    """The first linear map of ``t_embedder`` that reads the embedding of t as the original read that
    of ``1 - t`` (the embedding is ``cat([cos(t f), sin(t f)])``, f = 10000^(-i / half))."""
    half = weight.shape[1] // 2
    # the frequencies as both networks compute them, in float32
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half).double()
    cos_f, sin_f = torch.cos(freqs), torch.sin(freqs)
    w = weight.double()
    w_cos, w_sin = w[:, :half], w[:, half : 2 * half]
    new = w.clone()
    new[:, :half] = w_cos * cos_f + w_sin * sin_f
    new[:, half : 2 * half] = w_cos * sin_f - w_sin * cos_f
    return new.to(weight.dtype)


def reg_state_dict(sd: StateDict, source: str = "the state dict") -> StateDict:
    """A REG SiT state dict as this project's DiT's (``class_token_dim`` = the width of
    ``cls_projectors2``): the names mapped, the token's zero position row dropped, REPA's projector
    dropped, and REG's time and velocity sign turned into the flow objective's (module docstring)."""
    if not is_reg_state_dict(sd):
        raise ValueError(f"{source} is not REG's SiT (no cls_projectors2.weight)")
    pos = sd.get("pos_embed")
    if pos is None or pos.dim() != 3 or pos.shape[1] < 2:
        raise ValueError(
            f"{source}: REG's SiT has a pos_embed of shape (1, 1 + T, hidden), got {pos and tuple(pos.shape)}"
        )
    if torch.count_nonzero(pos[:, 0]):
        raise ValueError(
            f"{source}: the first row of pos_embed (REG's class-token position) is not zero, so the token "
            "had a position embedding, which this DiT does not give it: not a REG SiT checkpoint this project "
            "can load exactly"
        )
    out: StateDict = {}
    for name, value in sd.items():
        if name.startswith(_DROPPED):
            continue
        for old, new in REG_RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
        out[name] = value
    out["pos_embed"] = pos[:, 1:].clone()
    out["t_embedder.mlp.0.weight"] = _reversed_time_embedding(sd["t_embedder.mlp.0.weight"])
    for name in ("final_layer.linear.weight", "final_layer.linear.bias"):
        out[name] = -sd[name]
    for name in ("final_layer.linear_cls.weight", "final_layer.linear_cls.bias"):
        if name in sd:
            out[name] = -sd[name]
    return out


_REG_PATHS = {"linear": "linear", "cosine": "gvp"}


def reg_args(args: dict[str, Any]) -> dict[str, Any]:
    """REG's ``train.py`` arguments as the settings this project reads (module docstring)."""
    out = dict(args)
    path = str(args.get("path_type") or "linear").lower()
    if path not in _REG_PATHS:
        raise ValueError(f"REG checkpoint with path_type {args.get('path_type')!r}: REG trains linear or cosine")
    out["path_type"] = _REG_PATHS[path]
    if str(args.get("prediction") or "v") == "v":
        out["prediction"] = "velocity"
    return out


def from_reg(ckpt: DiTCheckpoint) -> DiTCheckpoint:
    """``ckpt`` (a REG checkpoint read as reference or raw weights) as this project's DiT: its weight
    sets through :func:`reg_state_dict`, its arguments through :func:`reg_args`, no optimiser state."""
    source = f"checkpoint '{ckpt.path}'"
    model = reg_state_dict(ckpt.model, source)
    ema = model if ckpt.ema is ckpt.model else (reg_state_dict(ckpt.ema, source) if ckpt.ema is not None else None)
    args = reg_args(ckpt.args) if ckpt.args else {}
    note = (
        f"'{ckpt.path}' is REG's SiT (github.com/Martinser/REG): read in this project's flow time (REG's "
        "time and velocity sign folded into the weights), REPA's projector and the optimiser state left out"
    )
    meta = {**ckpt.meta, "notes": [*ckpt.meta.get("notes", []), note]}
    return dataclasses.replace(ckpt, model=model, ema=ema, args=args, optimizer=None, meta=meta)
