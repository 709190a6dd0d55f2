"""Reading DiT checkpoints in every format users meet, with ``torch.load(weights_only=True)``.

- raw state dict: the released ``DiT-XL-2-256x256.pt`` (EMA weights, no wrapper keys);
- the reference training format ``{"model", "ema", "opt", "args"}`` (``args`` an
  ``argparse.Namespace`` or a dict), which ``dit-lightning export`` and ``prune`` also write;
- Lightning checkpoints of :class:`~dit_lightning.module.DiTModule` (``state_dict`` with
  ``model.`` and ``ema.`` prefixes, ``hyper_parameters``);
- sharded Lightning checkpoint directories (``torch.distributed.checkpoint``, written by the
  FSDP strategies), merged in one process (:mod:`.sharded`);
- diffusers' DiT: a ``DiTPipeline`` directory or its ``transformer/`` folder, names mapped by
  the one rule of :mod:`.diffusers_format` (weights: safetensors, or ``.bin`` read weights-only);
- ``.safetensors`` files: ``export --format safetensors`` (the settings in its metadata), raw
  state dicts, or a diffusers transformer's weights file next to its ``config.json``.

Every set of weights read is checked to be finite (:func:`check_finite`): a checkpoint holding NaN
or inf is refused before any work with one message that names the file and the tensor (sampling
it would write black images, fine-tuning from it would stop at its first step).
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor

StateDict = dict[str, Tensor]
Format = Literal["raw", "reference", "lightning", "sharded", "diffusers", "safetensors"]
Weights = Literal["ema", "raw"]

# Prefixes wrappers add to parameter names: torch.compile's and DDP's.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def strip_prefix(sd: StateDict, prefix: str) -> StateDict:
    """The entries of ``sd`` under ``prefix``, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}


def clean_state_dict(sd: StateDict) -> StateDict:
    """Drop wrappers' prefixes (torch.compile's ``_orig_mod.``, DDP's ``module.``)."""
    out = {}
    for k, v in sd.items():
        for p in _WRAPPER_PREFIXES:
            k = k.replace(p, "")
        out[k] = v
    return out


@dataclass
class DiTCheckpoint:
    """The DiT weights of a checkpoint and what the file records about them.

    ``model`` are the trained weights, ``ema`` the EMA weights (None when the file has none; a
    raw released state dict *is* EMA weights and fills both). ``args`` are the recorded settings:
    the Lightning hyper-parameters or the reference script's arguments (empty when none).
    ``optimizer`` is the first optimiser's state keyed by parameter position, ``meta`` the
    Lightning bookkeeping (``epoch``, ``global_step``...).
    """

    path: str
    format: Format
    model: StateDict
    ema: Optional[StateDict] = None
    args: dict[str, Any] = field(default_factory=dict)
    optimizer: Optional[dict[str, Any]] = None
    meta: dict[str, Any] = field(default_factory=dict)

    def weights(self, which: Union[Weights, Literal["model"]] = "ema") -> StateDict:
        """The EMA weights (falling back to the trained ones when there are none) or the trained ones."""
        if which == "ema" and self.ema is not None:
            return self.ema
        return self.model

    def has_ema(self) -> bool:
        return self.ema is not None


class NonFiniteWeightsError(ValueError):
    """A checkpoint whose DiT weights hold NaN or inf; the message names the file and the tensor."""


def nonfinite_tensors(sd: StateDict) -> list[str]:
    """The names of the floating-point tensors of ``sd`` that hold a NaN or an inf, in order."""
    return [
        k
        for k, v in sd.items()
        if isinstance(v, Tensor) and v.is_floating_point() and v.numel() and not bool(torch.isfinite(v).all())
    ]


def nonfinite_message(source: str, bad: dict[str, list[str]]) -> str:
    """One line for ``source`` whose weight sets ``bad`` (e.g. ``{"EMA weights": [tensor names]}``)
    hold NaN / inf: the problem, the first tensor and the fix."""
    sets = [which for which, names in bad.items() if names]
    first = bad[sets[0]]
    more = f" and {len(first) - 1} more" if len(first) > 1 else ""
    return (
        f"{source} holds NaN/inf in its {' and '.join(sets)} (tensor '{first[0]}'{more}): it would sample black "
        "images and train NaN losses. Use an earlier checkpoint (the run diverged before this one was saved)."
    )


def check_finite(ckpt: DiTCheckpoint) -> None:
    """Raise :class:`NonFiniteWeightsError` when a weight set of ``ckpt`` (EMA or trained) holds NaN or inf."""
    sets: dict[str, StateDict] = {}
    if ckpt.ema is not None and ckpt.ema is not ckpt.model:
        sets["EMA weights"] = ckpt.ema
    sets["trained weights" if sets else "weights"] = ckpt.model
    bad = {which: nonfinite_tensors(sd) for which, sd in sets.items()}
    if any(bad.values()):
        raise NonFiniteWeightsError(nonfinite_message(f"checkpoint '{ckpt.path}'", bad))


def _from_lightning(path: str, ckpt: dict[str, Any], fmt: Format) -> DiTCheckpoint:
    sd = clean_state_dict(ckpt["state_dict"])
    model, ema = strip_prefix(sd, "model."), strip_prefix(sd, "ema.")
    if not model:
        raise ValueError(f"'{path}' holds no DiT weights under 'model.' (keys: {sorted(sd)[:6]})")
    hp = ckpt.get("hyper_parameters")
    states = ckpt.get("optimizer_states") or []
    meta: dict[str, Any] = {k: ckpt[k] for k in ("epoch", "global_step", "pytorch-lightning_version") if k in ckpt}
    data = ckpt.get("datamodule_hyper_parameters")
    if isinstance(data, dict):  # the store the run trained on (export reads its class names)
        meta["datamodule"] = dict(data)
    state = states[0] if states else None
    if state is not None and any(k.startswith("repa_projector.") for k in sd):
        state = _dit_optimizer_state(state)
    return DiTCheckpoint(path, fmt, model, ema or None, dict(hp) if isinstance(hp, dict) else {}, state, meta)


def _from_reg_if_reg(ckpt: DiTCheckpoint) -> DiTCheckpoint:
    """REG's SiT weights (its ``cls_projectors2``) as this project's DiT's (:mod:`.reg`); others as they are."""
    from .reg import from_reg, is_reg_state_dict

    return from_reg(ckpt) if is_reg_state_dict(ckpt.model) else ckpt


def _dit_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """The optimiser state of the DiT's weights alone: a REPA run's projector trains in a second
    parameter group, which is no part of the network (nor of its reference checkpoint)."""
    groups = state.get("param_groups") or []
    if len(groups) < 2:
        return state
    keep = set(groups[0]["params"])
    return {**state, "param_groups": groups[:1], "state": {k: v for k, v in state["state"].items() if k in keep}}


def read_checkpoint(
    path: Union[str, Path], tmp_dir: Optional[Union[str, Path]] = None, finite: bool = True
) -> DiTCheckpoint:
    """Load any supported checkpoint file, sharded checkpoint directory or diffusers DiT.

    ``tmp_dir``: where a sharded directory is merged through a temporary file (default: next to it).
    ``finite``: refuse weights holding NaN / inf (:func:`check_finite`); only ``verify``, which
    reports them, reads such a file.
    """
    ckpt = _read(Path(path), tmp_dir)
    if finite:
        check_finite(ckpt)
    return ckpt


def _read(path: Path, tmp_dir: Optional[Union[str, Path]]) -> DiTCheckpoint:
    from .diffusers_format import is_diffusers_checkpoint, is_safetensors_file, read_diffusers, read_safetensors
    from .sharded import is_sharded_checkpoint, load_sharded_checkpoint

    if is_sharded_checkpoint(path):
        return _from_lightning(str(path), load_sharded_checkpoint(path, tmp_dir=tmp_dir), "sharded")
    if is_diffusers_checkpoint(path):
        weights, recorded, meta = read_diffusers(path)
        return DiTCheckpoint(str(path), "diffusers", weights, weights, recorded, None, meta)
    if path.is_dir():
        raise ValueError(
            f"'{path}' is a directory but no checkpoint: a sharded checkpoint has a .metadata file, a diffusers "
            "DiT a model_index.json with transformer/config.json (or is that transformer folder)"
        )
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    if is_safetensors_file(path):
        weights, recorded, meta = read_safetensors(path)
        weights = clean_state_dict(weights)
        return DiTCheckpoint(str(path), "safetensors", weights, weights, recorded, None, meta)
    from .safe_load import load_file

    ckpt = load_file(path)
    if not isinstance(ckpt, dict):
        raise ValueError(f"checkpoint '{path}' holds a {type(ckpt).__name__}, not a state dict")
    if "state_dict" in ckpt and isinstance(ckpt["state_dict"], dict):
        return _from_lightning(str(path), ckpt, "lightning")
    if "model" in ckpt and isinstance(ckpt["model"], dict):  # reference training format
        args = ckpt.get("args")
        args = vars(args) if isinstance(args, argparse.Namespace) else args
        ema = ckpt.get("ema")
        read = DiTCheckpoint(
            str(path),
            "reference",
            clean_state_dict(ckpt["model"]),
            clean_state_dict(ema) if isinstance(ema, dict) else None,
            dict(args) if isinstance(args, dict) else {},
            ckpt.get("opt") if isinstance(ckpt.get("opt"), dict) else None,
        )
        return _from_reg_if_reg(read)
    if "pos_embed" in ckpt or any(k.startswith("blocks.") for k in ckpt):  # raw (released) weights
        from .sidecar import read_sidecar

        sd = clean_state_dict(ckpt)
        sidecar, note = read_sidecar(path)  # `export --format raw` records the architecture beside the file
        if note:
            warnings.warn(note, stacklevel=2)
        return _from_reg_if_reg(DiTCheckpoint(str(path), "raw", sd, sd, sidecar or {}))
    raise ValueError(
        f"checkpoint '{path}' is not a DiT checkpoint: expected a raw DiT state dict, "
        f"{{model, ema, opt, args}} or a Lightning checkpoint; found keys {sorted(ckpt)[:8]}"
    )
