"""``dit-lightning export``: any checkpoint -> the reference ``{model, ema, opt, args}`` file or a raw
EMA state dict (what the reference sampling scripts and other DiT users read)."""

from __future__ import annotations

from ..checkpoints import ExportFormat, export_checkpoint
from .output import check_new_output


def export(
    checkpoint: str,
    output: str,
    format: ExportFormat = "reference",
    include_optimizer: bool = True,
    overwrite: bool = False,
) -> str:
    """Export a checkpoint for the reference sampling scripts and other DiT users.

    Args:
        checkpoint: a Lightning checkpoint of DiTModule, a sharded checkpoint directory, or any
            supported DiT checkpoint.
        output: the ``.pt`` file to write (atomically).
        format: ``reference`` writes ``{model, ema, opt, args}`` (EMA weights under ``ema``, the
            architecture under ``args["model_config"]``); ``raw`` writes the EMA state dict
            alone, like the released ``DiT-XL-2-256x256.pt``, and the architecture in
            ``<output>.json`` beside it (read back by ``sample`` and every other reader).
        include_optimizer: keep the optimiser state under ``opt`` (reference format only).
        overwrite: replace an existing ``output`` (otherwise an existing file is an error).
    """
    check_new_output(output, overwrite)
    export_checkpoint(checkpoint, output, format=format, include_optimizer=include_optimizer)
    print(f"exported {checkpoint} -> {output} ({format} format)")
    return output
