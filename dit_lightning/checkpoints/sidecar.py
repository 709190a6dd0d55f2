"""The record next to a raw export: ``<file>.json`` beside ``<file>`` (a bare state dict, like the
released ``DiT-XL-2-256x256.pt``, has no place for the architecture or the diffusion settings).

``dit-lightning export --format raw`` writes it (atomically, after the weights); every reader of
checkpoints (:func:`~dit_lightning.checkpoints.read_checkpoint`) takes the recorded settings from
it, so ``sample`` rebuilds the exported network exactly (its heads included). The record names the
size of the weights file it describes: a record left beside another file is ignored, with a note.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

from ..atomic import write_json

SIDECAR_FORMAT = "dit-lightning-raw-export"


def sidecar_path(path: Union[str, Path]) -> Path:
    return Path(f"{os.fspath(path)}.json")


def write_sidecar(path: Union[str, Path], args: dict[str, Any]) -> Path:
    """Record ``args`` (the architecture under ``model_config``, diffusion and VAE settings) for
    the raw weights file ``path``."""
    record = {
        "format": SIDECAR_FORMAT,
        "format_version": 1,
        "weights_file": os.path.basename(os.fspath(path)),
        "weights_bytes": os.path.getsize(path),
        "args": args,
    }
    return write_json(sidecar_path(path), record)


def read_sidecar(path: Union[str, Path]) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """(recorded args, None), or (None, why the record beside ``path`` was not used), or (None, None)
    when there is no record."""
    side = sidecar_path(path)
    if not side.is_file():
        return None, None
    try:
        record = json.loads(side.read_text())
    except (OSError, ValueError) as e:
        return None, f"{side} is unreadable ({type(e).__name__}); its settings were not used"
    if (
        not isinstance(record, dict)
        or record.get("format") != SIDECAR_FORMAT
        or not isinstance(record.get("args"), dict)
    ):
        return None, f"{side} is not a {SIDECAR_FORMAT} record; its settings were not used"
    if record.get("weights_bytes") != os.path.getsize(path):
        return None, (
            f"{side} describes another file ({record.get('weights_bytes')} bytes, {path} has "
            f"{os.path.getsize(path)}): its settings were not used"
        )
    return dict(record["args"]), None
