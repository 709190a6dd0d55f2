"""Writing DiT weights in the reference formats: ``{model, ema, opt, args}`` and raw state dicts.

Every file written here records the full architecture under ``args["model_config"]`` (read back
by :func:`~dit_lightning.checkpoints.architecture.dit_config_of`), and is written atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

from ..atomic import save_torch
from ..models.config import model_config
from ..models.dit import DiT
from .architecture import dit_config_of
from .formats import StateDict, read_checkpoint

ExportFormat = Literal["reference", "raw"]
_PLAIN = (int, float, str, bool, list, tuple, dict, type(None))


def _cpu(sd: StateDict) -> StateDict:
    return {k: v.detach().cpu().contiguous() for k, v in sd.items()}


def to_reference_format(
    model_sd: StateDict, ema_sd: Optional[StateDict], args: Optional[dict] = None, opt: Optional[dict] = None
) -> dict[str, Any]:
    """The reference training-checkpoint layout ``{model, ema, opt, args}`` (EMA under ``ema``)."""
    out: dict[str, Any] = {"model": _cpu(model_sd), "ema": _cpu(ema_sd or model_sd), "args": dict(args or {})}
    if opt is not None:
        out["opt"] = opt
    return out


def save_dit(
    model: DiT, path: Union[str, Path], ema: Optional[DiT] = None, extra_args: Optional[dict[str, Any]] = None
) -> str:
    """Write a live DiT in the reference format ``{model, ema, args}``, its configuration in
    ``args["model_config"]`` and the flat DiT arguments (``depth``, ``num_heads``...) next to it,
    so that ``init_from``, ``sample`` and ``export`` rebuild it exactly."""
    cfg = model_config(model)
    args: dict[str, Any] = {"model": "custom", **cfg, "model_config": cfg, **(extra_args or {})}
    ema_sd = ema.state_dict() if ema is not None else None
    save_torch(to_reference_format(model.state_dict(), ema_sd, args=args), path)
    return str(path)


def export_checkpoint(
    checkpoint: str, output: str, format: ExportFormat = "reference", include_optimizer: bool = True
) -> str:
    """Export any supported checkpoint (a sharded directory included) for the reference scripts.

    ``reference`` writes ``{model, ema, opt, args}`` (EMA weights under ``ema``, the optimiser
    state keyed by parameter position, the architecture in ``args["model_config"]``, the step
    and epoch of a Lightning checkpoint); ``raw`` the EMA state dict alone, like the released
    ``DiT-XL-2-256x256.pt``. Written atomically; a sharded directory is merged next to ``output``.
    """
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    ckpt = read_checkpoint(checkpoint, tmp_dir=out.parent)
    ema_sd = ckpt.weights("ema")
    obj: dict[str, Any]
    cfg, _ = dit_config_of(ckpt)
    args = {k: v for k, v in {**ckpt.args, "model_config": cfg}.items() if isinstance(v, _PLAIN)}
    args.update({k: ckpt.meta[k] for k in ("epoch", "global_step") if isinstance(ckpt.meta.get(k), int)})
    if format == "raw":
        obj = _cpu(ema_sd)
    else:
        obj = to_reference_format(ckpt.model, ema_sd, args=args, opt=ckpt.optimizer if include_optimizer else None)
    save_torch(obj, out)
    if format == "raw":  # a bare state dict has no room for the architecture: record it beside the file
        from .sidecar import write_sidecar

        write_sidecar(out, args)
    return str(out)
