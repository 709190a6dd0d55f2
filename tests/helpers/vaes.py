"""Tiny randomly initialised diffusers ``AutoencoderKL``s of real layouts (4 or 16 channels,
downsampling 8 or 16, an SD3 / FLUX-style ``shift_factor``) saved with ``save_pretrained``."""

from __future__ import annotations

from typing import Optional


def make_vae(
    path: str,
    channels: int = 4,
    factor: int = 8,
    scaling_factor: float = 0.18215,
    shift_factor: Optional[float] = None,
    post_quant_conv: bool = True,
    seed: int = 0,
) -> str:
    """An ``AutoencoderKL`` downsampling ``factor`` (8 or 16: 4 or 5 blocks of 8 channels) to
    ``channels`` latent channels, written to ``path``."""
    import torch
    from diffusers.models import AutoencoderKL

    blocks = {8: 4, 16: 5}[factor]
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=(8,) * blocks,
        layers_per_block=1,
        latent_channels=channels,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_post_quant_conv=post_quant_conv,
        mid_block_add_attention=False,
    )
    with torch.no_grad():  # a random init's posterior is near 0 everywhere: give each channel its own offset
        vae.quant_conv.bias.add_(
            torch.linspace(-1.0, 1.0, 2 * channels) * torch.tensor([1.0] * channels + [0.0] * channels)
        )
    vae.save_pretrained(path)
    return path
