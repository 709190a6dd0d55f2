"""DiTModule test settings (importable as tests.helpers.training): a tiny module on 1 x 8 x 8
"digits", a fixed random dataset, and a quiet CPU Trainer."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import Dataset

# DiTModule arguments of a tiny model on 1 x 8 x 8 "digits" (10 classes).
TINY_MODULE: dict[str, Any] = dict(
    model="custom", latent_shape=(1, 8, 8), num_classes=10, depth=2, hidden_size=32, num_heads=4, patch_size=2
)


class DictDataset(Dataset):
    """``n`` fixed random 1 x 8 x 8 samples in [-1, 1] as ``{"x", "y", "index"}`` batches."""

    def __init__(self, n: int = 32):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 1, 8, 8, generator=g).clamp(-1, 1)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "index": torch.tensor(i)}


def trainer(**kw):
    """A one-device CPU Trainer without logger, checkpoints, progress bar or model summary."""
    base = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    base.update(kw)
    return L.Trainer(**base)
