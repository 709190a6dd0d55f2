"""``dit-lightning export``: any checkpoint -> the reference ``{model, ema, opt, args}`` file, a raw
state dict, a weights-only ``.safetensors`` file, or a diffusers ``DiTPipeline`` directory."""

from __future__ import annotations

import sys
from typing import Optional

from ..checkpoints import ExportFormat, Weights, export_checkpoint
from ..sampling import DiffusersSampler
from ..signals import on_stop, safe_points
from .output import check_new_output


def export(
    checkpoint: str,
    output: str,
    format: ExportFormat = "reference",
    include_optimizer: bool = True,
    weights: Weights = "ema",
    scheduler: DiffusersSampler = "dpm++2m",
    store: Optional[str] = None,
    vae: Optional[str] = None,
    overwrite: bool = False,
) -> str:
    """Export a checkpoint for the reference sampling scripts, diffusers and other DiT users.

    Args:
        checkpoint: a Lightning checkpoint of DiTModule, a sharded checkpoint directory, a
            diffusers DiT directory, a ``.safetensors`` file, or any supported DiT checkpoint.
        output: the file to write (``.pt``; ``.safetensors`` for ``safetensors``), or the
            directory for ``diffusers`` (written next to it and renamed into place; an earlier
            export there is replaced, any other existing directory refused).
        format: ``reference`` writes ``{model, ema, opt, args}`` (EMA weights under ``ema``, the
            architecture under ``args["model_config"]``); ``raw`` one state dict, like the
            released ``DiT-XL-2-256x256.pt``, and the architecture in ``<output>.json`` beside
            it (read back by ``sample`` and every other reader); ``safetensors`` one state dict
            loadable without pickle, the settings in its metadata; ``diffusers`` a directory that
            ``DiTPipeline.from_pretrained`` loads offline (transformer, scheduler, VAE when it
            can be written offline, ``id2label``, a README on loading it exactly).
        include_optimizer: keep the optimiser state under ``opt`` (reference format only).
        weights: the weights of ``raw``, ``safetensors`` and ``diffusers``: ``ema`` (default;
            the trained ones when there is no EMA) or ``raw``.
        scheduler: the diffusers scheduler written to ``scheduler/`` (the model's betas); users
            can swap it with ``from_config``.
        store: the latent store the model trained on (class names, VAE, scale factor); default
            the store a Lightning checkpoint records, when it exists here.
        vae: override the VAE of a diffusers export (hub id, local directory, ``none/pixels``).
        overwrite: replace an existing ``output`` (otherwise it is an error; a directory is
            replaced only when it is an earlier diffusers export).
    """
    check_new_output(output, overwrite, directory=format == "diffusers")
    report: dict = {}

    def stopped() -> str:
        if report:
            return f"{output} was written whole just before"
        return f"nothing was written ({output} is written whole or not at all); run the same command again"

    # A signal stops after the checkpoint is read, before anything is written; one during the
    # writing lets it finish (the file, or a raw file and its .json, all or nothing).
    with safe_points(), on_stop(stopped):
        report = export_checkpoint(
            checkpoint, output, format=format, include_optimizer=include_optimizer, weights=weights,
            scheduler=scheduler, store=store, vae=vae,
        )  # fmt: skip
    for note in report.get("notes", []):
        print(f"note: {note}", file=sys.stderr)
    print(f"exported {checkpoint} -> {output} ({format} format)")
    left_out = list(report.get("left_out", []))
    if report.get("vae_status") == "pixels":
        left_out.append("vae/ (a pixel model: it generates pixels, there is nothing to decode)")
    elif report.get("vae_status") == "missing":
        left_out.append(f"vae/ (could not be written offline: {report.get('vae_note')}; see the note above)")
    for what in left_out:
        print(f"  left out: {what}")
    return output
