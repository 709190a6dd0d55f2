"""``dit-lightning prepare-digits``: the demo's pixel store from scikit-learn's bundled digits."""

from __future__ import annotations

from ..data.digits import prepare_digits as write_digits_store


def prepare_digits(output: str = "data/digits", size: int = 8, overwrite: bool = False) -> str:
    """Write the digits store (1,797 images, 10 classes; offline) to ``output`` and return its path.

    Args:
        output: the store directory; an existing digits store of the same size is kept as it is.
        size: side of the images: 8 (the originals) or a multiple of 8 (nearest upsampling).
        overwrite: replace an existing store of other settings at ``output``.
    """
    path = write_digits_store(output, size=size, overwrite=overwrite)
    print(f"digits store ready at {path}")
    return path
