"""The latent transform (dit_lightning/latents.py): forward / inverse, records, comparisons, the
legacy reading, and LightningDiT's per-channel statistics (against a transcription of its code)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dit_lightning.data import store as st
from dit_lightning.latents import (
    ChannelMoments,
    LatentTransform,
    channel_statistics,
    legacy_transform,
    stats_indices,
    transform_of,
)

STATS = LatentTransform.channel_stats([0.5, -1.0, 2.0], [2.0, 0.25, 1.5], multiplier=0.7, samples=9)
SHIFTED = LatentTransform.scaled(1.5305, 0.0609)  # SD3's VAE factors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_forward_and_inverse_follow_the_published_formulas(dtype):
    x = (torch.randn(2, 3, 4, 4, dtype=torch.float64) * 3 + 1).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype != torch.bfloat16 else {"atol": 0.1, "rtol": 0.02}
    # diffusers: (x - shift) * scale, decoded as z / scale + shift
    torch.testing.assert_close(SHIFTED.forward(x), (x - 0.0609) * 1.5305, **tol)
    # LightningDiT: (x - mean) / std * multiplier, inverted as z / multiplier * std + mean
    mean = torch.tensor([0.5, -1.0, 2.0], dtype=dtype).view(1, 3, 1, 1)
    std = torch.tensor([2.0, 0.25, 1.5], dtype=dtype).view(1, 3, 1, 1)
    z = STATS.forward(x)
    assert z.dtype == dtype
    torch.testing.assert_close(z, (x - mean) / std * 0.7, **tol)
    for t in (SHIFTED, STATS, LatentTransform.pixels(), LatentTransform.scaled(0.18215)):
        torch.testing.assert_close(t.inverse(t.forward(x)), x, **tol)
    assert torch.equal(LatentTransform.pixels().forward(x), x)


def test_coefficients_are_the_same_affine_map():
    x = torch.randn(5, 3, 2, 2, dtype=torch.float64)
    for t in (SHIFTED, STATS, LatentTransform.scaled(0.13025)):
        a, b = t.coefficients(3)
        fused = x * torch.tensor(a, dtype=torch.float64).view(1, 3, 1, 1) + torch.tensor(b, dtype=torch.float64).view(
            1, 3, 1, 1
        )
        torch.testing.assert_close(fused, t.forward(x), rtol=1e-12, atol=1e-12)
        a, c = t.inverse_coefficients(3)
        back = fused * torch.tensor(a, dtype=torch.float64).view(1, 3, 1, 1) + torch.tensor(
            c, dtype=torch.float64
        ).view(1, 3, 1, 1)
        torch.testing.assert_close(back, x, rtol=1e-12, atol=1e-12)


def test_records_round_trip_through_json_and_compare():
    for t in (LatentTransform.pixels(), SHIFTED, STATS, LatentTransform.channel_stats(multiplier=0.5)):
        record = json.loads(json.dumps(t.record()))
        assert LatentTransform.from_record(record) == t
        assert t.difference(LatentTransform.from_record(record)) is None
    assert "scale 1.5305, shift 0.0609 vs scale 1.5305" in SHIFTED.difference(LatentTransform.scaled(1.5305))
    other = LatentTransform.channel_stats([0.5, -1.0, 2.0], [2.0, 0.26, 1.5], multiplier=0.7)
    assert "per-channel statistics of 3 channels" in STATS.difference(other)
    assert STATS.difference(LatentTransform.scaled(0.7)).startswith("per-channel")
    # float32 rounding of a record is not a difference
    rounded = [float(np.float32(v)) for v in STATS.std]
    assert STATS.difference(LatentTransform.channel_stats(STATS.mean, rounded, 0.7)) is None


def test_bad_records_and_unmeasured_statistics_are_refused():
    with pytest.raises(ValueError, match="kind one of pixels, scale, channel_stats"):
        LatentTransform.from_record({"kind": "zscore"})
    with pytest.raises(ValueError, match="every std must be positive"):
        LatentTransform.channel_stats([0.0], [0.0])
    with pytest.raises(ValueError, match="scale must be positive"):
        LatentTransform.scaled(0.0)
    planned = LatentTransform.channel_stats(multiplier=1.0)
    assert not planned.measured
    with pytest.raises(ValueError, match="no statistics yet.*rerun the same `dit-lightning extract`"):
        planned.forward(torch.zeros(1, 3, 2, 2))
    with pytest.raises(ValueError, match="statistics are for 3 channels, the latents have 4"):
        STATS.inverse(torch.zeros(1, 4, 2, 2))


def test_legacy_records_read_as_scale_or_pixels():
    assert legacy_transform("none/pixels", 1.0) == LatentTransform.pixels()
    assert legacy_transform("stabilityai/sd-vae-ft-ema", 0.18215) == LatentTransform.scaled(0.18215)
    assert transform_of({"vae": "ema", "model": "DiT-XL/2"}) == LatentTransform.scaled(0.18215)  # reference args
    assert transform_of({"vae": "/v", "scale_factor": 0.5}) == LatentTransform.scaled(0.5)
    assert transform_of({"vae": None, "scale_factor": None}) is None  # a run that named no VAE
    # a VAE without its factor does not say which (SDXL's is 0.13025): unknown, not DiT's 0.18215
    assert transform_of({"vae": "stabilityai/sdxl-vae"}) is None
    assert transform_of({"vae": "none/pixels"}) == LatentTransform.pixels()
    assert transform_of({}) is None  # a released raw state dict
    assert transform_of({"vae": "/v", "scale_factor": 0.5, "latent_transform": STATS.record()}) == STATS


def test_stats_subset_rule():
    assert stats_indices(7) == list(range(7))
    chosen = stats_indices(25, max_samples=10)
    assert len(chosen) == len(set(chosen)) == 10 and chosen == sorted(chosen) and chosen[-1] < 25
    assert chosen == stats_indices(25, max_samples=10) != list(range(10))  # seeded, random


def test_chunked_moments_equal_the_whole_batch():
    x = torch.randn(37, 3, 4, 4, dtype=torch.float64) * torch.tensor([1.0, 5.0, 0.1]).view(1, 3, 1, 1) + 3.0
    moments = ChannelMoments()
    for part in x.split([5, 1, 20, 11]):
        moments.update(part.float())
    mean, std = moments.result()
    np.testing.assert_allclose(mean, x.float().double().mean(dim=(0, 2, 3)).numpy(), rtol=1e-12)
    np.testing.assert_allclose(std, x.float().double().std(dim=(0, 2, 3)).numpy(), rtol=1e-12)


def test_statistics_match_lightningdit_compute_latent_stats(tmp_path):
    """LightningDiT's files hold one latent per image (its store holds the same latents as the unflipped
    posterior means here); their code and ours give the same numbers on the same latents."""
    from safetensors.torch import save_file

    from tests.helpers.lightningdit_reference_data import ImgLatentDataset

    rng = np.random.default_rng(1)
    latents = rng.standard_normal((30, 2, 1, 4, 3, 3)).astype(np.float16)  # (N, F, K, C, H, W)
    latents[:, :, 0] = latents[:, :, 0] * np.array([1.0, 3.0, 0.5, 8.0], np.float16).reshape(4, 1, 1) + 2
    spec = st.StoreSpec(
        latent_shape=(4, 3, 3), dtype="float16", variant="sample", flips=True, scale_factor=1.0, vae="v",
        image_size=24, class_names=("a",), source="s", num_items=30, shard_size=8,
        latent_transform=LatentTransform.channel_stats(multiplier=0.5).record(),
    )  # fmt: skip
    st.write_plan(tmp_path / "store", spec)
    for k in range(spec.num_shards):
        a, b = spec.shard_range(k)
        st.write_shard(
            tmp_path / "store", k, spec, latents[a:b], np.zeros(b - a, np.int32), [str(i) for i in range(a, b)]
        )
        # LightningDiT's layout: files of latents (their extraction's posterior samples), flips beside them
        unflipped = torch.from_numpy(latents[a:b, 0, 0].astype(np.float32))
        save_file(
            {"latents": unflipped, "labels": torch.zeros(b - a, dtype=torch.long)}, tmp_path / f"l{k}.safetensors"
        )
    assert "mean" not in st.load_plan(tmp_path / "store").latent_transform
    st.finalize_store(tmp_path / "store")
    ours = st.LatentStore(tmp_path / "store").transform
    np.random.seed(0)
    theirs = ImgLatentDataset(str(tmp_path)).compute_latent_stats()
    assert theirs["mean"].shape == (1, 4, 1, 1)
    np.testing.assert_allclose(ours.mean, theirs["mean"].flatten().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours.std, theirs["std"].flatten().numpy(), rtol=1e-6, atol=1e-6)
    assert ours.kind == "channel_stats" and ours.multiplier == 0.5 and ours.samples == 30
    meta = json.loads((tmp_path / "store" / "meta.json").read_text())
    assert meta["latent_transform"] == ours.record() and meta["scale_factor"] == 1.0
    # what the reader applies: LightningDiT's (z - mean) / std * multiplier
    z = ours.forward(torch.from_numpy(latents[:, 0, 0].astype(np.float32)))
    expect = (torch.from_numpy(latents[:, 0, 0].astype(np.float32)) - theirs["mean"]) / theirs["std"] * 0.5
    torch.testing.assert_close(z, expect, rtol=1e-5, atol=1e-5)


def test_one_chunk_helper():
    x = torch.randn(4, 2, 3, 3)
    mean, std = channel_statistics(x)
    np.testing.assert_allclose(std, x.double().std(dim=(0, 2, 3)).numpy(), rtol=1e-12)
    np.testing.assert_allclose(mean, x.double().mean(dim=(0, 2, 3)).numpy(), rtol=1e-12, atol=1e-15)
