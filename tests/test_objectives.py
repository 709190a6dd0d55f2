"""DiTModule's objectives: flow matching (keyed times and noise, its settings, training, validation,
sampling, resume bit for bit) and Min-SNR-gamma weighting of the DDPM loss (against the formula); the
default DDPM loss is untouched."""

import math

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser
from torch.utils.data import DataLoader

from dit_lightning.diffusion import DDPMObjective, FlowMatching, min_snr_weights, objective_from_record
from dit_lightning.keyed_random import keyed_normal, keyed_uniform, sample_keys
from dit_lightning.module import DiTModule
from tests.helpers.models import randomize
from tests.helpers.training import TINY_MODULE as TINY
from tests.helpers.training import DictDataset, trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def batch(n=8):
    return next(iter(DataLoader(DictDataset(n), batch_size=n)))


def test_flow_module_settings_and_its_record():
    module = DiTModule(**TINY, objective="flow", path_type="gvp", prediction="noise", time_distribution="logit_normal")
    assert module.objective == FlowMatching(path_type="gvp", prediction="noise", time_distribution="logit_normal")
    hp = module.hparams
    assert (hp.learn_sigma, hp.sampler, hp.objective) == (False, "sde-euler", "flow")  # forced, and recorded so
    assert module.model.out_channels == 1
    assert DiTModule(**TINY, objective="flow", sampler="ode-heun").hparams.sampler == "ode-heun"
    default = DiTModule(**TINY)
    assert default.objective == DDPMObjective() and default.hparams.learn_sigma  # DDPM stays the default


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(path_type="gvp"), "settings of flow matching"),
        (dict(time_distribution="logit_normal"), "settings of flow matching"),
        (dict(cosine_loss=True), "settings of flow matching"),
        (dict(objective="flow", prediction="score", cosine_loss=True), "needs velocity prediction"),
        (dict(loss_weighting="likelihood"), "settings of flow matching"),
        (dict(objective="flow", loss_weighting="min_snr"), "weight the DDPM objective"),
        (dict(objective="flow", sampler="ddim"), "does not sample a model trained with objective flow"),
        (dict(min_snr_gamma=3.0), "min_snr, which is off"),
        (dict(objective="flow", time_mean=1.0), "logit_normal, not uniform"),
        (dict(objective="flow", loss_weighting="velocity"), "noise or score prediction"),
        (dict(objective="flow", train_eps=0.01), "whole interval"),
        (dict(loss_weighting="min_snr", min_snr_gamma=0), "positive"),
    ],
)
def test_settings_of_the_other_objective_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        DiTModule(**TINY, **settings)


def test_cosine_loss_is_logged_recorded_and_read_back():
    module = DiTModule(**TINY, objective="flow", time_distribution="logit_normal", cosine_loss=True)
    randomize(module.model)
    assert module.hparams.cosine_loss is True
    assert objective_from_record(dict(module.hparams)) == module.objective  # what a checkpoint reads back
    assert objective_from_record({"objective": "flow"}) == FlowMatching()  # a record before the option: off
    with torch.no_grad():
        terms = module.diffusion_loss(module.model, batch(4), step_key=1, train=True)
    torch.testing.assert_close(terms["loss"], terms["velocity_mse"] + terms["cosine"])
    assert terms["cosine"] > 0


def test_flow_loss_is_the_keyed_flow_matching_loss_and_layout_independent():
    module = DiTModule(**TINY, objective="flow", prediction="score", loss_weighting="likelihood", class_dropout_prob=0)
    randomize(module.model)
    b = batch(8)
    with torch.no_grad():
        loss = module.diffusion_loss(module.model, b, step_key=7, train=True)["loss"]
        keys = sample_keys(b["index"], module.hparams.seed, 7)
        t = module.objective.training_time(keyed_uniform(keys, (), stream=1))  # the DDPM timestep's draw
        noise = keyed_normal(keys, b["x"].shape[1:], stream=2)  # the DDPM noise
        expected = module.objective.training_losses(module.model, b["x"], noise, t, {"y": b["y"]})["loss"].mean()
        halves = [{k: v[i : i + 4] for k, v in b.items()} for i in (0, 4)]
        split = sum(module.diffusion_loss(module.model, h, step_key=7, train=True)["loss"] for h in halves) / 2
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(loss, split)
    assert 1e-5 <= t.min() and t.max() <= 1 - 1e-5  # score prediction keeps train_eps from the ends


def test_flow_fit_validate_sample_and_resume_bit_exact(tmp_path):
    data = DataLoader(DictDataset(16), batch_size=8)
    common = dict(**TINY, objective="flow", time_distribution="logit_normal", cosine_loss=True, sample_steps=4)
    straight = DiTModule(**common)
    every_2 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer(max_steps=4, enable_checkpointing=True, callbacks=[every_2], limit_val_batches=1).fit(straight, data, data)
    resumed = DiTModule(**common)
    trainer(max_steps=4, default_root_dir=tmp_path).fit(resumed, data, ckpt_path=tmp_path / "step=2.ckpt")
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert torch.load(tmp_path / "step=2.ckpt", weights_only=True)["hyper_parameters"]["cosine_loss"] is True
    metrics = trainer(default_root_dir=tmp_path).validate(resumed, data, verbose=False)[0]
    assert math.isfinite(metrics["val/loss"])
    images = resumed.sample([1, 2], seed=3)  # sde-euler, 4 steps
    assert images.shape == (2, 1, 8, 8) and torch.isfinite(images).all()
    torch.testing.assert_close(
        resumed.sample([1, 2], seed=3, sampler="ode-euler"), resumed.sample([1, 2], seed=3, sampler="ode-euler")
    )
    with pytest.raises(ValueError, match="does not sample a model trained with objective flow"):
        resumed.sample([1], sampler="ddim")
    with pytest.raises(ValueError, match="does not sample a model trained with objective ddpm"):
        DiTModule(**TINY).sample([1], sampler="ode-euler", num_steps=2)


def test_min_snr_weights_are_the_formula():
    betas = np.linspace(1e-4, 0.02, 1000)
    acp = np.cumprod(1 - betas)
    w = min_snr_weights(acp, 5.0)
    snr = acp / (1 - acp)
    np.testing.assert_allclose(w, np.minimum(snr, 5.0) / snr, rtol=0, atol=0)
    assert w[0] == pytest.approx(5.0 / snr[0]) and w[0] < 1e-3  # nearly clean: SNR ~ 1e4, clamped to 5
    assert w[-1] == 1.0  # pure noise: SNR < gamma, the plain epsilon MSE
    with pytest.raises(ValueError):
        min_snr_weights(acp, 0.0)


@pytest.mark.parametrize("learn_sigma", [True, False])
def test_min_snr_weights_the_mse_term_and_keeps_vb(learn_sigma):
    plain = DiTModule(**TINY, learn_sigma=learn_sigma)
    randomize(plain.model)
    weighted = DiTModule(**TINY, learn_sigma=learn_sigma, loss_weighting="min_snr", min_snr_gamma=5.0)
    weighted.model.load_state_dict(plain.model.state_dict())
    b = batch(8)
    with torch.no_grad():
        # per sample: the same keyed timesteps and noise as the unweighted loss, from the diffusion directly
        keys = sample_keys(b["index"], 0, 3)
        t = (keyed_uniform(keys, (), stream=1) * 1000).long().clamp(max=999)
        noise = keyed_normal(keys, b["x"].shape[1:], stream=2)
        kwargs = {"y": b["y"], "force_drop_ids": keyed_uniform(keys, (), stream=3) < 0.1}
        terms = plain.objective.diffusion.training_losses(plain.model, b["x"], t, model_kwargs=kwargs, noise=noise)
        acp = torch.from_numpy(plain.objective.diffusion.alphas_cumprod)[t]
        snr = acp / (1 - acp)
        w = (torch.minimum(snr, torch.tensor(5.0, dtype=torch.float64)) / snr).float()
        ours = weighted.diffusion_loss(weighted.model, b, step_key=3, train=True)
        reference = plain.diffusion_loss(plain.model, b, step_key=3, train=True)
    torch.testing.assert_close(ours["loss"], (w * terms["mse"] + terms["vb"]).mean())
    torch.testing.assert_close(ours["mse"], reference["mse"])  # logged unweighted
    torch.testing.assert_close(ours["vb"], reference["vb"])
    assert torch.equal(reference["loss"], (terms["mse"] + terms["vb"]).mean())  # the default: the reference loss


def test_the_objective_settings_are_flat_model_flags():
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(DiTModule, "model")  # as the CLI does
    flags = "--model.objective flow --model.path_type gvp --model.prediction noise --model.loss_weighting likelihood"
    flags += " --model.time_distribution logit_normal --model.time_mean 0.5 --model.sampler ode-dopri5"
    cfg = parser.parse_args(flags.split()).model.as_dict()
    assert cfg["cosine_loss"] is False
    assert parser.parse_args("--model.objective flow --model.cosine_loss true".split()).model.cosine_loss is True
    assert {k: cfg[k] for k in ("objective", "path_type", "prediction", "loss_weighting", "time_mean", "sampler")} == {
        "objective": "flow", "path_type": "gvp", "prediction": "noise", "loss_weighting": "likelihood",
        "time_mean": 0.5, "sampler": "ode-dopri5",
    }  # fmt: skip
    cfg = parser.parse_args("--model.loss_weighting min_snr --model.min_snr_gamma 5".split()).model
    assert (cfg.objective, cfg.loss_weighting, cfg.min_snr_gamma) == ("ddpm", "min_snr", 5.0)
