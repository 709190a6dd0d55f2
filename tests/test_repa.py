"""REPA in DiTModule: the loss equals REPA's loss.py for the same draws, the projector trains,
checkpoints and resumes with the network and stays out of every export, and bad settings are refused
before any work."""

import dataclasses

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters_context
from torch.utils.data import DataLoader

from dit_lightning.checkpoints import export_checkpoint, load_dit
from dit_lightning.keyed_random import keyed_normal, keyed_uniform, sample_keys
from dit_lightning.models.repa import DigitsEncoder, REPAOptions
from dit_lightning.module import DiTModule
from tests.helpers import repa_reference as ref
from tests.helpers.models import randomize
from tests.helpers.training import TINY_MODULE as TINY
from tests.helpers.training import DictDataset, trainer

pytestmark = pytest.mark.usefixtures("one_thread")
ENCODER = "dit_lightning.models.repa.DigitsEncoder"


@pytest.fixture
def encoder_file(tmp_path):
    torch.manual_seed(5)
    path = tmp_path / "encoder.pt"
    torch.save(DigitsEncoder().state_dict(), path)
    return str(path)


def repa_module(encoder_file, **kw):
    options = REPAOptions(encoder=ENCODER, weights=encoder_file, depth=1, coeff=0.5, projector_dim=16)
    return DiTModule(**{**TINY, "objective": "flow", "class_dropout_prob": 0.0, "repa": options, **kw})


def batch(n=8):
    return next(iter(DataLoader(DictDataset(n), batch_size=n)))


def test_the_loss_is_repa_loss_py_for_the_same_draws(encoder_file):
    module = repa_module(encoder_file)
    randomize(module.model)
    with torch.no_grad():  # outputs of order 1, so that 1e-6 is a test of the formula and not of fp32's rounding
        module.model.final_layer.linear.weight.mul_(0.2)
    b = batch(8)
    encoder = DigitsEncoder()
    encoder.load_state_dict(torch.load(encoder_file, weights_only=True))
    with torch.no_grad():
        zs = [encoder((b["x"] + 1) / 2)]  # the pixel store's images in [0, 1]
        ours = module.training_losses(b, step=5)
        keys = sample_keys(b["index"], module.hparams.seed, 5)
        t = module.objective.training_time(keyed_uniform(keys, (), stream=1))  # SiT's time: 0 noise, 1 data
        noise = keyed_normal(keys, b["x"].shape[1:], stream=2)

        projector = ref.build_mlp(32, 16, 64)
        projector.load_state_dict(module.repa_projector.state_dict())  # the same layout as REPA's build_mlp
        hidden = {}
        module.model.blocks[0].register_forward_hook(lambda m, a, out: hidden.setdefault("h", out))

        def repa_model(x, t_repa, y):
            # REPA's network in REPA's time (0 data, 1 noise) and velocity sign: ours at 1 - t, negated
            hidden.clear()
            out = module.model(x, 1 - t_repa, y)
            n, tokens, d = hidden["h"].shape
            return -out, [projector(hidden["h"].reshape(-1, d)).reshape(n, tokens, -1)]

        total, denoising, proj = ref.train_loss(repa_model, b["x"], 1 - t, noise, zs, 0.5, {"y": b["y"]})
    torch.testing.assert_close(ours["denoising"], denoising, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["repa"], proj, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["loss"], total, rtol=0, atol=1e-6)
    assert -1 < float(proj) < 1 and float(proj) != 0


def test_precomputed_features_are_used_and_the_projector_learns(encoder_file):
    module = repa_module(encoder_file)
    b = batch(4)
    online = module.repa.features(b, module.decode)
    assert online.shape == (4, 16, 64)
    torch.testing.assert_close(
        module.repa.features({**b, "repa": online * 2}, module.decode), online * 2
    )  # the store's, as given
    loss = module.training_losses({**b, "repa": online}, step=0)["loss"]
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.repa_projector.parameters())
    groups = module.configure_optimizers().param_groups
    assert [len(g["params"]) for g in groups] == [len([p for p in module.model.parameters() if p.requires_grad]), 6]


def test_repa_fit_resumes_bit_exact_and_exports_hold_the_network_alone(encoder_file, tmp_path):
    data = DataLoader(DictDataset(16), batch_size=8)
    straight = repa_module(encoder_file)
    every_2 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer(max_steps=4, enable_checkpointing=True, callbacks=[every_2], limit_val_batches=0).fit(straight, data)
    resumed = repa_module(encoder_file)
    trainer(max_steps=4, default_root_dir=tmp_path, limit_val_batches=0).fit(
        resumed, data, ckpt_path=tmp_path / "step=2.ckpt"
    )
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name  # the network, its EMA and the projector
    other = tmp_path / "other-encoder.pt"
    torch.save(DigitsEncoder(width=64).state_dict(), other)  # same architecture, other weights
    with pytest.raises(ValueError, match="trained against another REPA encoder: this run's weights sha256"):
        trainer(max_steps=4, default_root_dir=tmp_path, limit_val_batches=0).fit(
            repa_module(str(other)), data, ckpt_path=tmp_path / "step=2.ckpt"
        )
    ckpt = torch.load(tmp_path / "step=4.ckpt", weights_only=True)
    assert any(k.startswith("repa_projector.") for k in ckpt["state_dict"])
    assert ckpt["hyper_parameters"]["repa"]["feature_dim"] == 64  # recorded: loads without the encoder

    raw = export_checkpoint(str(tmp_path / "step=4.ckpt"), str(tmp_path / "raw.pt"), format="raw")["output"]
    assert not any("repa" in k for k in torch.load(raw, weights_only=True))
    reference = torch.load(
        export_checkpoint(str(tmp_path / "step=4.ckpt"), str(tmp_path / "ref.pt"))["output"], weights_only=True
    )
    n_dit = len([p for p in straight.model.parameters() if p.requires_grad])
    assert len(reference["opt"]["param_groups"]) == 1 and len(reference["opt"]["state"]) == n_dit
    net = load_dit(str(tmp_path / "step=4.ckpt")).net
    torch.testing.assert_close(net.state_dict(), straight.ema.state_dict())

    (tmp_path / "encoder.pt").unlink()  # sampling a REPA checkpoint needs no encoder
    again = DiTModule.load_from_checkpoint(tmp_path / "step=4.ckpt")
    assert again.repa.options.feature_dim == 64 and "encoder" not in again.repa._frozen
    assert again.sample([1], num_steps=3, seed=0).shape == (1, 1, 8, 8)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(depth=3), r"depth 3: the DiT has 2 blocks"),
        (dict(coeff=-1.0), "coeff must be >= 0"),
    ],
)
def test_bad_repa_settings_are_refused(encoder_file, change, message):
    options = dataclasses.replace(REPAOptions(encoder=ENCODER, weights=encoder_file, depth=1), **change)
    with pytest.raises(ValueError, match=message):
        DiTModule(**TINY, objective="flow", repa=options)


def test_an_encoder_whose_tokens_do_not_match_the_dit_is_refused(encoder_file):
    with pytest.raises(ValueError, match=r"gives 16 patch features per image and the DiT has 4 tokens"):
        repa_module(encoder_file, patch_size=4)


def test_the_cli_record_says_what_a_flow_model_runs():
    # LightningCLI hands save_hyperparameters the parsed config, which still holds the DDPM defaults
    given = {**TINY, "objective": "flow", "learn_sigma": True, "sampler": "ddpm", "repa": None}
    with _given_hyperparameters_context(hparams=given, instantiator="lightning.pytorch.cli.instantiate_module"):
        module = DiTModule(**TINY, objective="flow")
    for record in (module.hparams, module.hparams_initial):
        assert (record["sampler"], record["learn_sigma"]) == ("sde-euler", False)


def test_the_planner_counts_the_projector_and_an_online_encoder(encoder_file):
    from dit_lightning.planner import PlanOptions, plan_memory
    from dit_lightning.planner.memory import repa_costs

    module = repa_module(encoder_file)
    options = PlanOptions(
        model="custom", latent_size=8, in_channels=1, num_classes=10, depth=2, hidden_size=32, num_heads=4,
        patch_size=2, learn_sigma=False, micro_batch=8, precision="32-true", device="cpu",
        repa_projector_dim=16, repa_feature_dim=64,
    )  # fmt: skip
    costs = repa_costs(options, 8, mixed=False)
    assert costs["projector_params"] == sum(p.numel() for p in module.repa_projector.parameters())
    plain = plan_memory(options.replace(repa_projector_dim=None))
    repa = plan_memory(options)
    # weights + gradients + AdamW's two moments, no EMA: 16 bytes per projector parameter
    assert repa.static - plain.static == 16 * costs["projector_params"]
    online = plan_memory(options.replace(repa_encoder_params=1000))
    assert online.parameters - repa.parameters == 4000
    assert costs["flops"] == 6 * 16 * (32 * 16 + 16 * 16 + 16 * 64)


def test_repa_under_the_levers_split_steps_recomputation_and_bf16(encoder_file):
    data = DataLoader(DictDataset(16), batch_size=8)
    plain, split = repa_module(encoder_file), repa_module(encoder_file)
    split.load_state_dict(plain.state_dict())
    trainer(max_steps=2, limit_val_batches=0).fit(plain, data)
    # auto-fit's redoable step: each batch in micro-batches of 4, forward and backward apart
    split.micro_batch_size, split.out_of_memory_handler = 4, lambda failure, step: None
    trainer(max_steps=2, limit_val_batches=0).fit(split, data)
    for (name, a), b in zip(plain.state_dict().items(), split.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6, msg=name)
    # activation checkpointing re-runs the aligned block in the backward pass: the same gradients
    grads = []
    for spec in ("none", "all"):
        module = repa_module(encoder_file, activation_checkpointing=spec)
        module.load_state_dict(plain.state_dict())
        module.training_losses(batch(8), step=0)["loss"].backward()
        grads.append(
            [
                p.grad.clone()
                for p in module.trained_parameters()[0]["params"] + module.trained_parameters()[1]["params"]
            ]
        )
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    mixed = repa_module(encoder_file)
    trainer(max_steps=1, limit_val_batches=0, precision="bf16-mixed").fit(mixed, data)
    assert all(torch.isfinite(p).all() for p in mixed.parameters())


def test_features_from_the_store_are_the_online_ones_and_another_encoders_are_refused(tmp_path, encoder_file):
    from dit_lightning.data import LatentDataModule, prepare_digits
    from dit_lightning.data.extract import extract_features

    store = prepare_digits(str(tmp_path / "digits"))
    extract_features(store, ENCODER, repa_weights=encoder_file, device="cpu", num_workers=0, progress=False)
    dm = LatentDataModule(store, global_batch_size=16, val_size=32, num_workers=0)
    module = repa_module(encoder_file, latent_shape=dm.latent_shape)
    dm.setup("fit")
    b = next(iter(dm.train_dataloader()))
    precomputed = module.repa.features(b, module.decode)
    online = module.repa.features({k: v for k, v in b.items() if k != "repa"}, module.decode)
    torch.testing.assert_close(precomputed, online, rtol=2e-3, atol=2e-3)  # stored in float16
    trainer(max_steps=1, limit_val_batches=0).fit(module, dm)  # the store's features, this run's encoder

    other = tmp_path / "other.pt"
    torch.save(DigitsEncoder().state_dict(), other)
    wrong = repa_module(str(other), latent_shape=dm.latent_shape)
    with pytest.raises(ValueError, match="made with another encoder: weights sha256"):
        trainer(max_steps=1, limit_val_batches=0).fit(wrong, dm)


def test_an_encoder_class_named_by_a_checkpoint_is_not_imported(tmp_path, monkeypatch):
    """A class path read from a checkpoint's record (its options record the feature width) is resolved
    against the allowlist before anything is imported: a module that would run code is never imported."""
    from dit_lightning.models.repa_head import repa_head

    marker = tmp_path / "ran"
    (tmp_path / "evil_encoder.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Enc: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    record = dict(encoder="evil_encoder.Enc", depth=1, projector_dim=8, feature_dim=8)
    head = repa_head(record, (1, 8, 8))
    assert head is not None and not head.trusted
    with pytest.raises(Exception, match="evil_encoder"):
        head.encoder()
    assert not marker.exists()


def test_a_store_whose_features_pass_stopped_half_way_is_refused_with_the_fixes(tmp_path, encoder_file):
    """Not a silent fallback to online features (a decode and an encoder forward per step): a REPA run
    on a store whose features pass stopped is refused, naming the command that resumes the pass and
    data.repa_features false; the latter trains (online, knowingly), the former completes the store."""
    import json
    import os

    from dit_lightning.data import LatentDataModule, prepare_digits
    from dit_lightning.data import store as st
    from dit_lightning.data.extract import extract_features

    store = prepare_digits(str(tmp_path / "digits"))
    args = dict(repa_weights=encoder_file, device="cpu", num_workers=0, progress=False)
    extract_features(store, ENCODER, **args)
    record = os.path.join(store, "shards", "shard-00001.json")  # as if the pass was killed after shard 0
    json.dump({k: v for k, v in json.load(open(record)).items() if k != "repa"}, open(record, "w"))
    st.finalize_store(store)

    half = LatentDataModule(store, global_batch_size=16, num_workers=0)
    assert half.repa_spec is None and "in only 1 of its 2 shards" in half.repa_unfinished
    module = repa_module(encoder_file, latent_shape=half.latent_shape)
    command = f"dit-lightning extract --output {store} --repa_encoder {ENCODER} --repa_weights <encoder.pt>"
    with pytest.raises(ValueError, match="stopped half-way") as refused:
        trainer(max_steps=1, limit_val_batches=0).fit(module, half)
    assert command in str(refused.value) and "set data.repa_features false" in str(refused.value)
    knowingly = LatentDataModule(store, global_batch_size=16, num_workers=0, repa_features=False)
    assert knowingly.repa_unfinished is None
    trainer(max_steps=1, limit_val_batches=0).fit(module, knowingly)  # online features, as asked
    assert extract_features(store, ENCODER, **args)["features_written"] == 1  # the command resumes the pass
    done = LatentDataModule(store, global_batch_size=16, num_workers=0)
    assert done.repa_unfinished is None and done.repa_spec is not None


def test_a_recorded_weights_hash_is_checked_when_the_encoder_is_first_loaded(encoder_file):
    """Options read back from a checkpoint carry the weights' hash: other bytes at ``weights`` are refused
    before the encoder is used; weights hashed by this process are not hashed a second time."""
    from dit_lightning.models.repa_head import repa_head

    record = dict(encoder=ENCODER, weights=encoder_file, depth=1, projector_dim=8, feature_dim=64)
    head = repa_head({**record, "weights_sha256": "0" * 64}, (1, 8, 8))
    with pytest.raises(ValueError, match="is not the encoder this run recorded: weights sha256"):
        head.encoder()
    fresh = repa_head({**record, "feature_dim": None}, (1, 8, 8))  # hashed (and loaded) here
    assert fresh is not None and fresh.options.weights_sha256 and fresh.encoder() is fresh.encoder()
