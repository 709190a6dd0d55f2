"""A feature extractor for FID / KID tests: no Inception weights can be downloaded here."""

import torch
import torch.nn.functional as F
from torch import nn


class TinyFeatures(nn.Module):
    """uint8 (N, 3, H, W) -> (N, 4 * channels): a fixed random conv, tanh, 2x2 average pooling."""

    def __init__(self, seed: int = 0, channels: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.conv = nn.Conv2d(3, channels, 3, stride=2)
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape, generator=g))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return F.adaptive_avg_pool2d(torch.tanh(self.conv(x.float() / 255 - 0.5)), 2).flatten(1)
