"""Checkpoints written before the objective became one object (tests/fixtures/*.ckpt, made by commit
2278246: a DDPM run with Min-SNR, a flow run with GVP noise prediction and logit-normal time, a flow +
REPA run; 2 steps of the tiny test module each) load, sample and resume with today's code."""

import os

import pytest
import torch
from torch.utils.data import DataLoader

from dit_lightning.checkpoints import load_dit
from dit_lightning.diffusion import DDPMObjective, FlowMatching
from dit_lightning.models.repa import REPAOptions
from dit_lightning.module import DiTModule
from tests.helpers.training import TINY_MODULE, DictDataset, trainer

pytestmark = pytest.mark.usefixtures("one_thread")
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
ENCODER = os.path.join(FIXTURES, "digits_encoder.pt")
RUNS = {
    "ddpm-minsnr": (dict(loss_weighting="min_snr", min_snr_gamma=5.0), DDPMObjective(loss_weighting="min_snr")),
    "flow-gvp-noise": (
        dict(objective="flow", path_type="gvp", prediction="noise", time_distribution="logit_normal"),
        FlowMatching(path_type="gvp", prediction="noise", time_distribution="logit_normal"),
    ),
    "flow-repa": (
        dict(
            objective="flow",
            class_dropout_prob=0.0,
            repa=REPAOptions(
                encoder="dit_lightning.models.repa.DigitsEncoder", weights=ENCODER, depth=1, projector_dim=16
            ),
        ),
        FlowMatching(),
    ),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_an_earlier_checkpoint_loads_samples_and_resumes(name, tmp_path):
    settings, objective = RUNS[name]
    path = os.path.join(FIXTURES, f"{name}.ckpt")
    again = DiTModule.load_from_checkpoint(path)
    assert again.objective == objective  # its record read back (GVP noise: SiT's epsilons, the fix)
    assert load_dit(path).objective == objective
    assert again.sample([1, 2], num_steps=3, seed=0).shape == (2, 1, 8, 8)

    module = DiTModule(**{**TINY_MODULE, "ema_decay": 0.9, **settings})
    trainer(max_steps=3, default_root_dir=tmp_path, limit_val_batches=0).fit(
        module, DataLoader(DictDataset(16), batch_size=8), ckpt_path=path
    )
    assert module.global_step == 3 and all(torch.isfinite(p).all() for p in module.parameters())
    if name == "flow-repa":
        assert again.repa is not None and again.repa.options.feature_dim == 64
