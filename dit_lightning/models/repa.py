"""REPA: representation alignment (Yu et al. 2024, "Representation Alignment for Generation").

The hidden states after block ``depth`` of the DiT, mapped by a small MLP (the projector), are pulled
towards the patch features a frozen pretrained encoder (DINOv2 on ImageNet) gives the clean image:
the loss adds ``coeff`` x the mean negative cosine similarity, per token, of the two. The projector
trains with the network and is dropped after training (the DiT alone samples).

This file holds the parts that are plain PyTorch: the options, the projector, the loss, the frozen
encoder's interface and a small encoder for the digits demo. :mod:`dit_lightning.models.encoders`
loads the real encoders (timm, transformers, a class path) from local files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class REPAOptions:
    """The REPA settings (``--model.repa.*``); no ``encoder``: REPA is off.

    Args:
        encoder: the frozen encoder whose patch features the DiT aligns with: ``dinov2-vitb14`` (REPA's
            ImageNet choice, timm's ViT-B/14 DINOv2), any timm model name, a ``save_pretrained``
            directory (transformers), or a class path (an ``nn.Module`` mapping images in [0, 1] to
            (N, T, D) patch features, e.g. ``dit_lightning.models.repa.DigitsEncoder``).
        weights: the encoder's local weights file (timm names and class paths; a ``save_pretrained``
            directory holds its own). Nothing is downloaded.
        depth: align the hidden states after this many blocks (8 in REPA for SiT-XL/2's 28).
        coeff: weight of the alignment loss (0.5 in REPA).
        projector_dim: width of the projector MLP (2048 in REPA).
        image_size: the encoder's input side; unset: the encoder's own (224 for DINOv2, REPA's
            resize of 256 px images).
        feature_dim: the width of the encoder's features; unset: read from the encoder (checkpoints
            record it, so that they load, sample and resume without the encoder).
        weights_sha256: the sha256 of the encoder's weights (of a directory's files); unset: hashed
            from ``weights`` (checkpoints record it: a resumed run with other weights is refused).
        class_token_weight: REG (Wu et al. 2025): the weight of the class token's velocity loss (REG's
            ``--cls`` 0.03); 0: no class token. The encoder's class token (DINOv2's normalised CLS)
            is noised at the latents' time, enters the DiT as one more token and is predicted back;
            the alignment target then has the class token first. Flow matching only.
        until_step: the alignment term contributes to the loss before this optimiser step only
            (HASTE's cut-off, arXiv 2505.16792: 250k of 400k); REG's class-token loss stays on (the
            sampler denoises the token at every step). Unset: always on (REPA, REG).
    """

    encoder: Optional[str] = None
    weights: Optional[str] = None
    depth: int = 8
    coeff: float = 0.5
    projector_dim: int = 2048
    image_size: Optional[int] = None
    feature_dim: Optional[int] = None
    weights_sha256: Optional[str] = None
    class_token_weight: float = 0.0
    until_step: Optional[int] = None

    @property
    def enabled(self) -> bool:
        return bool(self.encoder)

    def check(self, num_blocks: int) -> None:
        """Refuse settings that cannot work with a DiT of ``num_blocks`` blocks."""
        if not 1 <= self.depth <= num_blocks:
            raise ValueError(
                f"model.repa.depth {self.depth}: the DiT has {num_blocks} blocks; align after block 1..{num_blocks} "
                "(REPA uses 8 of SiT-XL/2's 28)"
            )
        if self.coeff < 0:
            raise ValueError(f"model.repa.coeff must be >= 0, got {self.coeff}")
        if self.projector_dim < 1:
            raise ValueError(f"model.repa.projector_dim must be positive, got {self.projector_dim}")
        if self.class_token_weight < 0:
            raise ValueError(f"model.repa.class_token_weight must be >= 0 (REG: 0.03), got {self.class_token_weight}")
        if self.until_step is not None and self.until_step < 0:
            raise ValueError(f"model.repa.until_step must be >= 0 (an optimiser step), got {self.until_step}")

    @property
    def class_token(self) -> bool:
        """Whether REG's class token is on."""
        return self.class_token_weight > 0

    def aligns_at(self, step: int) -> bool:
        """Whether the alignment term counts at optimiser step ``step`` (``until_step``'s cut-off)."""
        return self.until_step is None or step < self.until_step


class Projector(nn.Sequential):
    """REPA's projector: Linear -> SiLU -> Linear -> SiLU -> Linear, from the DiT's width to the
    encoder's feature width, applied to every token; Xavier-uniform weights and zero biases (the
    initialisation REPA's network applies to all its linear layers)."""

    def __init__(self, hidden_size: int, projector_dim: int, feature_dim: int) -> None:
        super().__init__(
            nn.Linear(hidden_size, projector_dim),
            nn.SiLU(),
            nn.Linear(projector_dim, projector_dim),
            nn.SiLU(),
            nn.Linear(projector_dim, feature_dim),
        )
        for layer in self:
            if isinstance(layer, nn.Linear):
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)


def alignment_loss(projected: Tensor, features: Tensor) -> Tensor:
    """Per-sample REPA loss: the mean over tokens of ``-cos(projected token, encoder token)``,
    (N, T, D) x (N, T, D) -> (N,). REPA's ``loss.py`` averages it over the batch."""
    if projected.shape != features.shape:
        raise ValueError(
            f"REPA: the projected DiT tokens {tuple(projected.shape)} and the encoder's patch features "
            f"{tuple(features.shape)} differ: the encoder must give one feature per DiT token"
        )
    p = F.normalize(projected.float(), dim=-1)
    f = F.normalize(features.float(), dim=-1)
    return -(p * f).sum(dim=-1).mean(dim=1)


class FeatureEncoder(nn.Module):
    """A frozen encoder as REPA uses it: images in [0, 1], (N, C, H, W) -> patch features (N, T, D).
    Subclasses (:mod:`.encoders`) wrap timm / transformers models with their normalisation."""

    feature_dim: int
    num_tokens: int


class ClassifierEncoder(nn.Module):
    """A small stand-in for DINOv2 trained as a classifier (:func:`train_digits_encoder`): its forward
    gives the tokens REPA aligns with, ``logits`` the classification it is trained by."""

    def logits(self, images: Tensor) -> Tensor:
        raise NotImplementedError


class DigitsEncoder(ClassifierEncoder):
    """A small convolutional encoder for 8x8 digits: 4x4 patch features of width ``width`` (16 tokens,
    one per 2x2 patch: the demo DiT's tokens) and a classification head used to train it. The
    stand-in for DINOv2 on the digits demo (``benchmarks/bench_recipes.py`` trains it once on the
    store's train split)."""

    def __init__(self, width: int = 64, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(32, width, 2, stride=2),
            nn.GELU(),
            nn.Conv2d(width, width, 3, padding=1),
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, images: Tensor) -> Tensor:
        """Images in [0, 1], (N, C, 8, 8) -> (N, 16, width) patch features."""
        z = self.features(images * 2 - 1)
        return z.flatten(2).transpose(1, 2)

    def logits(self, images: Tensor) -> Tensor:
        return self.head(F.gelu(self.forward(images)).mean(dim=1))


class MNISTEncoder(ClassifierEncoder):
    """A small convolutional encoder for 28x28 grey images (MNIST) with a class token, the stand-in for
    DINOv2 in the MNIST benchmark (``benchmarks/bench_own_data.py`` trains it once on the training
    split): 7x7 = 49 patch features (one per 4x4 patch: the DiT's tokens at patch 4) after a class
    token, the mean of the patches (``prefix_tokens = 1``: :class:`~.encoders.FrozenEncoder` reads the
    first token as REG's class token). A final LayerNorm over every token of [class token, patches]
    normalises them as DINOv2's ``x_norm`` outputs are, so that REG's unscaled class-token target has
    a sane scale. The class is built without arguments (class-path encoders are)."""

    prefix_tokens = 1

    def __init__(self, width: int = 64, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(32, width, 2, stride=2),  # 14x14
            nn.GELU(),
            nn.Conv2d(width, width, 2, stride=2),  # 7x7
            nn.GELU(),
            nn.Conv2d(width, width, 3, padding=1),
        )
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.head = nn.Linear(width, num_classes)

    def forward(self, images: Tensor) -> Tensor:
        """Images in [0, 1], (N, C, 28, 28) -> (N, 1 + 49, width): the class token, then the patches."""
        patches = self.features(images * 2 - 1).flatten(2).transpose(1, 2)
        return self.norm(torch.cat([patches.mean(dim=1, keepdim=True), patches], dim=1))

    def logits(self, images: Tensor) -> Tensor:
        """Classified from the class token: it is what REG's token carries."""
        return self.head(self.forward(images)[:, 0])


def train_digits_encoder(
    images: Tensor,
    labels: Tensor,
    steps: int = 400,
    batch_size: int = 128,
    seed: int = 0,
    encoder_class: Callable[..., ClassifierEncoder] = DigitsEncoder,
) -> ClassifierEncoder:
    """Train a stand-in encoder (:class:`DigitsEncoder` for the 8x8 digits, :class:`MNISTEncoder`
    for 28x28 images) as a classifier on ``images`` in [0, 1] (N, C, H, W)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = encoder_class(num_classes=int(labels.max()) + 1, in_channels=images.shape[1])
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-4)
    for _ in range(steps):
        idx = torch.randint(0, images.shape[0], (batch_size,), generator=gen)
        loss = F.cross_entropy(net.logits(images[idx]), labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return net.eval()
