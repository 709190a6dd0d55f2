"""``dit-lightning prepare-digits``: the demo's pixel store from scikit-learn's bundled digits, and the
small encoder that stands in for DINOv2 when the demo trains with REPA."""

from __future__ import annotations

import os
from typing import Optional

from ..data.digits import prepare_digits as write_digits_store

# The demo's held-out split (configs/demo.yaml: data.val_size; the DataModule's default split_seed).
DEMO_VAL_SIZE, DEMO_SPLIT_SEED = 197, 0


def write_digits_encoder(
    store: str,
    output: str,
    val_size: int = DEMO_VAL_SIZE,
    split_seed: int = DEMO_SPLIT_SEED,
    steps: int = 400,
    seed: int = 0,
) -> str:
    """Train REPA's stand-in encoder (:class:`~dit_lightning.models.repa.DigitsEncoder`, a classifier
    of 4x4 patch features) on the store's train split, the images the DiT trains on (never the
    held-out split, which the evaluation's own classifier scores), and save its weights atomically to
    ``output``; an existing file is kept."""
    if os.path.exists(output):
        return output
    import torch

    from ..atomic import save_torch
    from ..data import LatentStore
    from ..data.datamodule import split_indices
    from ..models.repa import train_digits_encoder

    data = LatentStore(store)
    train, _ = split_indices(len(data), val_size, split_seed)
    x = torch.from_numpy(data.read(train, flip=0)[:, 0].astype("float32"))  # the pixels in [-1, 1]
    y = torch.from_numpy(data.read_labels(train)).long()
    print(f"training REPA's stand-in encoder on the digits train split ({len(train)} images)", flush=True)
    net = train_digits_encoder((x + 1) / 2, y, steps=steps, seed=seed)
    save_torch(net.state_dict(), output)
    return output


def prepare_digits(
    output: str = "data/digits",
    size: int = 8,
    overwrite: bool = False,
    encoder: Optional[str] = None,
    encoder_steps: int = 400,
) -> str:
    """Write the digits store (1,797 images, 10 classes; offline) to ``output`` and return its path.

    Args:
        output: the store directory; an existing digits store of the same size is kept as it is.
        size: side of the images: 8 (the originals) or a multiple of 8 (nearest upsampling).
        overwrite: replace an existing store of other settings at ``output``.
        encoder: also train the small encoder REPA aligns with on the demo (DINOv2's stand-in: it never
            saw 8x8 digits) on the store's train split, and save its weights to this file (kept if it
            exists): ``--model.repa.weights`` of the demo's REPA run (docs/recipes.md).
        encoder_steps: the encoder's training steps (batches of 128).
    """
    path = write_digits_store(output, size=size, overwrite=overwrite)
    print(f"digits store ready at {path}")
    if encoder:
        if encoder_steps < 1:
            raise ValueError(f"--encoder_steps {encoder_steps}: train the encoder for at least 1 step (400 by default)")
        print(f"REPA's digits encoder ready at {write_digits_encoder(path, encoder, steps=encoder_steps)}")
    return path
