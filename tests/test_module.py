"""DiTModule: EMA under accumulation, the loss, warm-up, mixed precision, sampling, init_from and
resume of other architectures, FLOPs, compile and attention backends."""

from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from dit_lightning.models import DiT
from dit_lightning.module import DiTModule
from tests.helpers.models import randomize
from tests.helpers.training import TINY_MODULE as TINY
from tests.helpers.training import DictDataset, trainer


class RecordingModule(DiTModule):
    """Records the raw weights at every EMA update."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.snapshots = []

    def update_ema(self):
        self.snapshots.append([p.detach().clone() for p in self.model.parameters()])
        super().update_ema()


def test_ema_follows_optimizer_steps_under_accumulation():
    module = RecordingModule(**TINY, ema_decay=0.5)
    init = [p.detach().clone() for p in module.model.parameters()]
    trainer(max_steps=3, accumulate_grad_batches=2).fit(module, DataLoader(DictDataset(), batch_size=4))
    assert len(module.snapshots) == 3 == module.trainer.global_step  # 6 batches, 3 optimiser steps
    expected = init
    for snap in module.snapshots:
        expected = [0.5 * e + 0.5 * s for e, s in zip(expected, snap)]
    for e, p in zip(expected, module.ema.parameters()):
        torch.testing.assert_close(p, e)
    assert not any(p.requires_grad for p in module.ema.parameters())


def test_ema_warmup_decay():
    module = DiTModule(**TINY, ema_decay=0.999, ema_warmup=True)
    assert module.ema_decay_at(0) == pytest.approx(0.1)
    assert module.ema_decay_at(90) == pytest.approx(91 / 100)
    assert module.ema_decay_at(10**7) == 0.999


def test_loss_is_independent_of_how_the_batch_is_split():
    module = DiTModule(**TINY).train()
    data = DictDataset(16)
    whole = next(iter(DataLoader(data, batch_size=16)))
    halves = list(DataLoader(data, batch_size=8))
    with torch.no_grad():
        a = module.diffusion_loss(module.model, whole, step_key=5, train=True)["loss"]
        b = sum(module.diffusion_loss(module.model, h, step_key=5, train=True)["loss"] for h in halves) / 2
        c = module.diffusion_loss(module.model, whole, step_key=6, train=True)["loss"]
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)


def test_training_reduces_the_loss_on_a_single_batch():
    module = DiTModule(**TINY, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3))
    batch = next(iter(DataLoader(DictDataset(16), batch_size=16)))
    opt = module.configure_optimizers()
    module.train()
    losses = []
    for _ in range(60):
        loss = module.diffusion_loss(module.model, batch, step_key=0, train=False)["loss"]  # fixed t and noise
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_bf16_mixed_and_gradient_clipping_and_warmup_fit_on_cpu():
    module = DiTModule(**TINY, warmup_steps=4)
    t = trainer(max_steps=3, precision="bf16-mixed", gradient_clip_val=1.0)
    t.fit(module, DataLoader(DictDataset(), batch_size=8))
    assert torch.isfinite(t.callback_metrics["train/loss"])
    assert t.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == pytest.approx(1e-4 * 4 / 4)


def test_sampling_is_deterministic_given_a_seed():
    module = DiTModule(**TINY)
    with torch.no_grad():
        for p in module.ema.parameters():
            p.add_(0.05 * torch.randn_like(p))
    a = module.sample([1, 2], num_steps=5, seed=3, cfg_scale=2.0)
    b = module.sample([1, 2], num_steps=5, seed=3, cfg_scale=2.0)
    c = module.sample([1, 2], num_steps=5, seed=4, cfg_scale=2.0)
    assert torch.equal(a, b) and not torch.equal(a, c)
    d1 = module.sample([1, 2], num_steps=5, sampler="ddim", seed=3)
    d2 = module.sample([1, 2], num_steps=5, sampler="ddim", seed=3)
    assert torch.equal(d1, d2) and d1.shape == (2, 1, 8, 8)


def test_init_from_raw_state_dict_and_architecture_mismatch(tmp_path):
    src = DiT(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=4, num_classes=10)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p))
    path = tmp_path / "raw.pt"
    torch.save(src.state_dict(), path)
    module = DiTModule(**TINY, init_from=str(path))
    for a, b, c in zip(src.parameters(), module.model.parameters(), module.ema.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(ValueError, match=r"another architecture \(depth=2, hidden_size=32.*configured model \(depth=3"):
        DiTModule(**{**TINY, "depth": 3}, init_from=str(path))


def test_flops_per_image_counts_recompute_apart():
    plain = DiTModule(**TINY)
    ckpt = DiTModule(**TINY, activation_checkpointing="all")
    assert plain.flops_per_image()[0] == ckpt.flops_per_image()[0] == plain.flops_per_image()[1]
    assert ckpt.flops_per_image()[1] > ckpt.flops_per_image()[0]


def test_resuming_a_checkpoint_of_another_architecture_fails_clearly(tmp_path):
    module = DiTModule(**TINY)
    t = trainer(max_steps=1, default_root_dir=tmp_path)
    t.fit(module, DataLoader(DictDataset(), batch_size=8))
    t.save_checkpoint(tmp_path / "a.ckpt")
    other = DiTModule(**{**TINY, "hidden_size": 64})
    with pytest.raises(ValueError, match="the checkpoint being resumed holds another architecture"):
        trainer(max_steps=2, default_root_dir=tmp_path).fit(
            other, DataLoader(DictDataset(), batch_size=8), ckpt_path=tmp_path / "a.ckpt"
        )


def test_compile_in_place_keeps_parameter_names_and_outputs():
    module = DiTModule(**TINY, compile="model")
    keys = list(module.state_dict())
    module.configure_model()
    assert list(module.state_dict()) == keys  # checkpoints stay loadable by plain DiTs
    batch = next(iter(DataLoader(DictDataset(8), batch_size=8)))
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(0.01)
        out = module.model(batch["x"], torch.full((8,), 10), batch["y"])
        ref = module.ema(batch["x"], torch.full((8,), 10), batch["y"])
    assert not torch.allclose(out, ref)  # the compiled network is the trained one, not a copy


def test_forced_attention_backend_matches_auto():
    batch = next(iter(DataLoader(DictDataset(8), batch_size=8)))
    a = DiTModule(**TINY)
    b = DiTModule(**TINY, attention_backend="math")
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        la = a.diffusion_loss(a.model, batch, 0, train=False)["loss"]
        lb = b.diffusion_loss(b.model, batch, 0, train=False)["loss"]
    torch.testing.assert_close(la, lb)


def _fused_choice(strategy, precision, clip, device="cuda"):
    module = DiTModule(**TINY)
    module._device = torch.device(device, 0) if device == "cuda" else torch.device(device)  # no CUDA call is made
    module._trainer = SimpleNamespace(gradient_clip_val=clip, precision=precision, strategy=strategy)
    return module._use_fused()


def test_fused_adamw_is_chosen_where_lightning_and_the_scaler_allow_it():
    from dit_lightning.distributed import DiTDDPStrategy, DiTFSDPStrategy

    ddp, fsdp1 = DiTDDPStrategy(), DiTFSDPStrategy(param_dtype="bfloat16")
    assert _fused_choice(ddp, "bf16-mixed", 1.0) is True
    assert _fused_choice(ddp, "16-mixed", None) is True  # GradScaler hands the scale to the fused kernel
    assert _fused_choice(ddp, "16-mixed", 1.0) is False  # Lightning refuses to clip for it
    assert _fused_choice(fsdp1, "bf16-mixed", None) is True
    # ShardedGradScaler would decide per rank whether to skip a step (its all-reduce is in unscale_ only)
    assert _fused_choice(fsdp1, "16-mixed", None) is False
    assert _fused_choice(ddp, "bf16-mixed", None, device="cpu") is False


class _Metrics(L.Callback):
    """The step metrics after each optimiser step (``train/grad_norm``, ``train/loss_scale``)."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})


def _fp16_scaled_run(fused: bool, **trainer_kw):
    """Two steps of 16-mixed with a GradScaler; AdamW fused (unscales inside its step) or foreach."""
    from lightning.pytorch.plugins import MixedPrecision

    torch.manual_seed(0)
    opt = lambda params: torch.optim.AdamW(params, lr=1e-3, fused=fused or None, foreach=None if fused else True)  # noqa: E731
    module = DiTModule(**TINY, optimizer=opt)
    record = _Metrics()
    kw: dict[str, Any] = dict(max_steps=2, log_every_n_steps=1, callbacks=[record])
    if not trainer_kw:  # on CPU: Lightning turns 16-mixed into bf16-mixed, so the plugin is given explicitly
        kw["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    kw.update(trainer_kw)
    t = trainer(**kw) if not trainer_kw else L.Trainer(logger=False, enable_checkpointing=False, **kw)
    t.fit(module, DataLoader(DictDataset(), batch_size=8))
    return module, t, record.steps


def test_grad_norm_is_unscaled_and_loss_scale_logged_with_fused_adamw_under_grad_scaler():
    """Fused AdamW unscales inside its step, so Lightning leaves the gradients scaled in
    on_before_optimizer_step: the logged norm must still be the true one, as with foreach AdamW."""
    fused_module, fused_t, fused = _fp16_scaled_run(fused=True)
    _, _, foreach = _fp16_scaled_run(fused=False)
    assert fused_module.optimizers().optimizer.defaults["fused"] is True
    assert fused_t.precision_plugin.scaler is not None
    for a, b in zip(fused, foreach):
        assert a["train/loss_scale"] == b["train/loss_scale"] == 65536.0
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-3)
        assert 0 < a["train/grad_norm"] < 100  # not ~65536x the true norm


def test_no_loss_scale_without_grad_scaler():
    module = DiTModule(**TINY)
    record = _Metrics()
    trainer(max_steps=1, log_every_n_steps=1, callbacks=[record]).fit(module, DataLoader(DictDataset(), batch_size=8))
    assert "train/grad_norm" in record.steps[0] and "train/loss_scale" not in record.steps[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention needs a CUDA device")
def test_flash_and_math_attention_agree_in_bf16_on_gpu():
    """The forced SDPA kernels run (flash needs fp16/bf16 inputs) and each computes the loss of the
    fp32 math kernel to bf16 accuracy. Heads of 64 channels, as in every named DiT: at the tiny
    model's 8 channels per head bf16 rounding alone moved the loss by 2-4% per kernel on an H200
    (flash -3.8%, math -2.0% from fp32), at 64 channels by 0.7% at most."""
    batch = {k: v.cuda() for k, v in next(iter(DataLoader(DictDataset(8), batch_size=8))).items()}
    config = {**TINY, "hidden_size": 256, "num_heads": 4}
    reference = DiTModule(**config)
    randomize(reference.model)  # a fresh DiT outputs 0 (adaLN-Zero): attention would not matter
    losses = {}
    for backend, dtype in [("math", torch.float32), ("flash", torch.bfloat16), ("math", torch.bfloat16),
                           ("auto", torch.bfloat16)]:  # fmt: skip
        module = DiTModule(**config, attention_backend=backend)
        module.load_state_dict(reference.state_dict())
        module.cuda()
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            losses[f"{backend}-{dtype}"] = module.diffusion_loss(module.model, batch, 0, train=False)["loss"].float()
    exact = losses.pop("math-torch.float32")
    for name, loss in losses.items():
        torch.testing.assert_close(loss, exact, rtol=2e-2, atol=1e-3, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="16-mixed with GradScaler needs a CUDA device")
def test_fused_adamw_grad_norm_under_16_mixed_on_gpu():
    """On CUDA the module picks fused AdamW itself (no clipping): the same true norm as foreach."""
    module = DiTModule(**TINY)  # fused_optimizer="auto"
    record = _Metrics()
    t = L.Trainer(
        max_steps=2,
        accelerator="gpu",
        devices=1,
        precision="16-mixed",
        log_every_n_steps=1,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
    )
    t.fit(module, DataLoader(DictDataset(), batch_size=8))
    assert module.optimizers().optimizer.defaults.get("fused") is True
    _, _, foreach = _fp16_scaled_run(
        fused=False, max_steps=2, accelerator="gpu", devices=1, precision="16-mixed", log_every_n_steps=1
    )
    for step, (a, b) in enumerate(zip(record.steps, foreach)):
        assert a["train/loss_scale"] == b["train/loss_scale"] > 1
        # step 0: the same weights, so the same gradients: the logged norm is the true (unscaled) one.
        # Later steps start from weights fused and foreach AdamW rounded differently, which fp16 autocast
        # amplifies (0.7% on an H200 at step 1); a scaled norm would be 65536 times off.
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-3 if step == 0 else 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="16-mixed with GradScaler needs a CUDA device")
def test_16_mixed_with_grad_scaler_on_gpu():
    module = DiTModule(**TINY)
    t = L.Trainer(
        max_steps=3,
        accelerator="gpu",
        devices=1,
        precision="16-mixed",
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
    )
    t.fit(module, DataLoader(DictDataset(), batch_size=8))
    assert torch.isfinite(t.callback_metrics["train/loss"])
    assert t.precision_plugin.scaler is not None
    assert not module.optimizers().optimizer.defaults.get(
        "fused"
    )  # fused + clipping + GradScaler is refused by Lightning


def test_optimizer_and_schedule_arguments_and_the_run_length_decay(tmp_path):
    import functools

    from dit_lightning.schedules import WarmupDecayLR

    module = DiTModule(
        **TINY,
        optimizer=functools.partial(torch.optim.SGD, lr=0.5),
        lr_scheduler=functools.partial(WarmupDecayLR, warmup_steps=2, decay="linear"),
    )
    trainer = L.Trainer(max_steps=10, accelerator="cpu", logger=False, enable_checkpointing=False)
    module.trainer = trainer
    config = module.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["lr"] == 0.5
    assert config["lr_scheduler"]["interval"] == "step"
    assert isinstance(sched, WarmupDecayLR) and sched.decay_steps == 10  # the run's optimiser steps
    # the deprecated warmup_steps is the same schedule through WarmupDecayLR
    with pytest.deprecated_call(match="warmup_steps"):
        old = DiTModule(**TINY, warmup_steps=3)
    sched = old.configure_optimizers()["lr_scheduler"]["scheduler"]
    assert isinstance(sched, WarmupDecayLR) and sched.warmup_steps == 3 and sched.decay == "none"


def test_decode_uses_the_recorded_scale_factor_without_a_trainer(tmp_path):
    from dit_lightning.vae import decode_latents, load_vae
    from tests.helpers.data import make_tiny_vae

    vae = make_tiny_vae(str(tmp_path / "vae"))
    module = DiTModule(
        **{**TINY, "latent_shape": (4, 8, 8)}, vae=vae, scale_factor=0.13025
    )  # an SDXL-VAE store's scale
    z = torch.randn(1, 4, 8, 8)
    torch.testing.assert_close(module.decode(z), decode_latents(z, load_vae(vae), 0.13025))
    assert module.hparams.scale_factor == 0.13025


def test_flash_attention_in_fp32_on_cuda_is_refused_with_the_fix():
    """Flash attention has no fp32 kernel: a CUDA run that computes in fp32 says so before training
    (checked against a stand-in CUDA trainer, since the check needs no kernel)."""
    module = DiTModule(**TINY, attention_backend="flash")
    cuda = SimpleNamespace(root_device=torch.device("cuda"))
    module._trainer = SimpleNamespace(strategy=cuda, precision="32-true")
    with pytest.raises(ValueError, match="bf16-mixed or 16-mixed"):
        module.configure_model()
    module._trainer = SimpleNamespace(strategy=cuda, precision="bf16-mixed")
    module.configure_model()  # 16-bit compute: accepted
