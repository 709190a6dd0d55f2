"""Sample files (images.py): the ADM `.npz` written from PNGs."""

import numpy as np

from dit_lightning.images import write_npz_from_pngs
from tests.helpers.samples import read_npz as _npz


def test_npz_is_streamed_in_the_adm_format(tmp_path):
    from PIL import Image

    paths = []
    for i in range(3):
        p = tmp_path / f"{i}.png"
        Image.fromarray(np.full((4, 5), 40 * i, np.uint8)).save(p)
        paths.append(p)
    arr = _npz(write_npz_from_pngs(paths, tmp_path / "s.npz"))
    assert arr.dtype == np.uint8 and arr.shape == (3, 4, 5, 3) and arr[2].min() == arr[2].max() == 80
