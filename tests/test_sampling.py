"""Sampling: keyed per-sample determinism, CFG, DDIM, checkpoints of every format, files,
rank splits and resume. Tiny models (8x8 latents, a few thousand parameters), few steps."""

import json
import os

import numpy as np
import pytest
import torch

from dit_lightning.diffusion import create_diffusion
from dit_lightning.models import DiT
from dit_lightning.checkpoints import load_dit as load_model
from dit_lightning.commands.sample import sample
from dit_lightning.images import existing_samples, png_name, write_npz_from_pngs
from dit_lightning.sampling import build_sampling_diffusion, guided_model_fn, initial_noise, parse_labels, sample_latents


pytestmark = pytest.mark.usefixtures("one_thread")


def random_dit(seed=0, **kw):
    """A tiny DiT whose adaLN-Zero layers are not zero (a fresh DiT outputs exactly 0)."""
    cfg = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=4, num_classes=10)
    cfg.update(kw)
    torch.manual_seed(seed)
    net = DiT(**cfg).eval()
    with torch.no_grad():
        for p in net.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.02)
    return net


FAST = dict(num_steps=6, progress=False, device="cpu")


def test_parse_labels():
    assert parse_labels("0-3,7", 10).classes == (0, 1, 2, 3, 7)
    assert parse_labels([5, 1], 10)(torch.arange(5)).tolist() == [5, 1, 5, 1, 5]
    assert parse_labels("all", 3).classes == (0, 1, 2)
    rnd = parse_labels("random", 1000, seed=3)
    first = rnd(torch.arange(100))
    assert first[:10].tolist() == rnd(torch.arange(10)).tolist()  # label of i independent of N
    assert len(set(first.tolist())) > 50 and 0 <= int(first.min()) and int(first.max()) < 1000
    with pytest.raises(ValueError, match="outside"):
        parse_labels("5-12", 10)
    with pytest.raises(ValueError, match="parse"):
        parse_labels("cats", 10)


def test_ddim_eta0_matches_the_diffusion_loop_and_is_deterministic():
    net, y = random_dit(), torch.tensor([1, 2, 3])
    a = sample_latents(net, y, sampler="ddim", num_steps=8, cfg_scale=2.0, seed=5)
    b = sample_latents(net, y, sampler="ddim", num_steps=8, cfg_scale=2.0, seed=5)
    assert torch.equal(a, b)
    z = initial_noise(torch.arange(3), (4, 8, 8), 5)
    ref = build_sampling_diffusion("ddim", 8).ddim_sample_loop(guided_model_fn(net, 2.0), z.shape, noise=z, model_kwargs={"y": y})
    torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-5)
    # eta > 0 draws keyed noise: deterministic per seed, different from eta 0
    c = sample_latents(net, y, sampler="ddim", num_steps=8, eta=1.0, seed=5)
    assert torch.equal(c, sample_latents(net, y, sampler="ddim", num_steps=8, eta=1.0, seed=5))
    assert not torch.allclose(c, sample_latents(net, y, sampler="ddim", num_steps=8, seed=5))


def test_ddpm_step_matches_the_diffusion_p_sample_loop():
    """With the per-step noise replayed from a generator, the keyed loop is p_sample_loop."""
    net, y = random_dit(), torch.tensor([0, 9])
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 4, 8, 8, generator=g)
    ours = sample_latents(net, y, num_steps=7, noise=z, noise_fn=lambda step, x: torch.randn(x.shape, generator=g))
    g = torch.Generator().manual_seed(3)
    ref = build_sampling_diffusion("ddpm", 7).p_sample_loop(net.forward, (2, 4, 8, 8), model_kwargs={"y": y}, generator=g)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_sample_i_does_not_depend_on_the_batch(sampler):
    net = random_dit()
    y, idx = torch.tensor([3, 1, 4, 1, 5, 9]), torch.arange(10, 16)
    kw = dict(sampler=sampler, eta=0.5, num_steps=6, cfg_scale=3.0, seed=11)
    whole = sample_latents(net, y, idx, **kw)
    parts = torch.cat([sample_latents(net, y[:1], idx[:1], **kw), sample_latents(net, y[1:], idx[1:], **kw)])
    torch.testing.assert_close(whole, parts, rtol=1e-5, atol=1e-5)
    perm = torch.tensor([5, 0, 3, 1, 4, 2])
    torch.testing.assert_close(sample_latents(net, y[perm], idx[perm], **kw), whole[perm], rtol=1e-5, atol=1e-5)
    other_seed = sample_latents(net, y, idx, **{**kw, "seed": 12})
    assert not torch.allclose(whole, other_seed)


def test_cfg_scale_one_equals_conditional_sampling():
    net, y = random_dit(), torch.tensor([2, 7, 7])
    cond = sample_latents(net, y, num_steps=6, cfg_scale=1.0)
    doubled = sample_latents(net, y, num_steps=6, model_fn=guided_model_fn(net, 1.0, force_cfg=True))
    torch.testing.assert_close(cond, doubled, rtol=1e-5, atol=1e-5)
    guided = sample_latents(net, y, num_steps=6, cfg_scale=4.0)
    three = sample_latents(net, y, num_steps=6, cfg_scale=4.0, guide_channels=3)
    assert not torch.allclose(cond, guided) and not torch.allclose(guided, three)
    # the reference's 3-channel mode leaves the 4th epsilon channel conditional
    x, t = torch.randn(3, 4, 8, 8), torch.full((3,), 500)
    out = guided_model_fn(net, 4.0, guide_channels=3)(x, t, y)
    torch.testing.assert_close(out[:, 3:], net(x, t, y)[:, 3:], rtol=1e-5, atol=1e-5)


def test_bf16_autocast_runs_and_stays_close():
    net, y = random_dit(), torch.tensor([1, 2])
    a = sample_latents(net, y, sampler="ddim", num_steps=4)
    b = sample_latents(net, y, sampler="ddim", num_steps=4, precision="bf16")
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    assert (a - b).abs().max() < 0.1 * a.abs().max()


def _npz(path):
    with np.load(path) as z:
        assert z.files == ["arr_0"]
        return z["arr_0"]


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


def test_reference_and_lightning_checkpoints(tmp_path):
    model, ema = random_dit(seed=0), random_dit(seed=1)
    ref = tmp_path / "ref.pt"
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": {}, "args": {"model": "custom", "num_heads": 4}}, ref)
    y = torch.tensor([4, 2])
    for weights, net in (("ema", ema), ("raw", model)):
        got = load_model(str(ref), weights=weights)
        assert got.config["num_heads"] == 4 and got.weights == weights
        torch.testing.assert_close(sample_latents(got.net, y, num_steps=3), sample_latents(net, y, num_steps=3))
    # Lightning: heads (4, not hidden/64 = 1) and diffusion settings come from the hyper-parameters
    sd = {f"model.{k}": v for k, v in model.state_dict().items()} | {f"ema.{k}": v for k, v in ema.state_dict().items()}
    hp = {"model": "custom", "num_heads": 4, "latent_shape": (4, 8, 8), "eval_weights": "ema", "noise_schedule": "linear",
          "diffusion_steps": 1000, "vae": "none/pixels", "sample_steps": 5, "sampler": "ddim", "cfg_scale": 2.0, "guide_channels": None}  # fmt: skip
    light = tmp_path / "last.ckpt"
    torch.save({"state_dict": sd, "hyper_parameters": hp}, light)
    got = load_model(str(light))
    assert got.format == "lightning" and got.config["num_heads"] == 4 and got.vae == "none/pixels"
    assert got.sampling_defaults == {"sample_steps": 5, "sampler": "ddim", "cfg_scale": 2.0, "guide_channels": None}
    torch.testing.assert_close(sample_latents(got.net, y, num_steps=3), sample_latents(ema, y, num_steps=3))
    with pytest.raises(ValueError, match="need a VAE"):  # 4-channel latents cannot be shown as pixels
        sample(str(ref), str(tmp_path / "o"), labels=[1], vae="none/pixels", **FAST)


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


def test_npz_is_streamed_in_the_adm_format(tmp_path):
    from PIL import Image

    paths = []
    for i in range(3):
        p = tmp_path / f"{i}.png"
        Image.fromarray(np.full((4, 5), 40 * i, np.uint8)).save(p)
        paths.append(p)
    arr = _npz(write_npz_from_pngs(paths, tmp_path / "s.npz"))
    assert arr.dtype == np.uint8 and arr.shape == (3, 4, 5, 3) and arr[2].min() == arr[2].max() == 80


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


# --------------------------------------------------------------------------------------
# Pixel stores: x_0 estimates clamped to [-1, 1]
# --------------------------------------------------------------------------------------


def _noisy_oracle(data, schedule, error, seen):
    """epsilon of the exact posterior mean E[x0 | x_t] over the images ``data`` (in [-1, 1]),
    plus a fixed error of size ``error`` (what a trained network adds); records max |x_t| of
    every call, i.e. how far the inputs the network would see are from the training marginals."""
    acp = torch.tensor(create_diffusion(noise_schedule=schedule).alphas_cumprod, dtype=torch.float64)
    offset = error * torch.randn(data.shape[1:], generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def fn(x, t, y):
        seen.append(x.abs().max().item())
        xd, a = x.double(), acp[t.long()].view(-1, 1, 1, 1)
        d2 = ((xd[:, None] - a[:, None].sqrt() * data[None]) ** 2).flatten(2).sum(-1)  # (N, K)
        w = torch.softmax(-d2 / (2 * (1 - a.view(-1, 1))), dim=1)
        x0 = torch.einsum("nk,kchw->nchw", w, data)
        eps = (xd - a.sqrt() * x0) / (1 - a).sqrt() + offset
        return torch.cat([eps, torch.zeros_like(eps)], 1).to(x.dtype)

    return fn


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_clip_denoised_keeps_cosine_pixel_sampling_in_range(sampler):
    """The cosine schedule's last step has alphas_cumprod ~ 2.4e-9 (beta capped at 0.999): x_0 =
    (x_T - sqrt(1 - acp) eps) / sqrt(acp) multiplies an epsilon error of 0.02 by ~2e4. Unclamped,
    a respaced DDPM that starts at t = 999 hands the network inputs hundreds of standard deviations
    out (what saturated the digits); clamped to the pixel range, every input stays on the forward
    process's scale and the images in [-1, 1]."""
    net = random_dit(in_channels=1)  # only fixes the shape and device; model_fn replaces it
    data = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2 - 1
    y = torch.zeros(4, dtype=torch.long)
    kw = dict(sampler=sampler, num_steps=10, noise_schedule="cosine", seed=3)
    if sampler == "ddim":
        kw["num_steps"] = 37  # no integer stride gives 37 steps: section respacing, t = 999 as DDPM
    assert 999 in build_sampling_diffusion(sampler, kw["num_steps"], "cosine").timestep_map

    seen: list[float] = []
    out = sample_latents(net, y, model_fn=_noisy_oracle(data, "cosine", 0.02, seen), clip_denoised=True, **kw)
    assert max(seen) < 6.0  # |sqrt(acp) x0 + sqrt(1 - acp) z| for |x0| <= 1 and 64 draws of z per image
    assert out.abs().max() <= 1.0 + 1e-4

    # The same sampler unclamped: the second input is already far outside anything trained on.
    seen.clear()
    sample_latents(net, y, model_fn=_noisy_oracle(data, "cosine", 0.02, seen), clip_denoised=False, **kw)
    assert seen[1] > 20.0


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
