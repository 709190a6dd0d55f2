"""SamplingOptions, the one description of how latents are sampled: the loop, DiTModule.sample,
the sample / evaluate commands and GenerationMetrics take it, the command lines keep one flat
flag per option, unset options take the model's, and the records hold every option."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from jsonargparse import ArgumentParser
from lightning.pytorch.cli import LightningArgumentParser

from dit_lightning.callbacks import GenerationMetrics
from dit_lightning.checkpoints import load_dit
from dit_lightning.commands.evaluate import evaluate
from dit_lightning.commands.sample import sample
from dit_lightning.images import to_uint8
from dit_lightning.module import DiTModule
from dit_lightning.sampling import SAMPLING_OPTION_NAMES, ResolvedSamplingOptions, SamplingOptions, sample_latents
from dit_lightning.vae import decode_latents
from tests.helpers.models import random_dit
from tests.helpers.samples import read_npz

pytestmark = pytest.mark.usefixtures("one_thread")

# A value for every option, none of them its default: a new option must be added here.
GIVEN = dict(
    sampler="ddim", num_steps=3, cfg_scale=1.5, guide_channels=3, cfg_interval=(200.0, 700.0),
    class_token_cfg_scale=0.0, eta=0.5,
    clip_denoised=True, precision="bf16", seed=4, atol=1e-5, rtol=1e-4, diffusion_form="sbdm", diffusion_norm=0.5,
    last_step="tweedie", last_step_size=0.02, timestep_shift=0.3,
)  # fmt: skip


def flags(prefix: str = "") -> list[str]:
    """GIVEN as command-line flags."""
    return [a for k, v in GIVEN.items() for a in (f"--{prefix}{k}", v if isinstance(v, str) else json.dumps(v))]


def tiny_module(**kw) -> DiTModule:
    module = DiTModule(
        "custom", latent_shape=[1, 8, 8], num_classes=10, depth=2, hidden_size=32, num_heads=4, patch_size=2, **kw
    )
    assert module.ema is not None
    torch.manual_seed(0)
    with torch.no_grad():  # a fresh DiT outputs exactly 0
        for p in module.ema.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return module


def test_given_sets_every_option():
    assert set(GIVEN) == set(SAMPLING_OPTION_NAMES)
    assert all(GIVEN[k] != getattr(SamplingOptions(), k) for k in GIVEN)


@pytest.mark.parametrize("command", [sample, evaluate])
def test_the_commands_take_every_option_as_a_flat_flag(command):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(command)
    cfg = parser.parse_args(["--checkpoint", "c.pt", "--output", "out", *flags()])
    assert SamplingOptions(**{k: cfg[k] for k in SAMPLING_OPTION_NAMES}) == SamplingOptions(**GIVEN)
    assert not any(k.startswith("options") or "." in k for k in cfg.keys())  # nothing nested
    assert "classifier-free guidance scale" in parser.format_help()  # the help is SamplingOptions' documentation


def test_generation_metrics_takes_every_option_as_a_flat_init_arg():
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(GenerationMetrics, "evaluation")  # as the CLI does
    cfg = parser.parse_args(flags("evaluation."))
    assert GenerationMetrics(**cfg.evaluation.as_dict()).options == SamplingOptions(**GIVEN)


def test_resolution_library_defaults_and_the_models():
    assert SamplingOptions().resolved() == ResolvedSamplingOptions(
        sampler="ddpm", num_steps=250, cfg_scale=1.0, guide_channels=None, eta=0.0, clip_denoised=False, seed=0
    )
    mine, model = SamplingOptions(num_steps=5, seed=2), SamplingOptions(num_steps=7, cfg_scale=2.0)
    assert mine.over(model) == SamplingOptions(num_steps=5, cfg_scale=2.0, seed=2)
    hp = dict(sampler="ddim", sample_steps=3, cfg_scale=2.0, guide_channels=1)
    assert SamplingOptions.from_hparams(hp, in_channels=1) == SamplingOptions(
        sampler="ddim", num_steps=3, cfg_scale=2.0, guide_channels=1, clip_denoised=True
    )
    assert SamplingOptions.from_hparams({"vae": "stabilityai/sd-vae-ft-ema"}, 4) == SamplingOptions(clip_denoised=False)
    assert SamplingOptions.from_hparams({"vae": "none/pixels"}, 3).clip_denoised is True


def test_options_and_keywords_sample_the_same_and_the_module_adds_its_defaults():
    net = random_dit()
    y, idx = torch.tensor([1, 2, 3]), torch.tensor([4, 0, 9])
    kw = dict(sampler="ddim", num_steps=4, cfg_scale=2.0, eta=0.3, seed=5)
    a = sample_latents(net, y, idx, options=SamplingOptions(**kw))
    assert torch.equal(a, sample_latents(net, y, idx, **kw))
    assert torch.equal(a, sample_latents(net, y, idx, options=SamplingOptions(seed=6, num_steps=9), **kw))
    # unset: the library's defaults
    b = sample_latents(net, y, num_steps=3)
    assert torch.equal(b, sample_latents(net, y, options=SamplingOptions(sampler="ddpm", num_steps=3, cfg_scale=1.0)))

    module = tiny_module(sampler="ddim", sample_steps=3, cfg_scale=2.0, guide_channels=1)
    model_defaults = dict(sampler="ddim", num_steps=3, cfg_scale=2.0, guide_channels=1, clip_denoised=True)
    want = sample_latents(module.ema, [1, 2], [0, 1], seed=2, **model_defaults)
    assert torch.equal(module.sample([1, 2], seed=2), want)  # 1 channel, no VAE: a pixel store, clamped
    assert torch.equal(module.sample([1, 2], SamplingOptions(seed=2)), want)
    assert torch.equal(module.sample([1, 2], SamplingOptions(seed=2, num_steps=2), num_steps=3), want)
    assert not torch.equal(module.sample([1, 2], seed=2, clip_denoised=False), want)


def test_an_unknown_option_or_a_positional_setting_fails_with_the_choices():
    with pytest.raises(TypeError, match="num_steps"):
        sample_latents(random_dit(), [1], num_step=3)
    with pytest.raises(TypeError, match="by name"):
        sample_latents(random_dit(), [1], SamplingOptions())
    with pytest.raises(TypeError, match="SamplingOptions"):
        tiny_module().sample([1], 50)  # the number of steps is a named setting
    with pytest.raises(TypeError):
        SamplingOptions("ddim")  # keywords only: a field may be added anywhere


def test_the_sample_command_records_every_option(tmp_path):
    net = random_dit(in_channels=3, hidden_size=64, num_heads=1)
    ckpt = tmp_path / "raw.pt"
    torch.save(net.state_dict(), ckpt)
    res = sample(str(ckpt), str(tmp_path / "out"), labels=[1, 2], device="cpu", progress=False, **GIVEN)
    config = json.loads((tmp_path / "out" / "sample_config.json").read_text())
    assert {k: config[k] for k in SAMPLING_OPTION_NAMES} == SamplingOptions(**GIVEN).record()
    lat = sample_latents(load_dit(str(ckpt)).net, [1, 2], [0, 1], options=SamplingOptions(**GIVEN))
    assert np.array_equal(read_npz(res["npz"]), to_uint8(decode_latents(lat, None)))


# ---- cfg_interval: an option added through SamplingOptions alone ------------------------------


@pytest.mark.parametrize("sampler", ["ddpm", "ddim", "dpm++2m"])
def test_cfg_interval_guides_only_the_timesteps_inside_it(sampler):
    net = random_dit()
    y = torch.tensor([1, 2, 3])
    kw = dict(sampler=sampler, num_steps=4, cfg_scale=3.0, seed=1)
    guided, unguided = sample_latents(net, y, **kw), sample_latents(net, y, **{**kw, "cfg_scale": 1.0})
    assert torch.equal(sample_latents(net, y, cfg_interval=(0, 999), **kw), guided)  # every step inside
    assert torch.equal(sample_latents(net, y, cfg_interval=(1000, 2000), **kw), unguided)  # none
    middle = sample_latents(net, y, cfg_interval=(300, 700), **kw)  # the steps near t = 500 only
    assert not torch.allclose(middle, guided) and not torch.allclose(middle, unguided)


def test_cfg_interval_in_one_batch_of_mixed_timesteps():
    from dit_lightning.sampling import guided_model_fn

    net = random_dit()
    x, t, y = torch.randn(3, 4, 8, 8), torch.tensor([50, 300, 900]), torch.tensor([1, 2, 3])
    out = guided_model_fn(net, 3.0, cfg_interval=(100, 500))(x, t, y)
    torch.testing.assert_close(out[[0, 2]], net(x, t, y)[[0, 2]])
    torch.testing.assert_close(out[1], guided_model_fn(net, 3.0)(x, t, y)[1])


def test_cfg_interval_must_be_an_ordered_pair():
    assert SamplingOptions(cfg_interval=[100, 600]).cfg_interval == (100.0, 600.0)
    for bad in ((700, 200), (1, 2, 3)):
        with pytest.raises(ValueError, match="cfg_interval"):
            SamplingOptions(cfg_interval=bad)


def test_cfg_interval_reaches_the_module_the_command_and_its_resume_check(tmp_path):
    module = tiny_module(sample_steps=4, cfg_scale=3.0)
    got = module.sample([1, 2], cfg_interval=(300, 700), seed=1)
    want = sample_latents(
        module.ema, [1, 2], num_steps=4, cfg_scale=3.0, cfg_interval=(300, 700), seed=1, clip_denoised=True
    )
    assert torch.equal(got, want) and not torch.equal(got, module.sample([1, 2], seed=1))

    ckpt = tmp_path / "raw.pt"
    torch.save(random_dit(in_channels=1, hidden_size=64, num_heads=1).state_dict(), ckpt)
    kw = dict(labels=[1, 2], num_steps=4, cfg_scale=3.0, device="cpu", progress=False)
    res = sample(str(ckpt), str(tmp_path / "out"), cfg_interval=(300, 700), **kw)
    assert json.loads((tmp_path / "out" / "sample_config.json").read_text())["cfg_interval"] == [300.0, 700.0]
    lat = sample_latents(
        load_dit(str(ckpt)).net, [1, 2], num_steps=4, cfg_scale=3.0, cfg_interval=(300, 700), clip_denoised=True
    )
    assert np.array_equal(read_npz(res["npz"])[..., :1], to_uint8(decode_latents(lat, None)))
    assert sample(str(ckpt), str(tmp_path / "out"), cfg_interval=[300, 700], **kw)["skipped"] == 2  # resumes
    with pytest.raises(ValueError, match="cfg_interval"):
        sample(str(ckpt), str(tmp_path / "out"), cfg_interval=(200, 700), **kw)
    # a run directory from before the option existed guided every step
    plain = sample(str(ckpt), str(tmp_path / "plain"), **kw)
    config = json.loads((tmp_path / "plain" / "sample_config.json").read_text())
    del config["cfg_interval"]
    (tmp_path / "plain" / "sample_config.json").write_text(json.dumps(config))
    assert plain["complete"] and sample(str(ckpt), str(tmp_path / "plain"), **kw)["skipped"] == 2


def test_generation_metrics_samples_and_records_cfg_interval(store):
    import lightning as L

    from dit_lightning.data import LatentDataModule

    dm = LatentDataModule(store, global_batch_size=32, val_size=32, num_workers=0, random_flip=False)
    module = tiny_module(sample_steps=3, vae=dm.spec.vae)
    seen = []
    sample_with = module.sample
    module.sample = lambda labels, options=None, **kw: seen.append(options) or sample_with(labels, options, **kw)
    cb = GenerationMetrics(metrics=["digits"], num_samples=4, labels="0-9", cfg_scale=2.0, cfg_interval=(300, 700))
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[cb], limit_test_batches=1,
    )  # fmt: skip
    trainer.test(module, dm, verbose=False)
    assert seen and all(o.cfg_interval == (300.0, 700.0) and o.cfg_scale == 2.0 for o in seen)
    assert cb.last["sampling"]["cfg_interval"] == [300.0, 700.0] and cb.last["sampling"]["num_steps"] == 3
