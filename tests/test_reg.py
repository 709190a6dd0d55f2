"""REG (Wu et al. 2025, github.com/Martinser/REG) and the alignment cut-off in DiTModule: the class
token's loss and the alignment term equal REG's loss.py for the same draws, a REG run fits, resumes
bit-exact with the cut-off inside the run and works under the levers, and bad settings are refused
before any work."""

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader

from dit_lightning.models.repa import DigitsEncoder, REPAOptions
from dit_lightning.module import DiTModule
from tests.helpers.reg_encoder import ClassTokenDigitsEncoder
from tests.helpers.training import TINY_MODULE as TINY
from tests.helpers.training import DictDataset

pytestmark = pytest.mark.usefixtures("one_thread")
ENCODER = "tests.helpers.reg_encoder.ClassTokenDigitsEncoder"


@pytest.fixture
def encoder_file(tmp_path):
    torch.manual_seed(5)
    path = tmp_path / "encoder.pt"
    torch.save(ClassTokenDigitsEncoder().state_dict(), path)
    return str(path)


def reg_options(encoder_file, **kw):
    return REPAOptions(
        encoder=ENCODER, weights=encoder_file, depth=1, coeff=0.5, projector_dim=16, class_token_weight=0.03, **kw
    )


def reg_module(encoder_file, repa=None, **kw):
    repa = repa or reg_options(encoder_file)
    return DiTModule(**{**TINY, "objective": "flow", "class_dropout_prob": 0.0, "repa": repa, **kw})


def batch(n=8):
    return next(iter(DataLoader(DictDataset(n), batch_size=n)))


def test_bad_reg_settings_are_refused_in_one_line(encoder_file, tmp_path):
    with pytest.raises(ValueError, match="^REG trains with the flow objective: set model.objective flow$"):
        reg_module(encoder_file, objective="ddpm")
    with pytest.raises(ValueError, match="set model.prediction velocity"):
        reg_module(encoder_file, prediction="noise")
    plain = tmp_path / "plain.pt"
    torch.save(DigitsEncoder().state_dict(), plain)
    options = dataclasses.replace(reg_options(str(plain)), encoder="dit_lightning.models.repa.DigitsEncoder")
    with pytest.raises(ValueError, match=r"needs an encoder with a class token.*prefix_tokens = 1"):
        reg_module(encoder_file, repa=options)
    module = reg_module(encoder_file)  # a store holding the patch features only
    with pytest.raises(ValueError, match="features hold none: extract the features again"):
        module.head_losses(module.model, {**batch(2), "repa": torch.zeros(2, 16, 64)}, 0, train=True)


def test_the_dit_of_a_reg_run_takes_the_class_token_and_the_record_says_its_width(encoder_file):
    module = reg_module(encoder_file)
    assert module.model.class_token_dim == 64 and module.ema.class_token_dim == 64
    assert module.hparams.repa["feature_dim"] == 64 and module.hparams.repa["class_token_weight"] == 0.03
    terms = module.training_losses(batch(4), step=0)
    assert set(terms) == {"loss", "denoising", "repa", "class_token"}
    expected = terms["denoising"] + 0.5 * terms["repa"] + 0.03 * terms["class_token"]
    torch.testing.assert_close(terms["loss"], expected, rtol=0, atol=0)
