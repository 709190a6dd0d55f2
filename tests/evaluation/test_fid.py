"""FID / KID / IS plumbing with a tiny feature extractor (no Inception download possible here),
the cached reference statistics and the missing-weights error."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dit_lightning.commands.evaluate import evaluate
from dit_lightning.evaluation.fid import (
    INCEPTION_WEIGHTS_URL,
    FeatureStats,
    InceptionWeightsMissing,
    compute_metrics,
    extract_features,
    find_inception_weights,
    frechet_distance,
    image_batches,
    reference_stats,
)
from tests.helpers.tiny_features import TinyFeatures

pytestmark = pytest.mark.usefixtures("one_thread")


def smooth_images(n=80, size=16, seed=0):
    """uint8 (n, size, size, 3): random low-frequency colour patterns."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 4, 4, generator=g)
    return (
        (F.interpolate(low, size=size, mode="bilinear", align_corners=False) * 255)
        .round()
        .byte()
        .permute(0, 2, 3, 1)
        .numpy()
    )


def write_folder(path, images):
    from PIL import Image

    path.mkdir(parents=True, exist_ok=True)
    for i, im in enumerate(images):
        Image.fromarray(im).save(path / f"{i:04d}.png")
    return path


def write_npz(path, images):
    np.savez(path, arr_0=images)
    return path


def test_fid_against_itself_is_zero_and_grows_with_noise(tmp_path):
    images = smooth_images()
    real = write_folder(tmp_path / "real", images)
    ext = TinyFeatures()
    same = compute_metrics(
        write_npz(tmp_path / "same.npz", images), real, feature_extractor=ext, cache_dir=tmp_path / "c"
    )
    assert same["num_samples"] == same["num_reference"] == 80
    assert abs(same["fid"]) < 1e-4
    rng = np.random.default_rng(0)
    fids = []
    for sigma in (10, 40, 120):
        noisy = np.clip(images + rng.normal(0, sigma, images.shape), 0, 255).astype(np.uint8)
        fids.append(
            compute_metrics(
                write_npz(tmp_path / f"n{sigma}.npz", noisy), real, feature_extractor=ext, cache_dir=tmp_path / "c"
            )["fid"]
        )
    assert 1e-3 < fids[0] < fids[1] < fids[2]
    # torchmetrics' FID (fed our cached reference statistics) agrees with a direct computation
    f_real = extract_features(ext, image_batches(real)).astype(np.float64)
    f_fake = extract_features(ext, image_batches(tmp_path / "n120.npz")).astype(np.float64)
    direct = frechet_distance(
        f_fake.mean(0), np.cov(f_fake, rowvar=False), f_real.mean(0), np.cov(f_real, rowvar=False)
    )
    assert fids[2] == pytest.approx(direct, rel=1e-4)


def test_reference_stats_are_cached_per_source_and_extractor(tmp_path):
    real = write_folder(tmp_path / "real", smooth_images(40))
    cache = tmp_path / "cache"
    ext = TinyFeatures()
    a = reference_stats(real, ext, cache_dir=cache, batch_size=16)
    calls = ext.calls
    assert calls == 3 and len(list(cache.iterdir())) == 1
    b = reference_stats(real, ext, cache_dir=cache)
    assert ext.calls == calls  # loaded, not recomputed
    np.testing.assert_allclose(a.mu, b.mu) and np.testing.assert_allclose(a.sigma, b.sigma)
    reference_stats(real, TinyFeatures(seed=1), cache_dir=cache)  # another extractor: another entry
    write_folder(tmp_path / "real", smooth_images(41))  # the source changed: another entry
    reference_stats(real, ext, cache_dir=cache)
    assert len(list(cache.iterdir())) == 3
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_precomputed_mu_sigma_files_are_used_as_they_are(tmp_path):
    images = smooth_images()
    real = write_folder(tmp_path / "real", images)
    fake = write_npz(tmp_path / "fake.npz", smooth_images(seed=1))
    ext = TinyFeatures()
    from_images = compute_metrics(fake, real, feature_extractor=ext, cache_dir=None)["fid"]
    stats = reference_stats(real, ext, cache_dir=None)
    adm_style = tmp_path / "VIRTUAL_ref.npz"
    np.savez(adm_style, mu=stats.mu, sigma=stats.sigma)  # ADM reference batches: mu, sigma (no count)
    assert FeatureStats.load(adm_style).num_samples == 50_000
    assert compute_metrics(fake, adm_style, feature_extractor=ext, cache_dir=None)["fid"] == pytest.approx(
        from_images, rel=1e-6
    )


def test_kid_with_a_custom_extractor_and_is_needs_inception(tmp_path):
    real = write_folder(tmp_path / "real", smooth_images(60))
    fake = write_npz(tmp_path / "fake.npz", smooth_images(60, seed=2))
    out = compute_metrics(
        fake,
        real,
        metrics=["fid", "kid"],
        feature_extractor=TinyFeatures(),
        cache_dir=tmp_path / "c",
        kid_subset_size=20,
    )
    assert np.isfinite(out["kid"]) and out["kid_std"] >= 0 and out["fid"] > 0
    with pytest.raises(ValueError, match="logits"):
        compute_metrics(fake, metrics=["is"], feature_extractor=TinyFeatures())
    with pytest.raises(ValueError, match="reference"):
        compute_metrics(fake, None, feature_extractor=TinyFeatures())


def test_missing_inception_weights_say_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.delenv("DIT_INCEPTION_WEIGHTS", raising=False)
    with pytest.raises(InceptionWeightsMissing) as e:
        find_inception_weights()
    msg = str(e.value)
    for needle in (
        INCEPTION_WEIGHTS_URL,
        "weights-inception-2015-12-05-6726825d.pth",
        "pt_inception-2015-12-05-6726825d.pth",
        "--inception_weights",
        "DIT_INCEPTION_WEIGHTS",
    ):
        assert needle in msg
    with pytest.raises(InceptionWeightsMissing, match="does not exist"):
        find_inception_weights(str(tmp_path / "nope.pth"))
    # evaluate refuses before it samples anything
    with pytest.raises(InceptionWeightsMissing):
        evaluate("unused.ckpt", str(tmp_path / "out"), reference=str(tmp_path))
    assert not (tmp_path / "out").exists()


def test_inception_loads_offline_from_a_weights_path(tmp_path, monkeypatch):
    """torchmetrics' InceptionV3 built from a local file, never the network (random weights)."""
    fe = pytest.importorskip("torch_fidelity.feature_extractor_inceptionv3")
    from dit_lightning.evaluation.fid import InceptionFeatures

    with monkeypatch.context() as m:  # build the architecture once without any weights to write a file
        m.setattr(fe, "load_state_dict_from_url", lambda *a, **k: {})
        m.setattr(fe.FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd, *a, **k: None)
        weights = tmp_path / "inception-random-weights.pth"  # no published hash in the name: not checked
        torch.save(fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"]).state_dict(), weights)
    monkeypatch.setattr(fe, "load_state_dict_from_url", lambda *a, **k: pytest.fail("tried to download"))
    ext = InceptionFeatures(str(weights), logits=True)
    assert not ext.antialias and ext.identity().endswith("antialias=False")
    out = ext(torch.from_numpy(smooth_images(2, size=32)).permute(0, 3, 1, 2).contiguous())
    assert out.shape == (2, 2048 + 1008) and torch.isfinite(out).all()
