"""Generated images on disk: 8-bit conversion, one PNG per sample, grids, the ADM ``.npz``.

Sample files are named ``000123-c207.png`` (sample 123, class 207) and written atomically, so a
listed name is always a complete image: a killed run resumes by making the missing indices.
"""

from __future__ import annotations

import math
import os
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
from torch import Tensor

from .atomic import atomic_write, save_image

_PNG = re.compile(r"^(\d+)-c(\d+)\.png$")


def to_uint8(images: Tensor) -> np.ndarray:
    """[0, 1] (N, C, H, W) -> uint8 (N, H, W, C), rounded (as ``clamp(127.5 x + 128)`` on [-1, 1])."""
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def png_name(index: int, label: int) -> str:
    return f"{index:06d}-c{label}.png"


def parse_png_name(name: str) -> Optional[tuple[int, int]]:
    """(index, label) of a sample file name, or None for any other file."""
    m = _PNG.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def save_sample(array: np.ndarray, directory: Union[str, Path], index: int, label: int) -> Path:
    """Write one uint8 (H, W, C) sample as ``directory/png_name(index, label)``, atomically."""
    return save_image(Path(directory) / png_name(index, label), array)


def load_png_rgb(path: Union[str, Path]) -> np.ndarray:
    """uint8 (H, W, 3); grayscale expanded to three channels."""
    from PIL import Image

    with Image.open(path) as im:
        return np.array(im.convert("RGB"))  # a writable copy


def existing_samples(samples_dir: Union[str, Path]) -> dict[int, Path]:
    """Complete sample PNGs by index (atomic writes: a listed name is a complete file)."""
    out: dict[int, Path] = {}
    d = Path(samples_dir)
    if not d.is_dir():
        return out
    for entry in os.scandir(d):
        parsed = parse_png_name(entry.name)
        if parsed:
            out[parsed[0]] = Path(entry.path)
    return out


def sample_labels(paths: Sequence[Union[str, Path]]) -> np.ndarray:
    """The class of each sample file, from its name."""
    labels = []
    for p in paths:
        parsed = parse_png_name(Path(p).name)
        if parsed is None:
            raise ValueError(f"{p} is not a sample file (expected a name like {png_name(0, 7)})")
        labels.append(parsed[1])
    return np.array(labels, dtype=np.int64)


def write_npz_from_pngs(paths: Sequence[Union[str, Path]], output: Union[str, Path]) -> Path:
    """The ADM evaluator's sample batch: ``.npz`` with ``arr_0`` uint8 (N, H, W, 3).

    Streamed image by image into the (uncompressed) zip member, so 50K 256px samples
    (9.8 GB) never need to be in memory at once; written atomically.
    ``np.load(output)["arr_0"]`` reads it like an ``np.savez`` file.
    """
    if not paths:
        raise ValueError("no images to write")
    first = load_png_rgb(paths[0])
    shape = (len(paths), *first.shape)

    def write(fileobj) -> None:
        with zipfile.ZipFile(fileobj, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            with zf.open("arr_0.npy", "w", force_zip64=True) as f:
                header = {
                    "descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
                    "fortran_order": False,
                    "shape": shape,
                }
                np.lib.format.write_array_header_1_0(f, header)
                for k, p in enumerate(paths):
                    arr = first if k == 0 else load_png_rgb(p)
                    if arr.shape != first.shape:
                        raise ValueError(
                            f"{p} is {arr.shape[1]}x{arr.shape[0]}, the others {first.shape[1]}x{first.shape[0]}"
                        )
                    f.write(np.ascontiguousarray(arr).tobytes())

    return atomic_write(output, write)


def make_grid_image(images: Tensor, nrow: int) -> Tensor:
    """(N, C, H, W) in [0, 1] -> one (3, H', W') grid with ``nrow`` images per row."""
    from torchvision.utils import make_grid

    if images.shape[1] == 1:
        images = images.expand(-1, 3, -1, -1)
    return make_grid(images.float().cpu(), nrow=nrow, padding=1, pad_value=1.0)


def save_png(grid: Tensor, path: Union[str, Path], upscale: int = 1) -> Path:
    """Write a (3, H, W) [0, 1] grid as a PNG, nearest-upscaled so small digits stay visible."""
    from PIL import Image

    array = (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    image = Image.fromarray(array)
    if upscale > 1:
        image = image.resize((image.width * upscale, image.height * upscale), Image.Resampling.NEAREST)
    return save_image(path, image)


def write_grid(paths: Sequence[Union[str, Path]], output: Union[str, Path], nrow: Optional[int] = None) -> Path:
    """A grid PNG of the given samples; small images are magnified (nearest) to >= 64 px."""
    images = torch.stack([torch.from_numpy(load_png_rgb(p)).permute(2, 0, 1) for p in paths]).float() / 255
    nrow = nrow or max(1, math.ceil(math.sqrt(len(paths))))
    return save_png(make_grid_image(images, nrow), output, upscale=max(1, math.ceil(64 / images.shape[-1])))
