"""`extract --vae none`: an ImageFolder of one's own as a pixel store (no VAE, nothing downloaded),
and `data.prepare: images`, which writes it on a run's first use."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import numpy as np
import pytest
from PIL import Image

from dit_lightning.data import LatentDataModule
from dit_lightning.data import extract as ex
from dit_lightning.data import store as st
from dit_lightning.data.extract import EXIT_AFTER_ENV, extract_latents
from dit_lightning.data.preprocessing import adm_center_crop
from tests.helpers.data import make_digit_folder, tree_bytes

ARGS = dict(batch_size=4, shard_size=8, num_workers=0, progress=False)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pixels")
    grey, colour = str(root / "grey"), str(root / "colour")
    make_digit_folder(grey, n=20, size=(28, 28))
    make_digit_folder(colour, n=12, size=(30, 26), colour=True)
    return {"root": root, "grey": grey, "colour": colour}


@pytest.fixture
def no_vae(monkeypatch):
    """Any VAE loading (the hub included) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a pixel store must never load a VAE")

    monkeypatch.setattr(ex, "load_vae", refuse)


def expected(root: str, rel: str, size: int, mode: str) -> np.ndarray:
    """What the store must hold for one file: PIL's image in ``mode``, the ADM crop, then [-1, 1]
    (in float16, the storage dtype), as (C, H, W)."""
    with Image.open(os.path.join(root, rel)) as im:
        image = im.convert(mode)
    arr = np.asarray(adm_center_crop(image, size), np.float32)
    arr = arr[:, :, None] if arr.ndim == 2 else arr
    return (arr / 127.5 - 1).astype(np.float16).transpose(2, 0, 1)


def sources(store: str) -> list[str]:
    return open(os.path.join(store, "sources.txt")).read().split()


@pytest.mark.parametrize("vae", ["none", "none/pixels"])
def test_grey_folder_is_a_one_channel_pixel_store_exactly_pil_and_the_crop(folders, tmp_path, no_vae, vae):
    out = str(tmp_path / "store")
    summary = extract_latents(folders["grey"], out, vae=vae, image_size=16, **ARGS)
    assert summary["finalized"] and summary["count"] == 20 and summary["images_converted"] == 0
    s = st.LatentStore(out)
    assert s.latent_shape == (1, 16, 16) and s.meta["sample_shape"] == [2, 1, 1, 16, 16]
    assert s.meta["vae"] == "none/pixels" and s.scale_factor == 1.0 and s.meta["variant"] == "sample"
    assert s.meta["extra"] == {} and s.class_names == sorted({p.split("/")[0] for p in sources(out)})
    for i, rel in enumerate(sources(out)):
        want = expected(folders["grey"], rel, 16, "L")
        np.testing.assert_array_equal(s.read([i], flip=0)[0, 0], want)
        np.testing.assert_array_equal(s.read([i], flip=1)[0, 0], want[:, :, ::-1])
    assert not st.verify_store(out)  # sizes, checksums, values


@pytest.mark.parametrize("channels", ["auto", 1, 3])
def test_colour_folder_is_three_channels_unless_asked_for_one(folders, tmp_path, no_vae, channels):
    out = str(tmp_path / "store")
    extract_latents(folders["colour"], out, vae="none", image_size=12, flips=False, channels=channels, **ARGS)
    s = st.LatentStore(out)
    mode = "L" if channels == 1 else "RGB"
    assert s.latent_shape == ((1 if channels == 1 else 3), 12, 12) and s.meta["num_flips"] == 1
    for i, rel in enumerate(sources(out)):
        np.testing.assert_array_equal(s.read([i], flip=0)[0, 0], expected(folders["colour"], rel, 12, mode))


def test_one_colour_image_makes_the_folder_three_channels(folders, tmp_path, no_vae):
    mixed = str(tmp_path / "mixed")
    paths = make_digit_folder(mixed, n=6)
    Image.new("RGB", (28, 28), (200, 10, 10)).save(os.path.join(mixed, paths[0]))
    out = str(tmp_path / "store")
    extract_latents(mixed, out, vae="none", image_size=8, **ARGS)
    s = st.LatentStore(out)
    assert s.latent_shape == (3, 8, 8)
    i = sources(out).index(paths[1])  # a grey file: its value repeated in the three channels
    np.testing.assert_array_equal(s.read([i], flip=0)[0, 0], expected(mixed, paths[1], 8, "RGB"))
    assert np.ptp(s.read([i], flip=0)[0, 0].astype(np.float32), axis=0).max() == 0


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"vae": "none/latents"}, "names no VAE: a pixel store is --vae none"),
        ({"vae": "none", "variant": "moments"}, "pixel store"),
        ({"vae": "none", "channels": 2}, "channels must be auto, 1 or 3"),
        ({"vae": "none", "scale_factor": 0.5}, "scale 1.0"),
        ({"vae": "some/vae", "channels": 1}, "for pixel stores"),
        (
            {"vae": "some/vae", "latent_norm": "channel_stats", "scale_factor": 0.5},
            "--scale_factor applies to --latent_norm scale; channel_stats measures its own statistics",
        ),
    ],
)
def test_bad_pixel_settings_are_refused_before_any_work(folders, tmp_path, no_vae, settings, match):
    out = str(tmp_path / "store")
    with pytest.raises(ValueError, match=match):
        extract_latents(folders["grey"], out, image_size=8, **settings, **ARGS)
    assert not os.path.exists(out)


def _run_and_die(images: str, out: str, exit_after: str) -> None:
    os.environ[EXIT_AFTER_ENV] = exit_after
    extract_latents(images, out, vae="none", image_size=16, **ARGS)  # type: ignore[arg-type]


@pytest.mark.parametrize("exit_after", ["1", "1+"])
def test_killed_pixel_extraction_resumes_to_the_same_bytes(folders, tmp_path, no_vae, exit_after):
    """Killed after a committed shard ("1") or inside the next one ("1+"), then rerun: the bytes of
    an uninterrupted run; `--overwrite true` replaces a pixel store (here by one of another size)
    without any VAE."""
    ref, out = str(tmp_path / "ref"), str(tmp_path / "out")
    extract_latents(folders["grey"], ref, vae="none", image_size=16, **ARGS)
    proc = mp.get_context("fork").Process(target=_run_and_die, args=(folders["grey"], out, exit_after))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 17
    assert st.shard_status(out)[0] == [0] and not os.path.exists(os.path.join(out, st.META_FILE))
    summary = extract_latents(folders["grey"], out, vae="none", image_size=16, **ARGS)
    assert summary["finalized"] and summary["shards_already_done"] == 1 and summary["shards_written"] == 2
    assert tree_bytes(out) == tree_bytes(ref)
    replaced = extract_latents(folders["grey"], out, vae="none", image_size=12, overwrite=True, **ARGS)
    assert replaced["shards_written"] == 3 and st.LatentStore(out).latent_shape == (1, 12, 12)


def test_a_vae_extraction_into_a_pixel_store_names_the_pixel_store(folders, tmp_path, no_vae):
    out = str(tmp_path / "store")
    extract_latents(folders["grey"], out, vae="none", image_size=8, **ARGS)
    before = tree_bytes(out)
    with pytest.raises(st.StoreError, match=r"holds a pixel store \(--vae none\), asked --vae some/vae: .*--overwrite"):
        extract_latents(folders["grey"], out, vae="some/vae", image_size=8, **ARGS)
    assert tree_bytes(out) == before


# ---- data.prepare: images -------------------------------------------------------------------


def data(path: str, image_root: str, **kw) -> LatentDataModule:
    kw = {"global_batch_size": 4, "val_size": 4, "num_workers": 0, "random_flip": False, **kw}
    return LatentDataModule(path, prepare="images", image_root=image_root, **kw)


def test_prepare_images_writes_the_pixel_store_it_announced(folders, tmp_path, no_vae):
    path = str(tmp_path / "store")
    dm = data(path, folders["grey"], image_size=16)
    announced = dm.spec  # what the model is linked to, before anything is written
    assert dm.latent_shape == (1, 16, 16) and dm.num_classes == 10 and dm.spec.vae == "none/pixels"
    assert not os.path.exists(path)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.spec.to_json() == announced.to_json()
    assert not dm.spec.flips  # random_flip false: no mirrors stored
    batch = next(iter(dm.val_dataloader()))
    rels = sources(path)
    want = np.stack([expected(folders["grey"], rels[i], 16, "L") for i in batch["index"].tolist()])
    np.testing.assert_array_equal(batch["x"].numpy(), want.astype(np.float32))
    again = data(path, folders["grey"], image_size=16)  # a second run finds it and writes nothing
    assert again.spec.to_json() == announced.to_json()


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"image_root": "colour", "image_size": 16}, st.StoreError, "made from"),
        ({"image_root": "grey", "image_size": 12}, st.StoreError, "16 px, not 12"),
        ({"image_root": "grey", "image_size": 16, "image_channels": 3}, st.StoreError, "1 channel"),
        (
            {"image_root": "grey", "image_size": 16, "random_flip": True},
            st.StoreError,
            r"--data.path .* no mirrored images \(prepared with --data.random_flip false\), and this run flips them. "
            "Point --data.path at a directory of its own",
        ),
        ({"image_root": "grey"}, ValueError, "--data.image_size"),
        ({"image_root": "nowhere", "image_size": 16}, FileNotFoundError, "nowhere"),
    ],
)
def test_prepare_images_refuses_a_store_of_other_images(folders, tmp_path, no_vae, kw, error, match):
    path = str(tmp_path / "store")
    data(path, folders["grey"], image_size=16).prepare_data()
    before = tree_bytes(path)
    kw["image_root"] = folders.get(kw["image_root"], kw["image_root"])
    with pytest.raises(error, match=match):
        data(path, **kw)
    assert tree_bytes(path) == before


def test_an_unfinished_preparation_resumes_only_with_its_own_settings(folders, tmp_path, no_vae):
    path = str(tmp_path / "store")
    data(path, folders["grey"], image_size=16).prepare_data()
    whole = tree_bytes(path)
    os.remove(os.path.join(path, st.META_FILE))  # a preparation that stopped before its index
    with pytest.raises(st.StoreError, match="16 px, not 12"):
        data(path, folders["grey"], image_size=12).prepare_data()
    dm = data(path, folders["grey"], image_size=16)
    dm.prepare_data()
    assert tree_bytes(path) == whole


def test_image_settings_without_prepare_images_are_refused(folders):
    with pytest.raises(ValueError, match="--data.prepare images"):
        LatentDataModule("somewhere", image_root=folders["grey"])


def test_extract_command_line_writes_the_same_store(folders, tmp_path):
    """The CLI (in process): `dit-lightning extract --vae none/pixels ...` parses and writes the store."""
    from dit_lightning.cli import main

    out = str(tmp_path / "store")
    main(
        ["extract", "--vae", "none/pixels", "--image_root", folders["colour"], "--output", out, "--image_size",
         "12", "--channels", "1", "--num_workers", "0", "--progress", "false"]
    )  # fmt: skip
    meta = json.load(open(os.path.join(out, st.META_FILE)))
    assert meta["latent_shape"] == [1, 12, 12] and meta["vae"] == "none/pixels"


# ---- the Frechet distance against the store's own held-out images ----------------------------


def test_fd_reference_is_the_stores_held_out_split(folders, tmp_path, no_vae):
    """`test --evaluation.reference store`: the reference statistics are the run's extractor's features
    of the held-out items of a pixel store made from a folder (the PIL crops of those very files)."""
    import lightning as L
    import torch

    from dit_lightning.callbacks import GenerationMetrics
    from dit_lightning.evaluation.fid import FeatureStats
    from dit_lightning.module import DiTModule
    from tests.helpers.tiny_features import TinyFeatures

    torch.manual_seed(0)
    path = str(tmp_path / "store")
    dm = data(path, folders["grey"], image_size=16, val_size=6)
    module = DiTModule(
        "custom", latent_shape=dm.latent_shape, num_classes=dm.num_classes, depth=1, hidden_size=32, num_heads=4,
        patch_size=4, vae=dm.spec.vae, sample_steps=2,
    )  # fmt: skip
    extractor = TinyFeatures(channels=3)
    cb = GenerationMetrics(
        metrics=["fid"], num_samples=4, reference="store", feature_extractor=extractor, cache_dir=None, labels="0-3"
    )
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[cb],
    )  # fmt: skip
    results = trainer.test(module, dm, verbose=False)[0]
    assert np.isfinite(results["test/fid"]) and results["test/fid"] > 0 and cb.last["num_reference"] == 6
    rels = sources(path)
    crops = np.stack([expected(folders["grey"], rels[i], 16, "L")[0] for i in dm.val_indices])
    images = np.round((crops.astype(np.float32) + 1) * 127.5).astype(np.uint8)  # the files' own bytes
    with torch.no_grad():
        feats = extractor(torch.from_numpy(images)[:, None].expand(-1, 3, -1, -1).contiguous()).double().numpy()
    want = FeatureStats.from_features(feats)
    np.testing.assert_allclose(cb._reference.mu, want.mu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cb._reference.sigma, want.sigma, rtol=1e-5, atol=1e-7)

    without = data(path, folders["grey"], image_size=16, val_size=0)
    cb = GenerationMetrics(metrics=["fid"], num_samples=4, reference="store", feature_extractor=extractor)
    with pytest.raises(ValueError, match="--data.val_size"):
        trainer.__class__(accelerator="cpu", logger=False, callbacks=[cb]).test(module, without, verbose=False)


def test_evaluate_has_no_store_to_hold_out(tmp_path):
    from dit_lightning.commands.evaluate import evaluate

    with pytest.raises(ValueError, match="evaluate has no run"):
        evaluate("model.ckpt", str(tmp_path / "out"), metrics=["fid"], reference="store")


# ---- the command line -------------------------------------------------------------------------


def images_args(folder: str, store: str, size: int) -> list[str]:
    return [
        "--data.path", store, "--data.prepare", "images", "--data.image_root", folder, "--data.image_size", str(size),
        "--data.random_flip", "false", "--data.val_size", "4", "--data.global_batch_size", "8",
    ]  # fmt: skip


def test_fit_prepares_the_store_of_an_image_folder_in_one_command(folders, tmp_path):
    """The documented recipe (flow matching, logit-normal times) on a folder of one's own: the store
    is written on first use, the model linked to its 1x16x16 pixels and 10 classes."""
    from tests.helpers.cli import fit_args, run_cli

    store = str(tmp_path / "mydigits")
    recipe = ["--model.objective", "flow", "--model.time_distribution", "logit_normal"]
    run_cli(fit_args(tmp_path, "run", 2, [*images_args(folders["grey"], store, 16), *recipe]), tmp_path)
    s = st.LatentStore(store)
    assert s.latent_shape == (1, 16, 16) and len(s) == 20 and s.meta["source"] == folders["grey"]
    assert os.path.exists(tmp_path / "run" / "ckpt" / "last.ckpt")


def test_fit_refuses_a_store_of_another_size_in_one_message(folders, tmp_path, capsys):
    from tests.helpers.cli import DEMO, TINY
    from tests.reliability.conftest import call, one_message

    store = str(tmp_path / "mydigits")
    data(store, folders["grey"], image_size=16).prepare_data()
    code, _, err = call(["fit", "--config", DEMO, *TINY, *images_args(folders["grey"], store, 12)], capsys)
    assert code == 1 and "its images are 16 px, not 12" in err and "Point --data.path at a directory" in err, err
    one_message(err)
