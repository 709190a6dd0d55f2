"""The latent store: format, batched reads, validation errors, atomic/idempotent writes."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from dit_lightning.data import store as st
from dit_lightning.data.rng import to_float32
from tests.helpers.data import make_random_store


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("store") / "s")
    return make_random_store(path, n=50, latent_shape=(4, 4, 4), num_classes=7, shard_size=16)


def _all_values(store: st.LatentStore) -> np.ndarray:
    parts = [np.load(os.path.join(store.path, s["file"])) for s in store.meta["shards"]]
    return np.concatenate(parts)


def test_metadata_and_layout(small_store):
    s = small_store
    assert len(s) == 50 and s.num_shards == 4
    assert s.latent_shape == (4, 4, 4) and s.num_classes == 7 and s.class_names[0] == "c0"
    assert s.scale_factor == pytest.approx(0.18215)
    meta = json.load(open(os.path.join(s.path, "meta.json")))
    assert meta["format_version"] == 1 and meta["count"] == 50
    assert meta["sample_shape"] == [2, 2, 4, 4, 4] and meta["dtype"] == "float16" and meta["flips"] is True
    assert s.labels.dtype == np.int64 and s.labels.max() < 7


def test_read_matches_files_in_any_order(small_store):
    s = small_store
    full = _all_values(s)  # (50, F, K, C, H, W)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 50, 37)  # unsorted, with repeats, across shards
    np.testing.assert_array_equal(s.read(idx), full[idx])
    flips = rng.integers(0, 2, 37)
    np.testing.assert_array_equal(s.read(idx, flip=flips), full[idx, flips])
    srt = np.sort(idx)
    np.testing.assert_array_equal(s.read(srt, flip=1), full[srt, 1])
    assert s.read(np.zeros(0, np.int64), flip=0).shape == (0, 2, 4, 4, 4)
    with pytest.raises(IndexError):
        s.read([50])
    item = s[3]
    np.testing.assert_array_equal(item["values"], full[3].astype(np.float32))


def test_bfloat16_roundtrip(tmp_path):
    s = make_random_store(str(tmp_path / "bf"), n=10, latent_shape=(2, 2, 2), num_classes=3, dtype="bfloat16")
    raw = s.read(np.arange(10))
    assert raw.dtype == np.uint16
    via_torch = torch.from_numpy(raw).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(to_float32(raw), via_torch)
    assert np.isfinite(via_torch).all() and via_torch.std() > 0.1


def test_check_compatible(small_store):
    small_store.check_compatible((4, 4, 4), 7)
    with pytest.raises(ValueError, match=r"latents of shape \(4, 8, 8\).*in_channels=4 and input_size=4"):
        small_store.check_compatible((4, 8, 8), 7)
    with pytest.raises(ValueError, match="num_classes=1000.*7 classes"):
        small_store.check_compatible(num_classes=1000)


def _copy(store, tmp_path, name):
    dst = str(tmp_path / name)
    shutil.copytree(store.path, dst)
    return dst


def test_refuses_truncated_missing_and_misshapen_shards(small_store, tmp_path):
    p = _copy(small_store, tmp_path, "trunc")
    f = os.path.join(p, "shards", "shard-00001.npy")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)
    with pytest.raises(st.StoreError, match=r"shard-00001.npy is truncated.*rerun the extraction"):
        st.LatentStore(p)

    p = _copy(small_store, tmp_path, "missing")
    os.remove(os.path.join(p, "shards", "shard-00002.npy"))
    with pytest.raises(st.StoreError, match="shard-00002.npy is missing"):
        st.LatentStore(p)

    p = _copy(small_store, tmp_path, "shape")
    np.save(os.path.join(p, "shards", "shard-00000.npy"), np.zeros((16, 2, 2, 4, 4, 5), np.float16))
    with pytest.raises(st.StoreError, match=r"shape \(16, 2, 2, 4, 4, 5\).*expects \(16, 2, 2, 4, 4, 4\)"):
        st.LatentStore(p)


def test_incomplete_store_explains_how_to_resume(small_store, tmp_path):
    p = _copy(small_store, tmp_path, "incomplete")
    os.remove(os.path.join(p, "meta.json"))
    with pytest.raises(st.IncompleteStoreError, match="not finalised"):
        st.LatentStore(p)
    os.remove(os.path.join(p, "shards", "shard-00003.json"))  # commit record gone: shard not done
    with pytest.raises(st.IncompleteStoreError, match="3 of 4 shards written.*resume"):
        st.LatentStore(p)
    with pytest.raises(st.IncompleteStoreError, match="missing or incomplete"):
        st.finalize_store(p)
    assert st.shard_status(p) == ([0, 1, 2], [3])
    with pytest.raises(st.StoreError, match="no latent store"):
        st.LatentStore(str(tmp_path / "nothing"))


def test_partial_shard_does_not_count_and_finalize_is_deterministic(small_store, tmp_path):
    p = _copy(small_store, tmp_path, "partial")
    before = {n: open(os.path.join(p, n), "rb").read() for n in ("meta.json", "labels.npy", "sources.txt")}
    # a half-written data file with a stale commit record: sizes disagree -> not done
    f = os.path.join(p, "shards", "shard-00001.npy")
    with open(f, "ab") as fh:
        fh.write(b"\0" * 10)
    assert st.read_shard_record(p, 1) is None
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 10)
    assert st.read_shard_record(p, 1) is not None
    st.finalize_store(p)  # again: byte-identical
    for n, b in before.items():
        assert open(os.path.join(p, n), "rb").read() == b
    assert not [n for n in os.listdir(p) if n.endswith(".tmp")]


def test_plan_mismatch_is_refused(small_store, tmp_path):
    p = _copy(small_store, tmp_path, "plan")
    spec = st.load_plan(p)
    st.write_plan(p, spec)  # same settings: fine
    other = st.StoreSpec.from_json({**spec.to_json(), "dtype": "bfloat16"})
    with pytest.raises(st.StoreError, match="dtype: store has 'float16', asked 'bfloat16'"):
        st.write_plan(p, other)


def test_pickled_store_reopens_maps(small_store):
    import pickle

    small_store.read([1, 2])
    clone = pickle.loads(pickle.dumps(small_store))
    assert clone._maps == {}
    np.testing.assert_array_equal(clone.read([5, 40]), small_store.read([5, 40]))


def test_named_feature_sets_are_kept_without_being_understood(tmp_path):
    """Any caller's feature sets, side by side: written with the shard or added later, counted only once
    every shard has them, read per flip, verified, their records opaque to the store; a name that would
    collide with the store's own files or keys is refused."""
    spec = st.StoreSpec((1, 2, 2), "float16", "sample", True, 1.0, "none/pixels", 2, ("a",), "x", 5, 3)
    st.write_plan(tmp_path, spec)
    rng = np.random.default_rng(0)
    data = rng.normal(size=(5, 2, 1, 1, 2, 2)).astype(np.float16)
    sets = {
        "alpha": st.FeatureSpec("alpha", {"made_by": "one thing", "opaque": [1, {"x": None}]}, 3, 2, key="k-alpha"),
        "beta_2": st.FeatureSpec("beta_2", {}, 1, 4, key="k-beta"),
    }
    values = {n: rng.normal(size=(5, 2, f.tokens, f.dim)).astype(np.float16) for n, f in sets.items()}
    for f in sets.values():
        assert st.write_features_plan(tmp_path, f) == f
    for k in range(spec.num_shards):
        a, b = spec.shard_range(k)
        inline = [(sets["alpha"], values["alpha"][a:b])]
        st.write_shard(tmp_path, k, spec, data[a:b], np.zeros(b - a, np.int32), ["s"] * (b - a), features=inline)
    st.finalize_store(tmp_path)
    s = st.LatentStore(tmp_path)
    assert list(s.features) == ["alpha"]  # beta_2 is planned, in no shard yet: it does not count
    st.write_features(tmp_path, 0, spec, sets["beta_2"], values["beta_2"][:3])
    assert st.features_status(tmp_path, sets["beta_2"]) == ([0], [1])
    st.write_features(tmp_path, 1, spec, sets["beta_2"], values["beta_2"][3:])
    st.finalize_store(tmp_path)
    s = st.LatentStore(tmp_path)
    assert s.features == sets and json.load(open(tmp_path / "meta.json"))["alpha"]["opaque"] == [1, {"x": None}]
    idx, flip = np.array([4, 0, 3]), np.array([1, 0, 1])
    for n in sets:
        np.testing.assert_array_equal(s.read_features(n, idx, flip=flip), values[n][idx, flip])
        np.testing.assert_array_equal(s.read_features(n, idx), values[n][idx])
    assert st.verify_store(tmp_path) == [] and st.foreign_entries(tmp_path) == []
    with pytest.raises(st.StoreError, match="holds no gamma features"):
        s.read_features("gamma", idx)
    with pytest.raises(st.StoreError, match="already holds alpha features of other settings"):
        st.write_features_plan(tmp_path, st.FeatureSpec("alpha", {}, 3, 2, key="other"))
    # a broken file: the message names what made it, or the caller's remedy
    with open(tmp_path / "shards" / "shard-00001.alpha.npy", "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(st.StoreError, match="alpha features file .* rerun what computed .*made_by one thing"):
        st.LatentStore(tmp_path)
    fixes = {"alpha": lambda root, plan, f: f"run `make-alpha {root}` ({plan.num_items} items, key {f.key})"}
    with pytest.raises(st.StoreError, match=f"and run `make-alpha {tmp_path}` \\(5 items, key k-alpha\\)"):
        st.LatentStore(tmp_path, fixes)
    for bad in ("labels", "count", "Alpha", "9x", "a.b"):
        with pytest.raises(ValueError, match="feature set name"):
            st.FeatureSpec(bad, {}, 1, 1, key="k")
    with pytest.raises(ValueError, match="may not hold the store's fields"):
        st.FeatureSpec("x", {"key": 1}, 1, 1, key="k")


def test_commit_records_that_disagree_with_the_index_are_found_cheaply(small_store, tmp_path):
    path = str(tmp_path / "s")
    shutil.copytree(small_store.path, path)
    assert st.LatentStore(path).check_records() == []
    record = os.path.join(path, "shards", "shard-00002.json")
    rec = json.load(open(record))
    json.dump({**rec, "count": rec["count"] - 1}, open(record, "w"))
    os.remove(os.path.join(path, "shards", "shard-00003.json"))
    problems = st.LatentStore(path).check_records()
    assert len(problems) == 2, problems
    assert "commit record of shard 2 records 15 samples" in problems[0] and "rerun the extraction" in problems[0]
    assert "shard-00003.json, the commit record of shard 3, is missing: the shard is not committed" in problems[1]
    assert st.verify_store(path, checksums=False, values=False) == problems  # verify reports them too
