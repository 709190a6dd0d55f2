"""Tiny DiTs for CPU tests (importable as tests.helpers.models).

A freshly built DiT outputs exactly 0 (adaLN-Zero and the output layer start at zero), so tests
that compare outputs use one of the randomised builders below.
"""

from __future__ import annotations

import torch

from dit_lightning.models import DiT


def tiny_dit_kwargs(**overrides):
    """A DiT small enough for CPU tests (a few thousand parameters)."""
    kw = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=4, num_classes=10)
    kw.update(overrides)
    return kw


def randomize(model: DiT) -> DiT:
    """Give the zero-initialised layers values so outputs exercise every path (N(0, 0.2) for every
    parameter but the fixed ``pos_embed``; draws from the global generator)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.normal_(0, 0.2)
    return model


def randomized(**overrides) -> DiT:
    """A tiny DiT of depth 3 (:func:`tiny_dit_kwargs`), :func:`randomize`\\ d, in eval mode."""
    return randomize(DiT(**tiny_dit_kwargs(depth=3, **overrides))).eval()


def random_dit(seed=0, **kw):
    """A tiny DiT whose adaLN-Zero layers are not zero (a fresh DiT outputs exactly 0): seeded
    initialisation plus N(0, 0.02) on every trainable parameter, in eval mode."""
    cfg = tiny_dit_kwargs(**kw)
    torch.manual_seed(seed)
    net = DiT(**cfg).eval()
    with torch.no_grad():
        for p in net.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.02)
    return net


def inputs(n: int = 4):
    """Fixed ``(x, t, y)`` for a 4-channel 8 x 8 DiT with 10 classes (``n`` <= 4)."""
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 4, 8, 8, generator=g), torch.tensor([0, 10, 500, 999])[:n], torch.tensor([1, 2, 10, 7])[:n]
