"""``dit-lightning verify``: check a latent store (or a checkpoint) against what was written, without
training: the files' sizes, the commit records against the index, each shard's sha256 against its
commit record, and NaN / inf values.

Opening a store for training checks only the sizes and the commit records (cheap); a shard corrupted
in place keeps its size, so its checksum is what finds it: run ``verify`` after copying a store, or
train with ``--data.verify_checksums true``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..data import store as st
from ..data.extract import REPA_FIXES


class VerificationError(ValueError):
    """What ``verify`` found wrong; the message lists it with the fix."""


def _verify_checkpoint(path: str) -> tuple[list[str], str]:
    from ..checkpoints import nonfinite_tensors, read_checkpoint

    # weights_only: refuses what is not plain tensors and containers; non-finite weights are reported below
    ckpt = read_checkpoint(path, finite=False)
    problems = []
    parts: dict[str, Any] = {"model": ckpt.model}
    if ckpt.ema is not None and ckpt.ema is not ckpt.model:
        parts["ema"] = ckpt.ema
    for part, sd in parts.items():
        bad = nonfinite_tensors(sd)
        if bad:
            problems.append(
                f"{path}: the {part} weights hold NaN or inf in {len(bad)} tensors (e.g. {bad[0]}): the run diverged "
                "before this checkpoint was written; use an earlier checkpoint"
            )
    count = sum(v.numel() for v in ckpt.model.values() if torch.is_tensor(v))
    return problems, f"{ckpt.format} checkpoint, {count:,} parameters, all finite"


def verify(path: str, checksums: bool = True, values: bool = True) -> dict[str, Any]:
    """Check a latent store or a checkpoint; exit with an error that lists every problem found.

    Args:
        path: a latent store directory (``dit-lightning extract`` / ``prepare-digits``), or a checkpoint
            (a ``.ckpt`` / ``.pt`` file or a sharded checkpoint directory): its weights must be finite.
        checksums: (stores) hash every shard and compare with the sha256 of its commit record.
        values: (stores) scan every shard for NaN / inf.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    is_store_dir = os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, name)) for name in (st.META_FILE, st.PLAN_FILE)
    )
    if is_store_dir:
        problems = st.verify_store(path, checksums=checksums, values=values, fixes=REPA_FIXES)
        checked = ["sizes"] + (["checksums"] if checksums else []) + (["values"] if values else [])
        if not problems:
            store = st.LatentStore(path)
            summary = f"store of {len(store)} samples in {store.num_shards} shards; {', '.join(checked)} ok"
    else:
        problems, summary = _verify_checkpoint(path)
    if problems:
        raise VerificationError(
            f"{path}: {len(problems)} problem(s):\n  " + "\n  ".join(problems) + "\n(nothing was changed)"
        )
    print(f"{path}: {summary}")
    return {"path": path, "ok": True, "summary": summary}
