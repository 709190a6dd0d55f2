"""A tiny encoder with a class token for REG's tests: the digits encoder's 16 patch features after
its class token (the first output token, ``prefix_tokens = 1``), as DINOv2's output starts with its
normalised CLS token."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dit_lightning.models.repa import DigitsEncoder


class ClassTokenDigitsEncoder(DigitsEncoder):
    """Images in [0, 1], (N, 1, 8, 8) -> (N, 1 + 16, 64): a class token, then the patch features."""

    prefix_tokens = 1

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Linear(64, 64)

    def forward(self, images: Tensor) -> Tensor:
        patches = super().forward(images)
        token = F.layer_norm(self.cls(patches.mean(dim=1)), (64,))  # normalised, as x_norm_clstoken
        return torch.cat([token[:, None], patches], dim=1)
