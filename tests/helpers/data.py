"""Small fixtures for tests and smoke runs: a tiny random VAE, an ImageFolder with bad files,
and a random latent store. Nothing here downloads anything.
"""

from __future__ import annotations

import io
import os
from typing import Any, Optional

import numpy as np
import torch

from dit_lightning.data import store as st

# name -> (mode, size) of the "good" images; the bad ones are added per class below
_GOOD = [("RGB", (40, 32)), ("RGB", (100, 70)), ("RGB", (32, 48))]


def _jpeg_bytes(img: Any, **kw: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90, **kw)
    return buf.getvalue()


def make_image_folder(root: str, with_bad: bool = True, seed: int = 0) -> dict[str, str]:
    """Write a 3-class ImageFolder (``cls_a``, ``cls_b``, ``cls_c``) and return {relpath: kind}.

    Kinds: "ok", "converted" (CMYK, L, RGBA/P with transparency, tiny) and "skipped"
    (zero bytes, corrupt bytes, truncated JPEG).
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    kinds: dict[str, str] = {}

    def rand_rgb(w: int, h: int) -> Any:
        # smooth-ish content so the JPEG codec and the crop have something real to chew on
        base = rng.integers(0, 256, size=(h // 4 + 1, w // 4 + 1, 3), dtype=np.uint8)
        return Image.fromarray(base).resize((w, h), Image.Resampling.BILINEAR)

    for c, cls in enumerate(["cls_a", "cls_b", "cls_c"]):
        d = os.path.join(root, cls)
        os.makedirs(d, exist_ok=True)
        for j, (_, (w, h)) in enumerate(_GOOD):
            name = f"{cls}/img_{j}.JPEG"
            with open(os.path.join(root, name), "wb") as f:
                f.write(_jpeg_bytes(rand_rgb(w + c, h)))
            kinds[name] = "ok"
        if not with_bad:
            continue
        if c == 0:
            open(os.path.join(d, "zero.JPEG"), "wb").close()
            kinds[f"{cls}/zero.JPEG"] = "skipped"
            with open(os.path.join(d, "corrupt.JPEG"), "wb") as f:
                f.write(b"\xff\xd8\xff\xe0" + rng.integers(0, 256, 500, dtype=np.uint8).tobytes())
            kinds[f"{cls}/corrupt.JPEG"] = "skipped"
            good = _jpeg_bytes(rand_rgb(64, 64))
            with open(os.path.join(d, "truncated.JPEG"), "wb") as f:
                f.write(good[: len(good) // 2])
            kinds[f"{cls}/truncated.JPEG"] = "skipped"
        elif c == 1:
            rand_rgb(48, 40).convert("CMYK").save(os.path.join(d, "cmyk.JPEG"), format="JPEG")
            kinds[f"{cls}/cmyk.JPEG"] = "converted"
            rand_rgb(36, 36).convert("L").save(os.path.join(d, "gray.JPEG"), format="JPEG")
            kinds[f"{cls}/gray.JPEG"] = "converted"
            Image.fromarray(rng.integers(0, 256, (9, 12, 3), dtype=np.uint8)).save(os.path.join(d, "tiny.png"))
            kinds[f"{cls}/tiny.png"] = "converted"
        else:
            rgba = np.array(rand_rgb(40, 40).convert("RGBA"))
            rgba[:20, :, 3] = 0  # transparent top half
            Image.fromarray(rgba, "RGBA").save(os.path.join(d, "alpha.png"))
            kinds[f"{cls}/alpha.png"] = "converted"
            p = rand_rgb(40, 40).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
            p.save(os.path.join(d, "palette.png"), transparency=0)
            kinds[f"{cls}/palette.png"] = "converted"
    return kinds


def make_tiny_vae(path: str, latent_channels: int = 4, seed: int = 0) -> str:
    """Save a randomly initialised, tiny ``AutoencoderKL`` (downsampling 2) with save_pretrained."""
    import torch
    from diffusers.models import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=32,
        mid_block_add_attention=False,
    )
    vae.save_pretrained(path)
    return path


def make_random_store(
    path: str,
    n: int,
    latent_shape: tuple[int, int, int] = (4, 32, 32),
    num_classes: int = 1000,
    variant: st.Variant = "moments",
    flips: bool = True,
    dtype: st.StorageDtype = "float16",
    shard_size: int = 1024,
    seed: int = 0,
    logvar_mean: float = -6.0,
    class_names: Optional[list[str]] = None,
    vae: str = "random",
) -> st.LatentStore:
    """A finalised store of random moments (for loader tests and benchmarks); reused if valid.
    ``vae="none/pixels"`` makes it a pixel store (random images, e.g. of another source than the digits)."""
    spec = st.StoreSpec(
        latent_shape=tuple(latent_shape),  # type: ignore[arg-type]
        dtype=dtype,
        variant=variant,
        flips=flips,
        scale_factor=0.18215,
        vae=vae,
        image_size=latent_shape[1] * 8,
        class_names=tuple(class_names or [f"c{i}" for i in range(num_classes)]),
        source=f"random(seed={seed})",
        num_items=n,
        shard_size=shard_size,
        preprocessing="none",
    )
    if os.path.exists(os.path.join(path, st.META_FILE)):
        try:
            s = st.LatentStore(path)
            if s.spec.to_json() == spec.to_json():
                return s
        except st.StoreError:
            pass
    import torch

    st.write_plan(path, spec)
    rng = np.random.default_rng(seed)
    for k in range(spec.num_shards):
        if st.read_shard_record(path, k) is not None:
            continue
        a, b = spec.shard_range(k)
        vals = rng.standard_normal((b - a, *spec.sample_shape), dtype=np.float32)
        if variant == "moments":
            vals[:, :, 1] = vals[:, :, 1] * 0.5 + logvar_mean
        t = torch.from_numpy(vals)
        data = t.to(torch.bfloat16).view(torch.uint16).numpy() if dtype == "bfloat16" else t.half().numpy()
        labels = rng.integers(0, len(spec.class_names), b - a).astype(np.int32)
        st.write_shard(path, k, spec, data, labels, [f"random[{i}]" for i in range(a, b)])
    st.finalize_store(path)
    return st.LatentStore(path)


def tree_bytes(path: str) -> dict[str, bytes]:
    """Every file below ``path`` by its relative path: two stores are equal byte for byte when these are."""
    out = {}
    for dirpath, _, files in os.walk(path):
        for f in files:
            full = os.path.join(dirpath, f)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, path)] = fh.read()
    return out


class PatchEncoder(torch.nn.Module):
    """A REPA encoder whose features are exact on every machine: each 2x2 patch's pixels of an
    (N, 1, 8, 8) image, times a per-value weight (elementwise only: no reduction whose rounding could
    differ), so (N, 16, 4) features. Loaded by class path (``tests.helpers.data.PatchEncoder``) with
    its weights file, as a user's encoder is; the legacy store fixture records this name."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        n, c, h, w = images.shape
        patches = images.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return patches.reshape(n, (h // 2) * (w // 2), c * 4) * self.scale


def make_digit_folder(
    root: str, n: int = 30, size: tuple[int, int] = (28, 28), colour: bool = False, seed: int = 0
) -> list[str]:
    """An ImageFolder of scikit-learn's 8x8 digits upsampled to ``size`` (W, H), one class folder per
    digit (``root/<digit>/<i>.png``): grey PNGs (mode ``L``), or with ``colour`` each digit tinted
    with a random colour (``RGB``). Returns the relative paths written."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    written = []
    for i in range(n):
        grey = Image.fromarray((digits.images[i] / 16 * 255).astype(np.uint8), "L")
        image = grey.resize(size, Image.Resampling.BILINEAR)
        if colour:
            tint = rng.uniform(0.2, 1.0, 3)
            image = Image.fromarray((np.asarray(image)[:, :, None] * tint).astype(np.uint8), "RGB")
        rel = f"{digits.target[i]}/{i:05d}.png"
        os.makedirs(os.path.join(root, str(digits.target[i])), exist_ok=True)
        image.save(os.path.join(root, rel))
        written.append(rel)
    return written
