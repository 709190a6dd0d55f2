"""The VAE between images and latents: loading a diffusers ``AutoencoderKL``, decoding latents,
and the pixel-space stores that need none ("none/pixels", e.g. the digits demo)."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from .latents import LatentTransform

DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
DEFAULT_SCALE_FACTOR = 0.18215
PIXEL_VAE_PREFIX = "none"  # "none/pixels": the store holds pixels in [-1, 1]


def is_pixel_space(vae: Optional[str]) -> bool:
    return not vae or vae.startswith(PIXEL_VAE_PREFIX)


def vae_reference(name: str) -> str:
    """A VAE as a store or a run records it: a local directory (``save_pretrained``) as its absolute
    path, so that a command run from another directory finds it (there a relative ``tiny-vae`` would
    read as a hub id); a hub id, or ``none/pixels``, as given."""
    if name and not is_pixel_space(name) and os.path.isdir(name):
        return os.path.abspath(name)
    return name


def clip_denoised_for(vae: Optional[str]) -> bool:
    """The ``clip_denoised`` a store decoded by ``vae`` samples with: True for pixel stores
    (values known to lie in [-1, 1], as ADM samples pixel models), False for VAE latents
    (unbounded; the DiT paper's setting)."""
    return is_pixel_space(vae)


def _check_pickled_weights(name: str) -> None:
    """A local VAE directory with pickled weights (``.bin``) only: they must load as plain tensors
    (diffusers would say only "Unable to load weights"); safetensors hold no code at all. A refusal
    is one line naming the file and the fix, never torch's paragraph on ``weights_only``."""
    import re
    import warnings
    import zipfile

    path = os.path.join(name, "diffusion_pytorch_model.bin")
    if not os.path.isfile(path) or os.path.isfile(os.path.join(name, "diffusion_pytorch_model.safetensors")):
        return
    try:
        with warnings.catch_warnings():  # a pickle of another protocol is refused below, in one line
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as e:
        code = re.search(r"GLOBAL ([\w.]+)", str(e))
        if code and "Weights only load failed" in str(e):
            why = f"names code ({code.group(1)}) that unpickling it would run: refused"
        elif os.path.getsize(path) == 0:
            why = "is empty (0 bytes)"
        else:
            why = "is not a plain weights file (a truncated file, another kind of file, or a pickle of objects)"
        raise RuntimeError(
            f"cannot load the VAE {name!r}: {path} {why}. Use the VAE's safetensors weights "
            "(AutoencoderKL.save_pretrained writes them), or copy the VAE again."
        ) from None


def load_vae(name: str, device: Union[str, torch.device] = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """diffusers ``AutoencoderKL`` from a hub id or a local ``save_pretrained`` directory, frozen, in eval mode."""
    from diffusers.models import AutoencoderKL

    _check_pickled_weights(name)
    try:
        vae = AutoencoderKL.from_pretrained(name, torch_dtype=dtype, low_cpu_mem_usage=False)
    except Exception as e:
        raise RuntimeError(
            f"cannot load the VAE {name!r} ({type(e).__name__}: {e}). Offline, pass a local directory "
            "written by AutoencoderKL.save_pretrained (or have the hub id in the Hugging Face cache)."
        ) from e
    return vae.to(device).eval().requires_grad_(False)


@torch.no_grad()
def decode_latents(
    latents: Tensor,
    vae: Optional[Union[str, nn.Module]],
    transform: Union[LatentTransform, float, None] = DEFAULT_SCALE_FACTOR,
) -> Tensor:
    """Images in [0, 1] (N, C, H, W): ``(x + 1) / 2`` for pixel stores, else ``vae.decode`` of the raw
    latents ``transform.inverse(latents)`` (a number is the ``scale`` transform's factor: ``z / s``).

    The VAE runs in fp32 whatever the sampling precision: decoding is a small share of the
    cost and the SD decoders are the part most sensitive to reduced precision.
    """
    if vae is None or isinstance(vae, str):
        if vae is None or is_pixel_space(vae):
            return ((latents.float() + 1) / 2).clamp(0, 1)
        vae = load_vae(vae, latents.device)
    if not isinstance(transform, LatentTransform):
        transform = LatentTransform.scaled(DEFAULT_SCALE_FACTOR if transform is None else float(transform))
    decoder: Any = vae  # a diffusers AutoencoderKL (or a module with its `decode(z).sample`)
    images = decoder.decode(transform.inverse(latents.float())).sample
    return ((images.float() + 1) / 2).clamp(0, 1)
