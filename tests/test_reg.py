"""REG (Wu et al. 2025, github.com/Martinser/REG) and the alignment cut-off in DiTModule: the class
token's loss and the alignment term equal REG's loss.py for the same draws, a REG run fits, resumes
bit-exact with the cut-off inside the run and works under the levers, and bad settings are refused
before any work."""

import dataclasses

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import dit_lightning.module as module_py
from dit_lightning.models.repa import DigitsEncoder, REPAOptions
from dit_lightning.module import DiTModule
from tests.helpers import reg_loss_reference as ref
from tests.helpers.models import randomize
from tests.helpers.reg_encoder import ClassTokenDigitsEncoder
from tests.helpers.repa_reference import build_mlp
from tests.helpers.training import TINY_MODULE as TINY
from tests.helpers.training import DictDataset, trainer

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
    # said before the encoder is loaded: a missing weights file is not what the user hears first
    missing = reg_options(str(tmp_path / "missing.pt"))
    with pytest.raises(ValueError, match="^REG trains with the flow objective"):
        reg_module(encoder_file, repa=missing, objective="ddpm")
    plain = tmp_path / "plain.pt"
    torch.save(DigitsEncoder().state_dict(), plain)
    options = dataclasses.replace(reg_options(str(plain)), encoder="dit_lightning.models.repa.DigitsEncoder")
    with pytest.raises(ValueError, match=r"needs an encoder with a class token.*prefix_tokens = 1"):
        reg_module(encoder_file, repa=options)
    module = reg_module(encoder_file)  # a store holding the patch features only
    with pytest.raises(
        ValueError,
        match=r"REPA features hold none .*rerun `dit-lightning extract --output STORE --repa_encoder .*features false",
    ):
        module.head_losses(module.model, {**batch(2), "repa": torch.zeros(2, 16, 64)}, 0, train=True)


def test_the_dit_of_a_reg_run_takes_the_class_token_and_the_record_says_its_width(encoder_file):
    module = reg_module(encoder_file)
    assert module.model.class_token_dim == 64 and module.ema.class_token_dim == 64
    assert module.hparams.repa["feature_dim"] == 64 and module.hparams.repa["class_token_weight"] == 0.03
    b = batch(4)
    patches, token = module.repa.targets(b, module.decode)  # online: one encoder pass
    encoder = ClassTokenDigitsEncoder()
    encoder.load_state_dict(torch.load(encoder_file, weights_only=True))
    with torch.no_grad():
        dense_z = encoder((b["x"] + 1) / 2)
    torch.testing.assert_close((patches, token), (dense_z[:, 1:], dense_z[:, 0]), rtol=0, atol=0)
    stored = module.repa.targets({**b, "repa": patches * 2, "repa_class_token": token * 3}, module.decode)
    torch.testing.assert_close(stored, (patches * 2, token * 3), rtol=0, atol=0)  # the store's, as given
    plain = reg_module(encoder_file, repa=reg_options(encoder_file, class_token_weight=0.0))
    assert plain.repa.targets(b, plain.decode)[1] is None and plain.model.class_token_dim is None
    terms = module.training_losses(b, step=0)
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
    repa_only = reg_module(encoder_file, repa=reg_options(encoder_file, until_step=3, class_token_weight=0.0))
    terms = [repa_only.training_losses(b, step=s) for s in (2, 3)]  # REPA alone: the same cut-off
    assert "class_token" not in terms[0] and terms[0]["loss"] != terms[0]["denoising"]
    assert terms[1]["loss"] == terms[1]["denoising"] and terms[1]["repa"] != 0


def test_a_reg_fit_with_the_cut_off_inside_resumes_bit_exact_and_loads_without_the_encoder(encoder_file, tmp_path):
    """REG on, the alignment cut off at step 3 of 4, EMA on, validation each epoch: the run resumed from
    step 2 ends with the uninterrupted run's weights, EMA and projector, bit for bit (the class token's
    noise is keyed on the step and the sample index like the latents'); the checkpoint rebuilds the
    network's class-token layers from its record, without the encoder."""
    data = DataLoader(DictDataset(16), batch_size=8)
    options = reg_options(encoder_file, until_step=3)
    straight = reg_module(encoder_file, options, class_dropout_prob=0.1)
    every_2 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    run = trainer(max_steps=4, enable_checkpointing=True, callbacks=[every_2], limit_val_batches=1)
    run.fit(straight, data, data)
    logged = {"train/loss", "train/denoising", "train/repa", "train/class_token", "val/loss", "val/class_token"}
    assert logged <= set(run.callback_metrics)
    resumed = reg_module(encoder_file, options, class_dropout_prob=0.1)
    trainer(max_steps=4, default_root_dir=tmp_path, limit_val_batches=0).fit(
        resumed, data, ckpt_path=tmp_path / "step=2.ckpt"
    )
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name  # the network, its class-token layers, the EMA and the projector
    assert not torch.equal(straight.ema.cls_embedder.proj.weight, straight.model.cls_embedder.proj.weight)
    (tmp_path / "encoder.pt").unlink()  # a REG checkpoint loads without the encoder
    again = DiTModule.load_from_checkpoint(tmp_path / "step=4.ckpt")
    assert again.model.class_token_dim == 64 and again.repa.options.until_step == 3
    assert "encoder" not in again.repa._frozen
    torch.testing.assert_close(again.state_dict(), straight.state_dict(), rtol=0, atol=0)


def test_reg_under_the_levers_split_steps_recomputation_and_bf16(encoder_file):
    data = DataLoader(DictDataset(16), batch_size=8)
    plain, split = reg_module(encoder_file), reg_module(encoder_file)
    split.load_state_dict(plain.state_dict())
    trainer(max_steps=2, limit_val_batches=0).fit(plain, data)
    # auto-fit's redoable step: each batch in micro-batches of 4, forward and backward apart
    split.micro_batch_size, split.out_of_memory_handler = 4, lambda failure, step: None
    trainer(max_steps=2, limit_val_batches=0).fit(split, data)
    for (name, a), b in zip(plain.state_dict().items(), split.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6, msg=name)
    # activation checkpointing re-runs the blocks (the class token's among the tokens): the same gradients
    grads = []
    for spec in ("none", "all"):
        module = reg_module(encoder_file, activation_checkpointing=spec)
        module.load_state_dict(plain.state_dict())
        module.training_losses(batch(8), step=0)["loss"].backward()
        trained = [p for p in [*module.model.parameters(), *module.repa_projector.parameters()] if p.requires_grad]
        grads.append([p.grad.clone() for p in trained])  # every one has a gradient
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    mixed = reg_module(encoder_file)
    trainer(max_steps=1, limit_val_batches=0, precision="bf16-mixed").fit(mixed, data)
    assert all(torch.isfinite(p).all() for p in mixed.parameters())
    assert not torch.equal(
        mixed.model.final_layer.linear_cls.weight, torch.zeros_like(mixed.model.final_layer.linear_cls.weight)
    )
