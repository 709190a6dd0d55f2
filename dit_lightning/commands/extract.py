"""``dit-lightning extract``: an ImageFolder -> a latent store (VAE posterior moments, or the pixels
with ``--vae none``), resumable and data-parallel (``torchrun --nproc_per_node 8 -m dit_lightning.cli extract ...``)."""

from __future__ import annotations

from ..data.extract import extract_latents as extract

__all__ = ["extract"]
