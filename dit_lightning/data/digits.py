"""A pixel-space demo store from scikit-learn's UCI digits (offline, 1,797 images, 10 classes).

It is written through the same writer as ImageNet latents, so the demo exercises the very
code path of real training: variant "sample" (no posterior to sample), no flips (digits are
not mirror-invariant), one channel, values scaled to [-1, 1], scale factor 1.0.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from ..atomic import recover_directory, replace_directory
from . import store as st

DIGITS_VAE = "none/pixels"
DIGITS_NUM_CLASSES = 10
DIGITS_SOURCE = "sklearn.datasets.load_digits"  # what a digits store records as its source: its identity


def require_sklearn() -> None:
    """The digits demo reads its images from scikit-learn and scores them with its SVC."""
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise ImportError(
            "the digits demo needs scikit-learn (its bundled digits and classifier): pip install 'dit-lightning[demo]'"
        ) from None


def load_uci_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 UCI handwritten digits that ship inside scikit-learn: (N, 8, 8) values 0..16, labels."""
    require_sklearn()
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images, digits.target


def digits_spec(size: int = 8) -> st.StoreSpec:
    """The StoreSpec a digits store of side ``size`` has (known without building it)."""
    if size < 8 or size % 8:
        raise ValueError(f"digits size must be a positive multiple of 8 (8, 16, 32, ...), got {size}")
    return st.StoreSpec(
        latent_shape=(1, size, size),
        dtype="float16",
        variant="sample",
        flips=False,
        scale_factor=1.0,
        vae=DIGITS_VAE,
        image_size=size,
        class_names=tuple(str(i) for i in range(DIGITS_NUM_CLASSES)),
        source=DIGITS_SOURCE,
        num_items=1797,
        shard_size=1024,
        preprocessing=f"x/16*2-1, nearest upsampling x{size // 8}",
    )


def _matches(path: str, spec: st.StoreSpec) -> bool:
    try:
        s = st.LatentStore(path)
    except (st.StoreError, OSError, ValueError):
        return False
    return s.spec.to_json() == spec.to_json()


def prepare_digits(output: str, size: int = 8, overwrite: bool = False) -> str:
    """Write the digits store to ``output`` (idempotent, atomic) and return its path.

    Each 8x8 image (values 0..16) becomes ``x / 16 * 2 - 1`` in [-1, 1], upsampled by the
    integer factor ``size // 8`` with nearest-neighbour repetition (keeps the pixels crisp and
    exactly invertible). Returns at once when a valid store with these settings exists.
    """
    spec = digits_spec(size)
    output = os.path.abspath(output)
    recover_directory(output)  # a replacement killed half-way: the checks below see the whole old store
    if os.path.exists(output):
        if _matches(output, spec) and not overwrite:
            return output
        if not overwrite:
            raise st.StoreError(
                f"{output} exists but is not a digits store of size {size}: choose another path, or replace it "
                f"with `dit-lightning prepare-digits --output {output} --size {size} --overwrite true`"
            )
        # Only a store this project wrote is ever replaced, and never a directory holding the input.
        st.check_removable_store(output)
        require_sklearn()
        import sklearn.datasets

        if st.contains(output, os.path.dirname(sklearn.datasets.__file__)):
            raise st.StoreError(f"--output {output} contains scikit-learn's digits (the input); choose another path")
    raw, target = load_uci_digits()
    images = raw.astype(np.float32) / 16.0 * 2.0 - 1.0  # (1797, 8, 8)
    factor = size // 8
    if factor > 1:
        images = images.repeat(factor, axis=1).repeat(factor, axis=2)
    labels = target.astype(np.int32)
    n = len(labels)
    if n != spec.num_items:
        spec = dataclasses.replace(spec, num_items=n)
    data = images.astype(np.float16).reshape(n, 1, 1, 1, size, size)  # (n, F=1, K=1, C=1, H, W)

    # Built beside the target and renamed into place: the store appears complete or not at all. A
    # store that overwrite replaces (checked above to be a store and nothing else) is moved aside
    # and deleted once the new one is in place, so a kill leaves one of the two, whole.
    try:
        with replace_directory(output, exist_ok=overwrite) as tmp:
            st.write_plan(tmp, spec)
            for k in range(spec.num_shards):
                a, b = spec.shard_range(k)
                st.write_shard(tmp, k, spec, data[a:b], labels[a:b], [f"load_digits[{i}]" for i in range(a, b)])
            st.finalize_store(tmp)
    except FileExistsError:
        # another process won the race; fine if what it wrote is what we want
        if not _matches(output, spec):
            raise
    return output
