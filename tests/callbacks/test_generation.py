"""GenerationMetrics: what `dit-lightning test` reports besides the loss (FID / KID with a tiny
feature extractor, the digits metrics), that it measures exactly the samples it claims, and that
every bad setting fails before the first test batch."""

from __future__ import annotations

import csv
import json

import lightning as L
import numpy as np
import pytest
import torch

from dit_lightning.callbacks import GenerationMetrics
from dit_lightning.data import LatentDataModule
from dit_lightning.evaluation.digits import digits_metrics, uint8_digit_features
from dit_lightning.evaluation.fid import InceptionWeightsMissing
from dit_lightning.images import to_uint8
from dit_lightning.module import DiTModule
from dit_lightning.sampling import parse_labels
from tests.helpers.tiny_features import TinyFeatures

N, STEPS = 23, 3  # an odd count: the last batch is short


pytestmark = pytest.mark.usefixtures("one_thread")


def build(store: str, val_size: int = 32, **kw) -> tuple[DiTModule, LatentDataModule]:
    L.seed_everything(0, verbose=False)
    dm = LatentDataModule(store, global_batch_size=32, val_size=val_size, num_workers=0, random_flip=False)
    module = DiTModule(
        "custom", latent_shape=dm.latent_shape, num_classes=dm.num_classes, depth=2, hidden_size=32, num_heads=4,
        patch_size=2, vae=dm.spec.vae, sample_steps=STEPS, ema_decay=0.5, **kw,
    )  # fmt: skip
    return module, dm


def trainer(callbacks, tmp_path=None, **kw) -> L.Trainer:
    logger = L.pytorch.loggers.CSVLogger(str(tmp_path), name="", version="") if tmp_path else False
    return L.Trainer(
        accelerator="cpu", max_steps=kw.pop("max_steps", 4), logger=logger, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, log_every_n_steps=1, **kw,
    )  # fmt: skip


def sampled_images(module: DiTModule, n: int, labels: str = "0-9", seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The uint8 (n, H, W, C) images sample i = 0..n-1 should be, made in one batch, and their labels."""
    y = parse_labels(labels, 10, seed=seed)(np.arange(n))
    latents = module.sample(y, indices=torch.arange(n), seed=seed, num_steps=STEPS)
    return to_uint8(module.decode(latents)), y.numpy()


@pytest.fixture(scope="module")
def trained(store):
    module, dm = build(store)
    trainer([]).fit(module, dm)
    return module, dm


def test_digits_metrics_are_those_of_the_keyed_samples_whatever_the_batching(trained):
    module, dm = trained
    images, labels = sampled_images(module, N)
    want = digits_metrics(uint8_digit_features(torch.from_numpy(images).permute(0, 3, 1, 2)), labels)
    got = []
    for batch_size in (N, 5):
        cb = GenerationMetrics(metrics=["digits"], num_samples=N, labels="0-9", batch_size=batch_size)
        results = trainer([cb]).test(module, dm, verbose=False)[0]
        assert results["test/loss"] > 0  # the held-out loss is still there
        got.append(results)
        assert cb.last["digits"]["per_class"] == want["per_class"]
    for results in got:
        assert results["test/digits_accuracy"] == pytest.approx(want["accuracy"])
        assert results["test/digits_fd_pixels"] == pytest.approx(want["frechet"]["fd_pixels"], rel=1e-5)
        assert results["test/digits_fd_svc"] == pytest.approx(want["frechet"]["fd_svc"], rel=1e-5)
        assert results["test/digits_fd_pixels_real_baseline"] == pytest.approx(
            want["frechet"]["fd_pixels_real_baseline"], rel=1e-5
        )


def test_fid_is_zero_against_the_same_samples_and_grows_against_others(trained, tmp_path):
    module, dm = trained
    images, _ = sampled_images(module, N)
    same = tmp_path / "same.npz"
    np.savez(same, arr_0=np.repeat(images, 3, axis=-1))  # the ADM format: (N, H, W, 3) uint8
    noisy = np.clip(images.astype(np.float64) + np.random.default_rng(0).normal(0, 60, images.shape), 0, 255).astype(
        np.uint8
    )
    other = tmp_path / "noisy.npz"
    np.savez(other, arr_0=np.repeat(noisy, 3, axis=-1))
    fids = {}
    for name, ref in (("same", same), ("noisy", other)):
        cb = GenerationMetrics(
            metrics=["fid", "kid"], num_samples=N, labels="0-9", reference=str(ref),
            feature_extractor=TinyFeatures(channels=3),
            cache_dir=str(tmp_path / "cache"), kid_subset_size=10, output=str(tmp_path / f"{name}-{{stage}}.json"),
        )  # fmt: skip
        results = trainer([cb]).test(module, dm, verbose=False)[0]
        fids[name] = results["test/fid"]
        assert np.isfinite(results["test/kid"])
        saved = json.loads((tmp_path / f"{name}-test.json").read_text())
        assert saved["fid"] == pytest.approx(results["test/fid"], rel=1e-5) and saved["num_reference"] == N
        assert saved["sampling"]["num_steps"] == STEPS and saved["sampling"]["weights"] == "ema"
    assert abs(fids["same"]) < 1e-4
    assert fids["noisy"] > 1e-2


class CountBatches(L.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_test_batch_start(self, *args, **kwargs) -> None:
        self.batches += 1


@pytest.mark.parametrize(
    "settings, error, match",
    [
        ({"metrics": ["fid"]}, ValueError, "reference"),
        (
            {"metrics": ["fid"], "reference": "missing.npz", "feature_extractor": TinyFeatures(channels=3)},
            FileNotFoundError,
            "missing.npz",
        ),
        ({"metrics": ["is"], "feature_extractor": TinyFeatures(channels=3)}, ValueError, "logits"),
        (
            {"metrics": ["fid"], "reference": ".", "inception_weights": "nowhere/inception.pth"},
            InceptionWeightsMissing,
            "--inception_weights",
        ),
        ({"metrics": ["digits"], "num_samples": 1}, ValueError, "num_samples"),
        ({"metrics": ["digits"], "labels": "3,12"}, ValueError, "outside the model's 10 classes"),
        ({"metrics": ["digits", "precision"]}, ValueError, "unknown metrics"),
    ],
)
def test_bad_settings_fail_before_the_first_test_batch(trained, settings, error, match):
    module, dm = trained
    count = CountBatches()
    with pytest.raises(error, match=match):
        trainer([count, GenerationMetrics(**settings)]).test(module, dm, verbose=False)
    assert count.batches == 0


def test_digits_metric_refuses_a_latent_model(store):
    module = DiTModule(
        "custom", latent_shape=(4, 8, 8), num_classes=10, depth=1, hidden_size=32, num_heads=4, patch_size=2
    )
    with pytest.raises(ValueError, match="digits demo"):
        GenerationMetrics(metrics=["digits"]).check(module)


def test_test_without_a_held_out_split_says_how_to_get_one(store):
    module, dm = build(store, val_size=0)
    with pytest.raises(ValueError, match="val_size"):
        trainer([]).test(module, dm, verbose=False)


def test_validate_stage_logs_a_curve_during_fit_but_not_in_the_sanity_check(store, tmp_path):
    module, dm = build(store)
    cb = GenerationMetrics(metrics=["digits"], num_samples=10, labels="0-9", stages=["validate"])
    trainer(
        [cb], tmp_path, max_steps=4, val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=1
    ).fit(module, dm)
    with open(tmp_path / "metrics.csv") as f:
        steps = sorted(int(r["step"]) for r in csv.DictReader(f) if r.get("val/digits_accuracy"))
    assert steps == [1, 3]  # after optimiser steps 2 and 4 (logged at step - 1), none at step 0
