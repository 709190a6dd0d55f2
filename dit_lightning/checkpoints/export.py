"""Writing DiT weights in the reference formats: ``{model, ema, opt, args}`` and raw state dicts;
and (through :mod:`.diffusers_export`) as a diffusers ``DiTPipeline`` directory or a
weights-only ``.safetensors`` file.

Every file written here records the full architecture under ``args["model_config"]`` (read back
by :func:`~dit_lightning.checkpoints.architecture.dit_config_of`), and is written atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

from ..atomic import save_torch
from ..models.config import model_config
from ..models.dit import DiT
from ..sampling.schedulers import DiffusersSampler
from ..signals import stop_point
from .architecture import dit_config_of, export_args
from .diffusers_export import export_diffusers, export_safetensors
from .formats import StateDict, Weights, read_checkpoint

ExportFormat = Literal["reference", "raw", "diffusers", "safetensors"]


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
    checkpoint: str,
    output: str,
    format: ExportFormat = "reference",
    include_optimizer: bool = True,
    weights: Weights = "ema",
    scheduler: DiffusersSampler = "dpm++2m",
    store: Optional[str] = None,
    vae: Optional[str] = None,
) -> dict[str, Any]:
    """Export any supported checkpoint (a sharded directory or a diffusers DiT included).

    ``reference`` writes ``{model, ema, opt, args}`` (EMA weights under ``ema``, the optimiser
    state keyed by parameter position, the architecture in ``args["model_config"]``, the step
    and epoch of a Lightning checkpoint); ``raw`` one state dict alone, like the released
    ``DiT-XL-2-256x256.pt``; ``safetensors`` one state dict as a ``.safetensors`` file with the
    settings in its metadata; ``diffusers`` a ``DiTPipeline`` directory (see
    :func:`~.diffusers_export.export_diffusers`: ``scheduler``, ``store``, ``vae``). ``weights``:
    which set the single-set formats hold, ``ema`` (default; the trained weights when there is
    no EMA) or ``raw``. Written atomically; a sharded directory is merged next to ``output``.
    Returns what was written (``output``, ``format``, ``notes`` for the user, and ``left_out``: what the
    checkpoint holds that the export does not, e.g. a REPA projector).
    """
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    ckpt = read_checkpoint(checkpoint, tmp_dir=out.parent)
    stop_point()  # read, nothing written yet: where a signal stops an export (dit_lightning.signals)
    # What a training checkpoint holds beyond the network, which no format carries: the caller says so
    projector = ckpt.format in ("lightning", "sharded") and bool(ckpt.args.get("repa"))
    left_out = ["the REPA projector (training only: sampling never uses it)"] if projector else []
    if format == "diffusers":
        written = export_diffusers(ckpt, out, weights, scheduler=scheduler, store=store, vae=vae)
        return {"format": format, **written, "left_out": left_out}
    if format == "safetensors":
        return {"format": format, **export_safetensors(ckpt, out, weights), "left_out": left_out}
    obj: dict[str, Any]
    args = export_args(ckpt, dit_config_of(ckpt)[0])
    if format == "raw":
        obj = _cpu(ckpt.weights(weights))
    else:
        obj = to_reference_format(
            ckpt.model, ckpt.weights("ema"), args=args, opt=ckpt.optimizer if include_optimizer else None
        )
    save_torch(obj, out)
    if format == "raw":  # a bare state dict has no room for the architecture: record it beside the file
        from .sidecar import write_sidecar

        write_sidecar(out, args)
    return {"output": str(out), "format": format, "notes": [], "left_out": left_out}
