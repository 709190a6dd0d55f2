"""The digits demo store: same format and code path as ImageNet latents."""

from __future__ import annotations

import os
import shutil
import stat

import numpy as np
import pytest

from dit_lightning.data import store as st
from dit_lightning.data.digits import prepare_digits


@pytest.fixture(scope="module")
def digits8(tmp_path_factory):
    return prepare_digits(str(tmp_path_factory.mktemp("digits") / "d8"))


def test_digits_store(digits8):
    from sklearn.datasets import load_digits

    s = st.LatentStore(digits8)
    assert len(s) == 1797 and s.latent_shape == (1, 8, 8) and s.num_classes == 10
    assert s.class_names == [str(i) for i in range(10)]
    assert s.variant == "sample" and not s.flips and s.scale_factor == 1.0 and s.meta["vae"] == "none/pixels"
    raw = s.read(np.arange(1797)).astype(np.float32)  # (N, F=1, K=1, 1, 8, 8)
    d = load_digits()
    np.testing.assert_allclose(raw[:, 0, 0, 0], d.images / 16 * 2 - 1, atol=1e-3)
    assert raw.min() == -1 and raw.max() == 1
    np.testing.assert_array_equal(s.labels, d.target)


def test_idempotent_and_upsampled(digits8, tmp_path):
    mtime = os.path.getmtime(os.path.join(digits8, "meta.json"))
    assert prepare_digits(digits8) == digits8
    assert os.path.getmtime(os.path.join(digits8, "meta.json")) == mtime
    with pytest.raises(st.StoreError, match="not a digits store of size 16"):
        prepare_digits(digits8, size=16)
    p16 = prepare_digits(str(tmp_path / "d16"), size=16)
    s8, s16 = st.LatentStore(digits8), st.LatentStore(p16)
    assert s16.latent_shape == (1, 16, 16)
    a, b = s8.read([5])[0, 0, 0, 0], s16.read([5])[0, 0, 0, 0]
    np.testing.assert_array_equal(b, a.repeat(2, 0).repeat(2, 1))  # nearest-neighbour x2
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # built aside, renamed in
    with pytest.raises(ValueError, match="multiple of 8"):
        prepare_digits(str(tmp_path / "bad"), size=12)


def test_overwrite_replaces_only_a_store_and_leaves_one_whole(digits8, tmp_path):
    path = str(tmp_path / "d")
    shutil.copytree(digits8, path)
    with pytest.raises(st.StoreError, match="not a digits store of size 16"):
        prepare_digits(path, size=16)
    assert prepare_digits(path, size=16, overwrite=True) == path
    assert st.LatentStore(path).latent_shape == (1, 16, 16) and os.listdir(tmp_path) == ["d"]  # old copy gone
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o777 & ~umask  # readable by the team, not mkdtemp's 0o700
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(st.StoreError, match="not a latent store"):
        prepare_digits(str(tmp_path / "mine"), overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep" and sorted(os.listdir(tmp_path)) == ["d", "mine"]
