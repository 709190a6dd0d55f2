"""`dit-lightning sample`: sample directories and file names, the ADM `.npz`, rank splits,
resume, VAE decoding, x_0 clamping of pixel stores, and its command line."""

import json
import os

import numpy as np
import pytest
import torch

from dit_lightning.checkpoints import load_dit as load_model
from dit_lightning.commands.sample import sample
from dit_lightning.images import existing_samples, png_name
from dit_lightning.sampling import sample_latents
from tests.helpers.models import random_dit
from tests.helpers.samples import FAST
from tests.helpers.samples import read_npz as _npz

pytestmark = pytest.mark.usefixtures("one_thread")


def test_raw_state_dict_samples_without_a_model_config(tmp_path):
    net = random_dit(in_channels=3, hidden_size=64, num_heads=1)  # hidden/64 heads: inferable
    ckpt = tmp_path / "DiT-raw.pt"
    torch.save(net.state_dict(), ckpt)
    loaded = load_model(str(ckpt))
    assert loaded.format == "raw" and loaded.config["in_channels"] == 3 and loaded.config["hidden_size"] == 64
    res = sample(str(ckpt), str(tmp_path / "out"), num_samples=5, labels="0-2", cfg_scale=1.5, seed=1, **FAST)
    assert res["complete"] and res["generated"] == 5
    names = sorted(os.listdir(tmp_path / "out" / "samples"))
    assert names == [png_name(i, c) for i, c in enumerate([0, 1, 2, 0, 1])]
    arr = _npz(res["npz"])
    assert arr.dtype == np.uint8 and arr.shape == (5, 8, 8, 3)
    assert os.path.exists(tmp_path / "out" / "grid.png")
    # the same images as sampling the original network directly: pixels (x + 1) / 2, and a pixel
    # store's x0 estimates clamped to [-1, 1]
    lat = sample_latents(net, torch.tensor([0, 1, 2, 0, 1]), num_steps=6, cfg_scale=1.5, seed=1, clip_denoised=True)
    expect = (((lat + 1) / 2).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    assert np.abs(arr.astype(int) - expect.astype(int)).max() <= 1


def _gray_ckpt(tmp_path):
    ckpt = tmp_path / "gray.pt"
    torch.save(random_dit(in_channels=1, hidden_size=64, num_heads=1).state_dict(), ckpt)
    return str(ckpt)


def test_two_ranks_give_the_one_rank_output(tmp_path):
    ckpt = _gray_ckpt(tmp_path)
    kw = dict(num_samples=7, labels="random", cfg_scale=2.0, seed=4, **FAST)
    one = sample(ckpt, str(tmp_path / "one"), batch_size=4, **kw)
    r0 = sample(ckpt, str(tmp_path / "two"), batch_size=3, rank=0, world_size=2, **kw)
    assert r0["generated"] == 4 and not r0["complete"] and r0["npz"] is None
    r1 = sample(ckpt, str(tmp_path / "two"), batch_size=2, rank=1, world_size=2, **kw)
    assert r1["generated"] == 3 and r1["complete"]
    assert sorted(os.listdir(tmp_path / "one" / "samples")) == sorted(os.listdir(tmp_path / "two" / "samples"))
    assert sorted(existing_samples(tmp_path / "two" / "samples")) == list(range(7))
    a, b = _npz(one["npz"]), _npz(r1["npz"])
    assert a.shape == (7, 8, 8, 3) and (a[..., 0] == a[..., 2]).all()  # grayscale expanded
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 1


def test_resume_skips_existing_files_and_refuses_other_settings(tmp_path):
    ckpt = _gray_ckpt(tmp_path)
    out = tmp_path / "run"
    kw = dict(num_samples=6, labels=[3, 5], seed=2, **FAST)
    first = sample(ckpt, str(out), **kw)
    before = _npz(first["npz"])
    files = sorted((out / "samples").iterdir())
    for f in files[1:3]:
        f.unlink()
    os.unlink(first["npz"])
    mtimes = {f.name: f.stat().st_mtime_ns for f in files if f.exists()}
    again = sample(ckpt, str(out), batch_size=1, **kw)
    assert again["generated"] == 2 and again["skipped"] == 4
    assert all((out / "samples" / n).stat().st_mtime_ns == m for n, m in mtimes.items())
    assert np.array_equal(_npz(again["npz"]), before)
    # more samples extend the run; other settings would mix two runs' images
    more = sample(ckpt, str(out), **{**kw, "num_samples": 8})
    assert more["generated"] == 2 and _npz(more["npz"]).shape[0] == 8
    assert json.loads((out / "sample_config.json").read_text())["num_samples"] == 8
    with pytest.raises(ValueError, match="seed"):
        sample(ckpt, str(out), **{**kw, "seed": 3})
    torch.save(random_dit(seed=9, in_channels=1, hidden_size=64, num_heads=1).state_dict(), ckpt)  # same name and size
    with pytest.raises(ValueError, match="weights_fingerprint"):
        sample(ckpt, str(out), **kw)


def test_sample_and_evaluate_build_command_lines(tmp_path):
    """jsonargparse (which `dit-lightning sample` / `evaluate` use) accepts the signatures."""
    from jsonargparse import CLI

    from dit_lightning.commands.evaluate import evaluate

    ckpt = _gray_ckpt(tmp_path)
    args = ["--checkpoint", ckpt, "--output", str(tmp_path / "cli"), "--labels", "0-3", "--num_samples", "4",
            "--num_steps", "3", "--sampler", "ddim", "--device", "cpu", "--progress", "false"]  # fmt: skip
    res = CLI(sample, args=args, as_positional=False)
    assert res["complete"] and res["generated"] == 4
    with pytest.raises(SystemExit):
        CLI(evaluate, args=["--help"], as_positional=False)


def test_local_vae_directory_decodes_four_channel_latents(tmp_path):
    from diffusers.models import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        latent_channels=4, norm_num_groups=4, layers_per_block=1,
    )  # fmt: skip
    vae.save_pretrained(tmp_path / "vae")
    ckpt = tmp_path / "raw.pt"
    torch.save(random_dit(hidden_size=64, num_heads=1).state_dict(), ckpt)
    res = sample(str(ckpt), str(tmp_path / "out"), labels=[1, 2], vae=str(tmp_path / "vae"), **FAST)
    assert _npz(res["npz"]).shape == (2, 8, 8, 3)
    config = json.loads((tmp_path / "out" / "sample_config.json").read_text())
    assert config["scale_factor"] == 0.18215 and config["clip_denoised"] is False  # latents: unclamped


def test_sample_command_clips_pixel_stores_and_records_it(tmp_path):
    ckpt = _gray_ckpt(tmp_path)  # 1 channel, no VAE recorded: a pixel store
    res = sample(ckpt, str(tmp_path / "px"), labels=[1, 2, 3], seed=1, **FAST)
    assert json.loads((tmp_path / "px" / "sample_config.json").read_text())["clip_denoised"] is True
    net = load_model(ckpt).net
    lat = sample_latents(net, torch.tensor([1, 2, 3]), num_steps=6, seed=1, clip_denoised=True)
    expect = (((lat + 1) / 2).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    assert np.abs(_npz(res["npz"])[..., :1].astype(int) - expect.astype(int)).max() <= 1
    # explicit override, and a run directory from before the setting existed (never clipped)
    off = sample(ckpt, str(tmp_path / "off"), labels=[1, 2, 3], seed=1, clip_denoised=False, **FAST)
    assert json.loads((tmp_path / "off" / "sample_config.json").read_text())["clip_denoised"] is False
    config = json.loads((tmp_path / "off" / "sample_config.json").read_text())
    del config["clip_denoised"]
    (tmp_path / "off" / "sample_config.json").write_text(json.dumps(config))
    assert sample(ckpt, str(tmp_path / "off"), labels=[1, 2, 3], seed=1, clip_denoised=False, **FAST)["skipped"] == 3
    with pytest.raises(ValueError, match="clip_denoised"):
        sample(ckpt, str(tmp_path / "off"), labels=[1, 2, 3], seed=1, **FAST)
    assert off["complete"]


def test_a_flow_models_checkpoint_samples_as_a_flow_model(tmp_path):
    """A run trained with flow matching records its objective; `sample` reads it and integrates the
    model's velocity (the samples are the module's own), instead of running a DDPM loop on it."""
    import lightning as L

    from dit_lightning.module import DiTModule
    from tests.helpers.models import randomize
    from tests.helpers.training import TINY_MODULE

    module = DiTModule(**TINY_MODULE, objective="flow", sampler="ode-euler", sample_steps=4, vae="none/pixels")
    randomize(module.model)
    module.ema.load_state_dict(module.model.state_dict())
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    ckpt = tmp_path / "flow.ckpt"
    trainer.save_checkpoint(ckpt)
    res = sample(str(ckpt), str(tmp_path / "out"), num_samples=3, labels="0-2", seed=5)
    assert res["complete"] and json.load(open(tmp_path / "out" / "sample_config.json"))["sampler"] == "ode-euler"
    lat = module.sample([0, 1, 2], seed=5)
    expect = (((lat + 1) / 2).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    assert np.abs(_npz(res["npz"]).astype(int) - expect.astype(int)).max() <= 1
    # a declaration that contradicts the record is refused, not ignored
    with pytest.raises(ValueError, match="--path_type gvp: checkpoint .* records objective flow"):
        sample(str(ckpt), str(tmp_path / "gvp"), num_samples=1, labels="0", path_type="gvp")
    with pytest.raises(ValueError, match="--objective ddpm: checkpoint .* records objective flow"):
        sample(str(ckpt), str(tmp_path / "ddpm"), num_samples=1, labels="0", objective="ddpm")


def test_a_refused_sampler_leaves_nothing_that_refuses_the_corrected_command(tmp_path):
    net = random_dit(in_channels=3, hidden_size=64, num_heads=1)  # pixels: no VAE
    ckpt = tmp_path / "DiT-raw.pt"
    torch.save(net.state_dict(), ckpt)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="'ode-euler' does not sample a model trained with objective ddpm"):
        sample(str(ckpt), str(out), num_samples=2, labels="0-1", sampler="ode-euler", num_steps=3)
    assert not (out / "sample_config.json").exists()
    (out / "samples").mkdir(parents=True)  # a record without a sample (a run that failed before its first image)
    (out / "sample_config.json").write_text(json.dumps({"sampler": "ddim", "num_steps": 99}))
    assert sample(str(ckpt), str(out), num_samples=2, labels="0-1", num_steps=3)["complete"]


@pytest.mark.parametrize("atol,rtol", [(1e-6, -1.0), (-1.0, 1e-3), (0.0, 0.0)])
def test_dopri5_tolerances_out_of_range_are_refused(atol, rtol):
    from dit_lightning.sampling import SamplingOptions

    with pytest.raises(ValueError, match="tolerances must be >= 0 and not both 0"):
        SamplingOptions(sampler="ode-dopri5", atol=atol, rtol=rtol)
