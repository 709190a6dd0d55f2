"""Latent transforms end to end with tiny real VAEs (4 channels f8; 16 channels f16 with an SD3-style
shift): extraction reads the VAE's layout and factors, the store records the transform (per-channel
statistics measured at the end), the reader applies it, every decode inverts it, runs on another
transform are refused, and the diffusers export decodes like dit-lightning."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from dit_lightning.checkpoints import export_checkpoint, load_dit, save_dit
from dit_lightning.data import store as st
from dit_lightning.data.datamodule import LatentBatchDataset
from dit_lightning.data.extract import extract_latents
from dit_lightning.data.rng import NoiseKernel
from dit_lightning.latents import ChannelMoments, LatentTransform
from dit_lightning.module import DiTModule
from dit_lightning.vae import load_vae
from tests.helpers.vaes import make_vae

ARGS = dict(image_size=64, batch_size=8, shard_size=10, num_workers=0, progress=False)
SCALE, SHIFT = 1.5, 0.3


def make_images(root: str, per_class: int = 12) -> str:
    """Two classes of smooth random 64 px PNGs."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for i in range(per_class):
            base = rng.integers(0, 256, size=(9, 9, 3), dtype=np.uint8)
            Image.fromarray(base).resize((64, 64), Image.Resampling.BILINEAR).save(os.path.join(root, c, f"{i}.png"))
    return root


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("transforms")
    images = make_images(str(root / "images"))
    vae4 = make_vae(str(root / "vae4"), channels=4, factor=8)
    vae16 = make_vae(str(root / "vae16"), channels=16, factor=16, scaling_factor=SCALE, shift_factor=SHIFT)
    stores = {
        "f8c4": extract_latents(images, str(root / "f8c4"), vae=vae4, **ARGS)["output"],
        "f16c16": extract_latents(images, str(root / "f16c16"), vae=vae16, **ARGS)["output"],
        "stats": extract_latents(
            images, str(root / "stats"), vae=vae16, latent_norm="channel_stats", latent_multiplier=0.5, **ARGS
        )["output"],
    }
    yield {"root": root, "images": images, "vae4": vae4, "vae16": vae16, **stores}
    torch.set_num_threads(threads)


def raw_means(path: str) -> torch.Tensor:
    s = st.LatentStore(path)
    return torch.from_numpy(s.read(np.arange(len(s)), flip=0)[:, 0].astype(np.float32))


def test_extract_reads_channels_factor_scale_and_shift_of_the_vae(env):
    s4, s16 = st.LatentStore(env["f8c4"]), st.LatentStore(env["f16c16"])
    assert s4.latent_shape == (4, 8, 8) and s16.latent_shape == (16, 4, 4) and len(s16) == 24
    assert s4.meta["latent_transform"] == {"kind": "scale", "scale": 0.18215, "shift": 0.0}
    assert s16.meta["latent_transform"] == {"kind": "scale", "scale": SCALE, "shift": SHIFT}
    assert s16.scale_factor == SCALE  # still there for older readers
    plan = json.loads(open(os.path.join(env["f16c16"], st.PLAN_FILE)).read())
    assert plan["latent_transform"] == s16.meta["latent_transform"]


def test_channel_statistics_are_measured_at_the_end_and_again_on_resume(env):
    s = st.LatentStore(env["stats"])
    plan = json.loads(open(os.path.join(env["stats"], st.PLAN_FILE)).read())
    assert plan["latent_transform"] == {"kind": "channel_stats", "multiplier": 0.5}  # nothing measured in the plan
    moments = ChannelMoments()
    moments.update(raw_means(env["stats"]))  # every image (<= 10,000): the unflipped posterior means
    mean, std = moments.result()
    t = s.transform
    assert t.kind == "channel_stats" and t.samples == 24 and t.multiplier == 0.5
    np.testing.assert_allclose(t.mean, mean, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(t.std, std, rtol=1e-6)
    assert max(t.std) / min(t.std) > 1.5  # real per-channel spreads, not one number
    # killed after its last shard, before the index: the same command measures them again
    record = s.meta["latent_transform"]
    os.remove(os.path.join(env["stats"], st.META_FILE))
    summary = extract_latents(
        env["images"], env["stats"], vae=env["vae16"], latent_norm="channel_stats", latent_multiplier=0.5, **ARGS
    )
    assert summary["finalized"] and summary["images_done"] == 0
    assert st.LatentStore(env["stats"]).meta["latent_transform"] == record
    with pytest.raises(st.StoreError, match="planned with --latent_norm channel_stats, asked scale"):
        extract_latents(env["images"], env["stats"], vae=env["vae16"], **ARGS)
    with pytest.raises(st.StoreError, match="latent_transform differs|other settings"):
        extract_latents(
            env["images"], env["stats"], vae=env["vae16"], latent_norm="channel_stats", latent_multiplier=1.0, **ARGS
        )
    with pytest.raises(ValueError, match="--latent_multiplier applies to --latent_norm channel_stats"):
        extract_latents(env["images"], str(env["root"] / "x"), vae=env["vae16"], latent_multiplier=2.0, **ARGS)


@pytest.mark.parametrize("name", ["f8c4", "f16c16", "stats"])
def test_the_reader_applies_the_stores_transform(env, name):
    ds = LatentBatchDataset(env[name], train=False)
    idx = np.arange(0, 24, 3)
    x = ds.get_batch(idx)["x"]
    expect = ds.store.transform.forward(raw_means(env[name])[idx])
    torch.testing.assert_close(x, expect, rtol=1e-5, atol=1e-5)
    # training: a fresh posterior sample of the raw latents, then the transform
    train = LatentBatchDataset(env[name], train=True, seed=3, random_flip=False)
    raw = train.store.read(idx, flip=0).astype(np.float32)  # (B, K, C, H, W)
    B = len(idx)
    sample = NoiseKernel(raw[0, 0].size).posterior_sample(
        raw[:, 0].reshape(B, -1), raw[:, 1].reshape(B, -1), 3, 0, idx, 1.0
    )
    expect = ds.store.transform.forward(torch.from_numpy(sample).reshape(B, *ds.store.latent_shape))
    torch.testing.assert_close(train.get_batch(idx, epoch=0)["x"], expect, rtol=1e-5, atol=1e-5)
    if name == "stats":  # normalised: about zero mean and unit spread (times the multiplier) per channel
        whole = ds.get_batch(np.arange(24))["x"]
        assert whole.mean(dim=(0, 2, 3)).abs().max() < 1e-4
        torch.testing.assert_close(whole.std(dim=(0, 2, 3)), torch.full((16,), 0.5), rtol=1e-4, atol=1e-4)


def _module(env, name, **kw):
    s = st.LatentStore(env[name])
    torch.manual_seed(0)
    return DiTModule(
        model="custom", latent_shape=list(s.latent_shape), num_classes=2, depth=1, hidden_size=16, num_heads=2,
        patch_size=1, vae=s.spec.vae, scale_factor=s.scale_factor, latent_transform=s.transform.record(), **kw,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["f16c16", "stats"])
def test_decode_inverts_the_transform_exactly(env, name):
    module = _module(env, name)
    t = st.LatentStore(env[name]).transform
    z = torch.randn(2, 16, 4, 4)
    vae = load_vae(env["vae16"])
    raw = (
        z * SCALE**-1 + SHIFT
        if name == "f16c16"
        else z / 0.5 * torch.tensor(t.std).view(1, 16, 1, 1) + torch.tensor(t.mean).view(1, 16, 1, 1)
    )
    with torch.no_grad():
        expect = ((vae.decode(raw).sample + 1) / 2).clamp(0, 1)
    images = module.decode(z)
    assert images.shape == (2, 3, 64, 64)
    torch.testing.assert_close(images, expect, rtol=1e-5, atol=1e-5)


def test_fid_reference_images_decode_the_raw_latents(env):
    from dit_lightning.evaluation.fid import _store_batches

    got = next(_store_batches(env["f16c16"], 4, 4, "cpu"))
    with torch.no_grad():
        expect = ((load_vae(env["vae16"]).decode(raw_means(env["f16c16"])[:4]).sample + 1) / 2).clamp(0, 1)
    assert np.abs(got.astype(int) - (expect.permute(0, 2, 3, 1).numpy() * 255).round().astype(int)).max() <= 1


def test_a_run_on_another_transform_is_refused(env, tmp_path):
    scaled = _module(env, "f16c16")
    stats = _module(env, "stats")
    checkpoint = {"hyper_parameters": dict(scaled.hparams), "state_dict": {}}
    with pytest.raises(ValueError, match=r"another latent transform \(scale 1.5, shift 0.3\) than this run's store "):
        stats.on_load_checkpoint(checkpoint)
    path = save_dit(scaled.model, tmp_path / "w.pt", extra_args={"vae": env["vae16"], "scale_factor": SCALE})
    with pytest.raises(ValueError, match="--model.init_from .* another latent transform"):
        _module(env, "stats", init_from=path)  # a legacy record: its scale_factor without the shift
    # the same transform: the weights load
    path = save_dit(scaled.model, tmp_path / "s.pt", extra_args=dict(scaled.hparams))
    assert torch.equal(
        _module(env, "f16c16", init_from=path).model.x_embedder.proj.weight, scaled.model.x_embedder.proj.weight
    )


def test_a_teacher_of_another_transform_is_refused(env, tmp_path):
    from dit_lightning.distill import DistillationModule

    teacher = _module(env, "f16c16")
    path = save_dit(teacher.model, tmp_path / "t.pt", ema=teacher.model, extra_args=dict(teacher.hparams))
    s = st.LatentStore(env["stats"])
    kw = dict(
        model="custom", latent_shape=[16, 4, 4], num_classes=2, depth=1, hidden_size=16, num_heads=2, patch_size=1,
        vae=s.spec.vae, scale_factor=s.scale_factor,
    )  # fmt: skip
    with pytest.raises(
        ValueError, match="latent transform: student per-channel statistics .* teacher scale 1.5, shift"
    ):
        DistillationModule(teacher=path, latent_transform=s.transform.record(), **kw)
    DistillationModule(teacher=path, latent_transform=teacher.latent_transform.record(), **kw)  # the same: accepted


@pytest.mark.parametrize("name,post_quant_conv", [("f16c16", True), ("stats", True), ("stats", False)])
def test_diffusers_export_decodes_like_dit_lightning(env, tmp_path, name, post_quant_conv):
    """DiTPipeline decodes ``vae.decode(latents / vae.config.scaling_factor)``: the transform folded into
    the exported VAE's post_quant_conv (one added where the VAE has none) makes that our decode."""
    from diffusers import AutoencoderKL

    module = _module(env, name)
    vae_dir = env["vae16"]
    if not post_quant_conv:
        vae_dir = make_vae(str(tmp_path / "nopqc"), channels=16, factor=16, scaling_factor=SCALE, post_quant_conv=False)
        module.hparams.vae = vae_dir
    path = save_dit(module.model, tmp_path / "m.pt", ema=module.model, extra_args=dict(module.hparams))
    report = export_checkpoint(path, str(tmp_path / "diff"), format="diffusers")
    assert report["latent_transform"] == module.latent_transform.record()
    how = "scaling_factor" if name == "f8c4" else "post_quant_conv"
    assert report["latent_transform_in_vae"] == how and any("post_quant_conv" in n for n in report["notes"])
    exported = AutoencoderKL.from_pretrained(tmp_path / "diff" / "vae")
    assert exported.config.scaling_factor == 1.0 and exported.config.shift_factor is None
    z = torch.randn(2, 16, 4, 4)
    with torch.no_grad():
        theirs = ((exported.decode(z / exported.config.scaling_factor).sample + 1) / 2).clamp(0, 1)
    torch.testing.assert_close(theirs, module.decode(z), rtol=0, atol=1e-5)
    # read back (`sample --checkpoint DIR`): the folded vae/ with scale 1 decodes the model's latents
    loaded = load_dit(str(tmp_path / "diff"))
    assert loaded.vae == str((tmp_path / "diff" / "vae").resolve())
    assert loaded.latent_transform == LatentTransform.scaled(1.0)


@pytest.mark.parametrize("name,names_vae", [("stats", False), ("stats", True), ("f16c16", True)])
def test_diffusers_export_of_a_file_without_a_transform_takes_the_stores(env, tmp_path, name, names_vae):
    """A file that records no transform (no VAE, or a VAE without its factor) exported with store=:
    the store's transform (a channel_stats store's statistics are in meta.json, not in its plan),
    never an invented 0.18215; the export's record agrees with itself."""
    module = _module(env, name)
    path = save_dit(module.model, tmp_path / "m.pt", extra_args={"vae": env["vae16"]} if names_vae else None)
    report = export_checkpoint(path, str(tmp_path / "d"), format="diffusers", store=env[name], vae=env["vae16"])
    store = st.LatentStore(env[name])
    assert report["latent_transform"] == store.transform.record() and report["scale_factor"] == store.scale_factor
    assert report["latent_transform_in_vae"] == "post_quant_conv" and report["vae_status"] == "included"


def test_stores_older_readers_would_misread_are_format_version_2(env):
    """Readers of version 1 ignore latent_transform and read latents x scale_factor: a channel_stats or a
    shifted store is version 2 (which they refuse); a plain scale store stays version 1."""
    for name, version in (("f8c4", 1), ("f16c16", 2), ("stats", 2)):
        for file in (st.PLAN_FILE, st.META_FILE):
            assert json.loads(open(os.path.join(env[name], file)).read())["format_version"] == version, (name, file)
        assert st.LatentStore(env[name]).spec.format_version == version
    meta = os.path.join(env["root"], "v3", st.META_FILE)
    os.makedirs(os.path.dirname(meta))
    record = json.loads(open(os.path.join(env["stats"], st.META_FILE)).read())
    with open(meta, "w") as f:
        json.dump({**record, "format_version": 3}, f)
    with pytest.raises(st.StoreError, match="has format_version 3, this code reads versions 1 and 2: re-extract"):
        st.LatentStore(os.path.dirname(meta))


def test_a_module_that_knows_no_transform_yet_takes_any_checkpoint(env, tmp_path):
    """Built in Python without vae / latent_transform (no data module before fit), the module's transform
    is unknown, not pixels: init_from a latent checkpoint loads; a real pixel module still refuses it."""
    scaled = _module(env, "f16c16")
    path = save_dit(scaled.model, tmp_path / "s.pt", extra_args=dict(scaled.hparams))
    kw = dict(
        model="custom", latent_shape=[16, 4, 4], num_classes=2, depth=1, hidden_size=16, num_heads=2, patch_size=1
    )
    bare = DiTModule(init_from=path, **kw)
    assert bare.latent_transform is None
    assert torch.equal(bare.model.x_embedder.proj.weight, scaled.model.x_embedder.proj.weight)
    assert DiTModule(vae=env["vae16"], **kw).latent_transform is None  # a VAE without its factor: unknown too
    with pytest.raises(
        ValueError, match=r"another latent transform \(scale 1.5, shift 0.3\) than this run's store \(pix"
    ):
        DiTModule(init_from=path, vae="none/pixels", **kw)
    z = torch.rand(1, 16, 4, 4) * 2 - 1
    torch.testing.assert_close(bare.decode(z), (z + 1) / 2)  # no VAE: decoded as pixels


def test_cli_trains_resumes_and_samples_a_16_channel_f16_store_at_patch_size_1(env, tmp_path):
    """The one subprocess chain: fit 2 steps on the 16x4x4 store (patch size 1: 16 tokens), resume
    to 3, sample through `dit-lightning sample`: the shift travels store -> checkpoint -> decode."""
    from PIL import Image

    from tests.helpers.cli import DEMO, TINY, run_cli

    def fit(steps, *extra):
        return [
            "fit", "--config", DEMO, *TINY, "--model.patch_size", "1", "--model.depth", "1",
            "--data.path", env["f16c16"], "--data.global_batch_size", "8", "--data.val_size", "4",
            "--trainer.max_steps", str(steps), "--trainer.val_check_interval", "1000", "--trainer.logger", "false",
            "--checkpoint.dirpath", str(tmp_path / "ckpt"), "--checkpoint.every_n_train_steps", "1", *extra,
        ]  # fmt: skip

    run_cli(fit(2), tmp_path)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    hp = torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]
    assert hp["latent_transform"] == {"kind": "scale", "scale": SCALE, "shift": SHIFT}
    assert hp["latent_shape"] == [16, 4, 4] and hp["patch_size"] == 1
    run_cli(fit(3, "--ckpt_path", str(ckpt)), tmp_path)
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 3
    out = tmp_path / "samples"
    run_cli(
        ["sample", "--checkpoint", str(ckpt), "--output", str(out), "--num_samples", "2", "--num_steps", "2",
         "--device", "cpu", "--progress", "false", "--grid_size", "2"],
        tmp_path,
    )  # fmt: skip
    config = json.loads((out / "sample_config.json").read_text())
    assert config["latent_transform"] == hp["latent_transform"] and config["vae"] == env["vae16"]
    pngs = sorted((out / "samples").glob("*.png"))
    assert len(pngs) == 2 and Image.open(pngs[0]).size == (64, 64)
