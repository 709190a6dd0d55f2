"""``dit-lightning consolidate``: a sharded (FSDP) checkpoint directory -> one file a plain DiT loads."""

from __future__ import annotations

from ..checkpoints import ExportFormat, export_checkpoint
from .output import check_new_output


def consolidate(
    checkpoint: str,
    output: str,
    format: ExportFormat = "reference",
    include_optimizer: bool = True,
    overwrite: bool = False,
) -> str:
    """Turn a sharded checkpoint directory (FSDP2 / FSDP1 ``state_dict_type="sharded"``) into a
    single-file checkpoint a plain DiT loads with ``strict=True`` (a single-file checkpoint is
    exported as by ``dit-lightning export``).

    Args:
        checkpoint: the checkpoint directory (e.g. ``checkpoints/last.ckpt/``).
        output: the ``.pt`` file to write (atomically).
        format: ``reference`` writes ``{model, ema, opt, args}`` like the reference training
            script (EMA under ``ema``); ``raw`` writes the EMA state dict alone, like the
            released ``DiT-XL-2-256x256.pt``.
        include_optimizer: keep the AdamW state under ``opt``, keyed by parameter position
            over the trainable parameters (reference format only).
        overwrite: replace an existing ``output`` (otherwise an existing file is an error).

    Runs in one process, without a process group; needs host memory for the whole state.
    """
    check_new_output(output, overwrite)
    export_checkpoint(checkpoint, output, format=format, include_optimizer=include_optimizer)
    print(f"consolidated {checkpoint} -> {output} ({format} format)")
    return output
