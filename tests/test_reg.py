"""REG (Wu et al. 2025, github.com/Martinser/REG) and the alignment cut-off in DiTModule: the class
token's loss and the alignment term equal REG's loss.py for the same draws, a REG run fits, resumes
bit-exact with the cut-off inside the run and works under the levers, and bad settings are refused
before any work."""

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader

import dit_lightning.module as module_py
from dit_lightning.models.repa import DigitsEncoder, REPAOptions
from dit_lightning.module import DiTModule
from tests.helpers import reg_loss_reference as ref
from tests.helpers.models import randomize
from tests.helpers.reg_encoder import ClassTokenDigitsEncoder
from tests.helpers.repa_reference import build_mlp
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
    settings = dict(
        encoder=ENCODER, weights=encoder_file, depth=1, coeff=0.5, projector_dim=16, class_token_weight=0.03
    )
    return REPAOptions(**{**settings, **kw})


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


def test_the_losses_are_reg_loss_py_for_the_same_draws(encoder_file, monkeypatch):
    """REG's SILoss and train.py's total for the same time, latent noise and class-token noise: REG
    draws them from torch's generator (passing ``noises`` raises NameError in REG), so torch is seeded
    and the draws replayed into ours in REG's order (rand t, randn_like latents, randn_like token)."""
    module = reg_module(encoder_file)
    torch.manual_seed(0)
    randomize(module.model)
    with torch.no_grad():  # outputs of order 1, so that 1e-6 is a test of the formula and not of fp32's rounding
        module.model.final_layer.linear.weight.mul_(0.2)
        module.model.final_layer.linear_cls.weight.mul_(0.2)
    b = batch(8)
    encoder = ClassTokenDigitsEncoder()
    encoder.load_state_dict(torch.load(encoder_file, weights_only=True))
    with torch.no_grad():
        dense_z = encoder((b["x"] + 1) / 2)  # REG's dense_z: the class token, then the patches
    cls_token = dense_z[:, 0]
    projector = build_mlp(32, 16, 64)  # REG's models/sit.py build_mlp is REPA's
    projector.load_state_dict(module.repa_projector.state_dict())

    def reg_model(x, t, y, cls_token):
        # REG's network in REG's time (0 data, 1 noise) and velocity sign: ours at 1 - t, negated
        out, hidden, cls_out = module.model(x, 1 - t, y, hidden_at=1, class_token=cls_token)
        n, tokens, d = hidden.shape
        return -out, [projector(hidden.reshape(-1, d)).reshape(n, tokens, -1)], -cls_out

    torch.manual_seed(7)
    with torch.no_grad():
        total, loss1, proj_loss1, loss2 = ref.train_loss(
            ref.SILoss(), reg_model, b["x"], {"y": b["y"]}, [dense_z], cls_token
        )
    torch.manual_seed(7)  # REG's draws, replayed in its order
    t = torch.rand((8, 1, 1, 1))
    draws = {("u", 1): 1 - t.flatten(), ("n", 2): torch.randn_like(b["x"])[0:8], ("n", 4): torch.randn_like(cls_token)}
    monkeypatch.setattr(module_py, "keyed_uniform", lambda keys, shape=(), stream=0: draws[("u", stream)])
    monkeypatch.setattr(module_py, "keyed_normal", lambda keys, shape, stream=0: draws[("n", stream)])
    with torch.no_grad():
        ours = module.training_losses(b, step=5)
    torch.testing.assert_close(ours["denoising"], loss1.mean(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["repa"], proj_loss1, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["class_token"], loss2.mean(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["loss"], total, rtol=0, atol=1e-6)
    assert -1 < float(proj_loss1) < 0.9 and 0.1 < float(loss2.mean()) < 10  # not a degenerate term
    # the cut-off: from until_step on the alignment no longer counts; the class token's loss stays
    module.repa.options = dataclasses.replace(module.repa.options, until_step=5)
    with torch.no_grad():
        cut = module.training_losses(b, step=5)
    torch.testing.assert_close(cut["loss"], loss1.mean() + loss2.mean() * 0.03, rtol=0, atol=1e-6)
    torch.testing.assert_close(cut["repa"], proj_loss1, rtol=0, atol=1e-6)  # logged still


def test_after_until_step_the_projector_gets_zero_gradients_and_stays_in_the_graph(encoder_file):
    """DDP needs every trained parameter in the graph: past the cut-off the projector's gradients are
    zeros (not missing), and the network's are those of the loss without the alignment term."""
    b = batch(4)
    grads = {}
    for name, options in (("cut", dict(until_step=3)), ("no repa", dict(coeff=0.0))):
        module = reg_module(encoder_file, repa=reg_options(encoder_file, **options))
        torch.manual_seed(0)
        randomize(module.model)
        module.training_losses(b, step=3)["loss"].backward()
        grads[name] = [p.grad for p in module.model.parameters()]
        projector = [p.grad for p in module.repa_projector.parameters()]
        assert all(g is not None and not g.any() for g in projector)
    for a, c in zip(grads["cut"], grads["no repa"]):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
    before = reg_module(encoder_file, repa=reg_options(encoder_file, until_step=3))
    before.training_losses(b, step=2)["loss"].backward()
    assert all(p.grad.any() for p in before.repa_projector.parameters())
