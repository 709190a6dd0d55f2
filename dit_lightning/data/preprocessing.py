"""Image decoding and the ADM centre crop used by DiT (and ADM before it).

The crop, as in the reference training script: while the short side is at least twice the
target, halve the image with a box filter (cheap, alias-free); then resize with bicubic
so that the short side equals the target; then take the centred square. Images smaller
than the target go through the same path and are simply upscaled by the bicubic step.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class BadImage(Exception):
    """An input that cannot be turned into an RGB image; ``reason`` goes into the report."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def adm_center_crop(image: Image.Image, image_size: int) -> Image.Image:
    """ADM centre crop of a PIL image to ``image_size`` x ``image_size``."""
    while min(image.size) >= 2 * image_size:
        image = image.resize((image.width // 2, image.height // 2), resample=Image.Resampling.BOX)
    scale = image_size / min(image.size)
    image = image.resize((round(image.width * scale), round(image.height * scale)), resample=Image.Resampling.BICUBIC)
    w, h = image.size
    left, top = (w - image_size) // 2, (h - image_size) // 2
    return image.crop((left, top, left + image_size, top + image_size))


def _flatten_alpha(image: Image.Image) -> Image.Image:
    # Transparent pixels have arbitrary colour underneath; composite on white, the usual
    # background of product/icon images, instead of leaking that colour into the latent.
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def load_rgb(path: str) -> tuple[Image.Image, Optional[str]]:
    """Decode ``path`` fully and return (RGB image, conversion note or None).

    Raises ``BadImage`` for unreadable files (empty, corrupt, truncated). Grayscale, CMYK,
    16-bit, palette and alpha images are converted; the note says from what.
    """
    try:
        if os.path.getsize(path) == 0:
            raise BadImage("empty file (0 bytes)")
        with warnings.catch_warnings():
            # huge or odd files warn (DecompressionBombWarning, EXIF); they either load or raise
            warnings.simplefilter("ignore")
            with Image.open(path) as im:
                im.load()  # decode now: a truncated JPEG fails here, not later in a worker
                image = im.copy()
    except BadImage:
        raise
    except UnidentifiedImageError:
        raise BadImage("not a readable image (unidentified format or corrupt header)") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        msg = str(e) or type(e).__name__
        if "truncated" in msg.lower():
            raise BadImage(f"truncated image: {msg}") from None
        raise BadImage(f"cannot decode: {msg}") from None
    if min(image.size) < 1:
        raise BadImage(f"degenerate size {image.size}")
    mode = image.mode
    if mode == "RGB":
        return image, None
    if mode in ("RGBA", "LA", "PA") or (mode == "P" and "transparency" in image.info):
        return _flatten_alpha(image), f"{mode} with alpha -> RGB on white"
    if mode in ("I;16", "I;16B", "I;16L", "I"):
        # PIL's I->RGB clips at 255; rescale the 16-bit range to 8 bits first
        arr = np.asarray(image, dtype=np.float64)
        hi = 65535.0 if mode.startswith("I;16") or arr.max() > 255 else 255.0
        arr8 = np.clip(arr / hi * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return Image.fromarray(arr8, "L").convert("RGB"), f"{mode} -> RGB"
    try:
        return image.convert("RGB"), f"{mode} -> RGB"
    except (ValueError, OSError) as e:
        raise BadImage(f"cannot convert mode {mode} to RGB: {e}") from None


def to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB (or grey ``L``) PIL image -> float32 (3, H, W) (or (1, H, W)) in [-1, 1]."""
    arr = np.array(image, dtype=np.uint8)  # a writable copy, owned by the tensor
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(arr).permute(2, 0, 1).float().div_(127.5).sub_(1.0)


def preprocess(path: str, image_size: int, channels: int = 3) -> tuple[torch.Tensor, Optional[str]]:
    """Load, convert, ADM-crop and normalise one image file: ((channels, S, S) in [-1, 1], note).

    ``channels=1`` crops the grey image: PIL's ``convert("L")`` of the RGB one (ITU-R 601-2 luma),
    which gives a grey file's own values back exactly (its RGB is the grey value thrice)."""
    image, note = load_rgb(path)
    if min(image.size) < image_size:
        note = (note + "; " if note else "") + f"upscaled from {image.size[0]}x{image.size[1]}"
    if channels == 1:
        note = None if note == "L -> RGB" else note  # a grey file's own values: nothing converted
        image = image.convert("L")
    return to_tensor(adm_center_crop(image, image_size)), note


# PIL modes that hold no colour: an image folder of these alone makes a 1-channel pixel store.
GREY_MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})


def folder_channels(root: str, paths: list[str]) -> int:
    """1 when every image of ``paths`` (relative to ``root``) is stored grey (a PIL mode of
    :data:`GREY_MODES`, read from the file's header alone), else 3. Unreadable files (skipped
    later, by the extraction) do not count."""
    for rel in paths:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with Image.open(os.path.join(root, rel)) as im:
                    mode = im.mode
        except Exception:  # an unreadable file is reported by the extraction, not here
            continue
        if mode not in GREY_MODES:
            return 3
    return 1


def list_image_folder(root: str) -> tuple[list[str], list[int], list[str]]:
    """ImageFolder listing with a fixed order: (relative paths, labels, class names).

    Classes are the sorted sub-directory names; files are sorted within each class and
    selected by extension (case-insensitive), so every process and every run agree.
    """
    if not os.path.isdir(root):
        raise FileNotFoundError(f"image root {root} is not a directory")
    classes = sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise FileNotFoundError(f"{root} has no class sub-directories (expected root/<class>/<image>)")
    paths: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        files = []
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls), followlinks=True):
            dirnames.sort()
            for name in filenames:
                if name.lower().endswith(IMG_EXTENSIONS) and not name.startswith("."):
                    files.append(os.path.relpath(os.path.join(dirpath, name), root))
        files.sort()
        paths.extend(files)
        labels.extend([label] * len(files))
    return paths, labels, classes
