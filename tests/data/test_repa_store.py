"""REPA encoder features in the latent store: written by ``extract``, read back, batched, verified.

The encoder is the digits demo's ``DigitsEncoder`` with random weights saved to a file (loaded by
class path, as a user's encoder is), so every value below is a real encoder output.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch

from dit_lightning.data import store as st
from dit_lightning.data.datamodule import LatentDataModule
from dit_lightning.data.digits import prepare_digits
from dit_lightning.data.extract import EXIT_AFTER_ENV, REPA_FIXES, extract_latents, repa_feature_spec
from dit_lightning.data.preprocessing import preprocess
from dit_lightning.data.rng import flip_bits
from dit_lightning.hashing import file_sha256
from dit_lightning.models.encoders import load_encoder
from dit_lightning.models.repa import DigitsEncoder, REPAOptions
from dit_lightning.models.repa_head import EncoderIdentity
from tests.helpers.data import make_image_folder, make_tiny_vae, tree_bytes

DIGITS = "dit_lightning.models.repa.DigitsEncoder"
RGB = "tests.data.test_repa_store.RGBEncoder"
QUIET = dict(num_workers=0, progress=False, device="cpu")


class RGBEncoder(DigitsEncoder):
    """DigitsEncoder for RGB images (built without arguments, as a class-path encoder is)."""

    def __init__(self) -> None:
        super().__init__(width=8, in_channels=3)


def _encode(name: str, weights: str, images: torch.Tensor) -> np.ndarray:
    """The encoder's own output on images in [0, 1]."""
    with torch.no_grad():
        return load_encoder(REPAOptions(encoder=name, weights=weights))(images).numpy()


def _flipped_pixel_store(path: str, n: int = 40) -> str:
    """A pixel store ("none/pixels") with flips: flip 1 holds the mirror of flip 0 (random 8x8 images)."""
    spec = st.StoreSpec(
        latent_shape=(1, 8, 8),
        dtype="float16",
        variant="sample",
        flips=True,
        scale_factor=1.0,
        vae="none/pixels",
        image_size=8,
        class_names=("a", "b"),
        source="random",
        num_items=n,
        shard_size=16,
        preprocessing="none",
    )
    st.write_plan(path, spec)
    x = np.random.default_rng(0).uniform(-1, 1, (n, 1, 8, 8)).astype(np.float32)
    data = np.stack([x, x[..., ::-1]], 1)[:, :, None].astype(np.float16)  # (n, F=2, K=1, 1, 8, 8)
    labels = (np.arange(n) % 2).astype(np.int32)
    for k in range(spec.num_shards):
        a, b = spec.shard_range(k)
        st.write_shard(path, k, spec, data[a:b], labels[a:b], [f"img{i}" for i in range(a, b)])
    st.finalize_store(path)
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # One intra-op thread: fast on a busy host, and the same float reductions in forked children.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("repa")
    weights, other = str(root / "enc.pt"), str(root / "other.pt")
    torch.manual_seed(0)
    torch.save(DigitsEncoder().state_dict(), weights)
    torch.save(DigitsEncoder().state_dict(), other)  # the next random draw: another encoder
    plain = prepare_digits(str(root / "digits"))
    feat = str(root / "digits_feat")
    shutil.copytree(plain, feat)
    summary = extract_latents(output=feat, repa_encoder=DIGITS, repa_weights=weights, **QUIET)
    flipped = _flipped_pixel_store(str(root / "flipped"))
    extract_latents(output=flipped, repa_encoder=DIGITS, repa_weights=weights, batch_size=7, **QUIET)
    yield {"root": root, "weights": weights, "other": other, "plain": plain, "feat": feat, "summary": summary,
           "flipped": flipped}  # fmt: skip
    torch.set_num_threads(threads)


def test_pixel_store_features_are_the_encoders_output(env):
    s = st.LatentStore(env["feat"])
    assert env["summary"]["finalized"] and env["summary"]["features_written"] == 2
    fs = s.features["repa"]
    assert (fs.tokens, fs.dim) == (16, 64) and fs.source["encoder"] == DIGITS
    assert fs.source["weights"] == "enc.pt" and fs.source["image_size"] is None
    meta = json.load(open(os.path.join(env["feat"], "meta.json")))
    assert meta["repa"]["tokens"] == 16 and meta["repa"]["dim"] == 64 and len(meta["repa"]["weights_sha256"]) == 64
    assert [e["repa_file"] for e in meta["shards"]] == ["shards/shard-00000.repa.npy", "shards/shard-00001.repa.npy"]
    record = s.shard_record(1)
    assert record["repa"]["key"] == fs.key and record["repa"]["bytes"] == os.path.getsize(
        os.path.join(env["feat"], "shards", "shard-00001.repa.npy")
    )
    feats = s.read_features("repa", np.arange(len(s)))  # (N, F=1, T, D) float16
    assert feats.shape == (1797, 1, 16, 64) and feats.dtype == np.float16
    pixels = torch.from_numpy(s.read(np.arange(len(s)), flip=0)[:, 0].astype(np.float32))  # (N, 1, 8, 8)
    want = _encode(DIGITS, env["weights"], (pixels + 1) / 2)
    np.testing.assert_allclose(feats[:, 0].astype(np.float32), want, rtol=2e-3, atol=2e-4)
    assert np.abs(want).mean() > 0.02 and not np.allclose(feats[0], feats[1], atol=0.01)  # real, distinct features
    # the latents and the rest of the store are untouched; nothing foreign for overwrite to trip on
    plain, feat = tree_bytes(env["plain"]), tree_bytes(env["feat"])
    assert all(plain[n] == feat[n] for n in plain if n.endswith((".npy", ".txt")))
    assert st.foreign_entries(env["feat"]) == [] and st.verify_store(env["feat"]) == []
    # a second run has nothing to do
    again = extract_latents(output=env["feat"], repa_encoder=DIGITS, repa_weights=env["weights"], **QUIET)
    assert again["features_written"] == 0 and again["finalized"] and tree_bytes(env["feat"]) == feat


def test_flip_one_holds_the_features_of_the_mirrored_image(env):
    s = st.LatentStore(env["flipped"])
    idx = np.array([0, 5, 17, 39])  # across shards (16 per shard, batches of 7 within them)
    pixels = torch.from_numpy(s.read(idx).astype(np.float32)[:, :, 0])  # (B, F, 1, 8, 8)
    for f in (0, 1):
        want = _encode(DIGITS, env["weights"], (pixels[:, f] + 1) / 2)
        np.testing.assert_allclose(s.read_features("repa", idx, flip=f).astype(np.float32), want, rtol=2e-3, atol=2e-4)
    mirrored = _encode(DIGITS, env["weights"], (pixels[:, 0].flip(-1) + 1) / 2)
    np.testing.assert_allclose(s.read_features("repa", idx, flip=1).astype(np.float32), mirrored, rtol=2e-3, atol=2e-4)
    assert not np.allclose(s.read_features("repa", idx, flip=0), s.read_features("repa", idx, flip=1), atol=0.01)
    flips = np.array([1, 0, 1, 1])
    np.testing.assert_array_equal(
        s.read_features("repa", idx, flip=flips), s.read_features("repa", idx)[np.arange(4), flips]
    )


@pytest.mark.parametrize("workers", [0, 1])
def test_batch_repa_is_the_features_of_the_flip_x_holds(env, workers):
    s = st.LatentStore(env["flipped"])
    dm = LatentDataModule(env["flipped"], global_batch_size=8, val_size=8, num_workers=workers, seed=3)
    assert dm.repa_spec is not None and dm.repa_spec["encoder"] == DIGITS
    assert (dm.repa_spec["tokens"], dm.repa_spec["dim"]) == (16, 64)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == 4 and set(batches[0]) == {"x", "y", "index", "repa"}
    flipped_some = False
    for b in batches:
        idx = b["index"].numpy()
        flip = flip_bits(3, 0, idx)
        flipped_some |= bool(flip.any() and not flip.all())
        assert b["repa"].shape == (8, 16, 64) and b["repa"].dtype == torch.float32
        np.testing.assert_array_equal(b["repa"].numpy(), s.read_features("repa", idx, flip=flip).astype(np.float32))
        np.testing.assert_array_equal(b["x"].numpy(), s.read(idx, flip=flip)[:, 0].astype(np.float32))
    assert flipped_some  # the batches mix both flips, so a wrong flip would show
    val = list(dm.val_dataloader())
    vi = np.concatenate([v["index"].numpy() for v in val])
    np.testing.assert_array_equal(
        np.concatenate([v["repa"].numpy() for v in val]), s.read_features("repa", vi, flip=0).astype(np.float32)
    )
    off = LatentDataModule(env["flipped"], global_batch_size=8, num_workers=workers, repa_features=False)
    assert off.repa_spec is None and set(next(iter(off.train_dataloader()))) == {"x", "y", "index"}
    assert LatentDataModule(env["plain"], global_batch_size=8).repa_spec is None


def _run_and_die(out: str, weights: str, exit_after: str) -> None:
    os.environ[EXIT_AFTER_ENV] = exit_after
    extract_latents(output=out, repa_encoder=DIGITS, repa_weights=weights, **QUIET)  # type: ignore[arg-type]


@pytest.mark.parametrize("exit_after", ["1", "0+"])
def test_killed_features_pass_resumes_to_identical_bytes(env, exit_after):
    """Kill the features pass after a committed shard ("1") or inside one ("0+": after its features
    file, before its commit record), rerun, and get the bytes of the uninterrupted run."""
    import multiprocessing as mp

    out = str(env["root"] / f"kill{exit_after.replace('+', 'p')}")
    shutil.copytree(env["plain"], out)
    proc = mp.get_context("fork").Process(target=_run_and_die, args=(out, env["weights"], exit_after))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 17  # os._exit from the test hook, no cleanup ran
    repa = st.load_features_plan(out, "repa")
    assert repa is not None and st.features_status(out, repa) == (([0], [1]) if exit_after == "1" else ([], [0, 1]))
    if exit_after == "0+":
        assert os.path.exists(os.path.join(out, "shards", "shard-00000.repa.npy"))  # written, not committed
    assert st.LatentStore(out).features == {}  # meantime the store reads as before: latents, no features
    summary = extract_latents(output=out, repa_encoder=DIGITS, repa_weights=env["weights"], **QUIET)
    assert summary["finalized"] and summary["features_written"] == (1 if exit_after == "1" else 2)
    assert tree_bytes(out) == tree_bytes(env["feat"])


def test_verify_names_a_corrupt_or_truncated_features_file(env):
    bad = str(env["root"] / "corrupt")
    shutil.copytree(env["feat"], bad)
    f = os.path.join(bad, "shards", "shard-00001.repa.npy")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:  # same size, other bytes: only the checksum can tell
        fh.seek(size - 64)
        fh.write(b"\x01" * 16)
    problems = st.verify_store(bad, fixes=REPA_FIXES)
    assert len(problems) == 1 and "shard-00001.repa.npy changed since it was written" in problems[0]
    assert f"--repa_encoder {DIGITS}" in problems[0] and "delete" in problems[0]
    with open(f, "r+b") as fh:  # NaN (float16 0x7e00) where a value was: the values scan finds it
        fh.seek(size - 64)
        fh.write(b"\x00\x7e" * 8)
    assert "holds 8 non-finite values" in st.verify_store(bad, checksums=False, fixes=REPA_FIXES)[0]
    with open(f, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(st.StoreError, match=r"repa features file .*shard-00001.repa.npy is truncated.*repa_encoder"):
        st.LatentStore(bad, REPA_FIXES)
    os.remove(f)  # the fix the message gives: delete it and rerun; only that shard is computed again
    summary = extract_latents(output=bad, repa_encoder=DIGITS, repa_weights=env["weights"], **QUIET)
    assert summary["features_written"] == 1 and tree_bytes(bad) == tree_bytes(env["feat"])


def test_features_of_other_settings_are_refused(env):
    before = tree_bytes(env["feat"])
    with pytest.raises(st.StoreError, match=r"another encoder than the one asked: weights sha256 .*never mixed"):
        extract_latents(output=env["feat"], repa_encoder=DIGITS, repa_weights=env["other"], **QUIET)
    with pytest.raises(st.StoreError, match=r"image size 16 \(the store's: None\)"):
        extract_latents(
            output=env["feat"], repa_encoder=DIGITS, repa_weights=env["weights"], repa_image_size=16, **QUIET
        )
    with pytest.raises(ValueError, match="needs --repa_weights"):
        extract_latents(output=env["feat"], repa_encoder=DIGITS, **QUIET)
    with pytest.raises(ValueError, match="need --repa_encoder"):
        extract_latents(output=env["feat"], repa_weights=env["weights"], **QUIET)
    assert tree_bytes(env["feat"]) == before  # nothing was changed


def test_vae_store_features_inline_and_added_later(env):
    """A VAE store: features computed during extraction are the encoder's on the very crop (and its
    mirror) the VAE encoded; added later from --image_root, they are the same; another folder is refused."""
    root = env["root"]
    images, vae = str(root / "images"), str(root / "vae")
    make_image_folder(images, with_bad=False)
    make_tiny_vae(vae)
    torch.manual_seed(1)
    weights = str(root / "rgb.pt")
    torch.save(RGBEncoder().state_dict(), weights)
    args = dict(vae=vae, image_size=16, batch_size=3, shard_size=4, limit=7, **QUIET)
    inline = extract_latents(images, str(root / "vae_inline"), repa_encoder=RGB, repa_weights=weights, **args)
    s = st.LatentStore(inline["output"])
    assert (s.features["repa"].tokens, s.features["repa"].dim) == (64, 8) and len(s) == 7
    sources = open(os.path.join(inline["output"], "sources.txt")).read().split()
    x = torch.stack([preprocess(os.path.join(images, p), 16)[0] for p in sources])  # the VAE's input, [-1, 1]
    x = (x + 1) / 2
    for f, img in enumerate([x, x.flip(-1)]):
        np.testing.assert_allclose(
            s.read_features("repa", np.arange(7), flip=f).astype(np.float32),
            _encode(RGB, weights, img),
            rtol=2e-3,
            atol=2e-4,
        )
    # a shard lost mid-extraction: resuming without the --repa_* arguments would leave it without features
    resumed = str(root / "vae_resumed")
    shutil.copytree(inline["output"], resumed)
    os.remove(os.path.join(resumed, "shards", "shard-00001.json"))
    with pytest.raises(st.StoreError, match="being extracted with REPA features.*resume with the same --repa_encoder"):
        extract_latents(images, resumed, **args)
    again = extract_latents(images, resumed, repa_encoder=RGB, repa_weights=weights, **args)
    assert again["shards_written"] == 1 and tree_bytes(resumed) == tree_bytes(inline["output"])
    later = str(root / "vae_later")
    extract_latents(images, later, **args)  # latents only, long ago
    assert st.LatentStore(later).features == {}
    elsewhere = str(root / "images2")
    make_image_folder(elsewhere, with_bad=False, seed=1)
    os.remove(os.path.join(elsewhere, "cls_a", "img_0.JPEG"))
    with pytest.raises(ValueError, match="does not hold the images the store was extracted from"):
        extract_latents(elsewhere, later, repa_encoder=RGB, repa_weights=weights, **QUIET)
    summary = extract_latents(images, later, repa_encoder=RGB, repa_weights=weights, **QUIET)
    assert summary["features_written"] == 2 and summary["finalized"]
    np.testing.assert_allclose(
        st.LatentStore(later).read_features("repa", np.arange(7)).astype(np.float32),
        s.read_features("repa", np.arange(7)).astype(np.float32),
        atol=2e-4,
    )


def test_extract_signature_has_the_repa_arguments():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_function_arguments(extract_latents)
    cfg = parser.parse_args(["--output", "b", "--repa_encoder", "dinov2-vitb14", "--repa_weights", "w.pth"])
    assert cfg.repa_encoder == "dinov2-vitb14" and cfg.repa_weights == "w.pth" and cfg.repa_image_size is None


LEGACY = os.path.join(os.path.dirname(__file__), "legacy_repa_store")
PATCH = "tests.helpers.data.PatchEncoder"


def _legacy_inputs() -> tuple[st.StoreSpec, np.ndarray, np.ndarray]:
    """The plan, pixels (6, F=2, 1, 1, 8, 8) and labels of tests/data/legacy_repa_store."""
    spec = st.StoreSpec(
        latent_shape=(1, 8, 8), dtype="float16", variant="sample", flips=True, scale_factor=1.0, vae="none/pixels",
        image_size=8, class_names=("a", "b"), source="fixture", num_items=6, shard_size=4, preprocessing="none",
    )  # fmt: skip
    x = ((np.arange(6 * 64).reshape(6, 1, 8, 8) % 17) / 8 - 1).astype(np.float32)
    return spec, np.stack([x, x[..., ::-1]], 1)[:, :, None].astype(np.float16), (np.arange(6) % 2).astype(np.int32)


def test_a_store_written_before_feature_sets_were_generic_reads_and_is_written_byte_for_byte(tmp_path):
    """tests/data/legacy_repa_store was written by the REPA-specific store code (commit 3236292; the
    encoder's features are exact, so its bytes are the same on every machine): shard 0 with its features
    inline, shard 1 by a features pass. It reads and verifies unchanged, its key is the one computed
    today, and today's code writes the same bytes from the same inputs."""
    old, weights = os.path.join(LEGACY, "store"), os.path.join(LEGACY, "patch.pt")
    s = st.LatentStore(old, REPA_FIXES)
    fs = s.features["repa"]
    identity = EncoderIdentity.of(REPAOptions(encoder=PATCH, weights=weights))
    assert fs.source == identity.store_record("patch.pt") and (fs.tokens, fs.dim) == (16, 4)
    assert fs.key == identity.features_key(16, 4) == "984484fc9d0a0a19"
    # the key's rule, written out: sha256 of the sorted JSON of these six fields, its first 16 hex digits
    d = {"encoder": PATCH, "weights_sha256": file_sha256(weights), "image_size": None, "tokens": 16, "dim": 4}
    assert fs.key == hashlib.sha256(json.dumps({**d, "dtype": "float16"}, sort_keys=True).encode()).hexdigest()[:16]
    assert st.verify_store(old) == [] and s.check_records() == [] and st.foreign_entries(old) == []
    spec, data, labels = _legacy_inputs()
    images = (torch.from_numpy(data[:, :, 0].astype(np.float32)).flatten(0, 1) + 1) / 2
    want = _encode(PATCH, weights, images).reshape(6, 2, 16, 4).astype(np.float16)
    np.testing.assert_array_equal(s.read_features("repa", np.arange(6)), want)
    dm = LatentDataModule(old, global_batch_size=2, num_workers=0)
    assert dm.repa_spec == json.load(open(os.path.join(old, "repa.json"))) and dm.repa_unfinished is None

    new = str(tmp_path / "store")  # the same steps with today's code
    st.write_plan(new, spec)
    features = st.write_features_plan(new, repa_feature_spec(identity, "patch.pt", 16, 4))
    a, b = spec.shard_range(0)
    st.write_shard(
        new, 0, spec, data[a:b], labels[a:b], [f"img{i}" for i in range(a, b)], features=[(features, want[a:b])]
    )
    a, b = spec.shard_range(1)
    st.write_shard(new, 1, spec, data[a:b], labels[a:b], [f"img{i}" for i in range(a, b)])
    summary = extract_latents(output=new, repa_encoder=PATCH, repa_weights=weights, **QUIET)
    assert summary["features_written"] == 1 and summary["finalized"]
    assert tree_bytes(new) == tree_bytes(old)


def test_training_refuses_a_store_whose_commit_records_disagree_with_its_index(env, tmp_path):
    """What ``verify`` reports of the commit records, the DataModule refuses too (cheaply: the records,
    not the data): a shard's record gone, or one committing another encoder's features file."""
    missing, other = str(tmp_path / "missing"), str(tmp_path / "other")
    shutil.copytree(env["feat"], missing)
    shutil.copytree(env["feat"], other)
    os.remove(os.path.join(missing, "shards", "shard-00001.json"))
    record = os.path.join(other, "shards", "shard-00000.json")
    rec = json.load(open(record))
    json.dump({**rec, "repa": {**rec["repa"], "key": "0123456789abcdef"}}, open(record, "w"))
    for path, problem in (
        (missing, "shard-00001.json, the commit record of shard 1, is missing: the shard is not committed"),
        (other, "the commit record of shard 0 does not commit it (key 0123456789abcdef"),
    ):
        with pytest.raises(st.StoreError, match="inconsistent, not trained on") as refused:
            LatentDataModule(path, global_batch_size=8, num_workers=0)
        assert problem in str(refused.value) and f"dit-lightning verify {path}" in str(refused.value)
        found = st.verify_store(path, fixes=REPA_FIXES)
        assert len(found) == 1 and problem in found[0] and found[0] in str(refused.value)
    fix = f"rerun `dit-lightning extract --output {other} --repa_encoder {DIGITS} --repa_weights <enc.pt>`"
    assert fix in found[0]
    from dit_lightning.commands.verify import VerificationError, verify

    with pytest.raises(VerificationError, match="1 problem") as reported:
        verify(other)
    assert fix in str(reported.value)  # the command names REPA's remedy
