import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from dit_lightning.checkpoints import save_dit as save_pruned
from dit_lightning.distill import DistillationModule
from dit_lightning.module import DiTModule
from tests.helpers.training import TINY_MODULE as TINY
from tests.helpers.training import DictDataset

SMALL = {**TINY, "hidden_size": 16, "num_heads": 2}


pytestmark = pytest.mark.usefixtures("one_thread")


def batch(n: int = 8, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(n, 1, 8, 8, generator=g),
        "y": torch.randint(0, 10, (n,), generator=g),
        "index": torch.arange(n),
    }


@pytest.fixture
def teacher_ckpt(tmp_path):
    """A Lightning checkpoint of a (random, non-trivial) teacher: 4 heads at hidden 32, which
    the weights alone cannot tell (infer_dit_config would guess 1)."""
    module = DiTModule(**TINY)
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if name != "pos_embed":
                p.normal_(0, 0.1)
        module.ema.load_state_dict(module.model.state_dict())
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.strategy.connect(module)
    path = tmp_path / "teacher.ckpt"
    trainer.save_checkpoint(path)
    return str(path), module


def test_teacher_is_loaded_with_its_heads_frozen_and_in_eval_mode(teacher_ckpt):
    path, module = teacher_ckpt
    student = DistillationModule(teacher=path, **SMALL).train()
    teacher = student.teacher
    assert teacher.num_heads == 4 and not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())
    b = batch()
    t = torch.tensor([5, 900, 300, 10, 0, 999, 1, 2])
    with torch.no_grad():
        assert torch.equal(teacher(b["x"], t, b["y"]), module.ema.eval()(b["x"], t, b["y"]))


def test_distillation_terms_vanish_when_the_student_is_the_teacher(teacher_ckpt):
    path, _ = teacher_ckpt
    student = DistillationModule(
        teacher=path, init_from=path, feature_pairs=[(0, 0), (1, 1)], alpha_feature=1.0, **TINY
    ).train()
    with torch.no_grad():
        terms = student.distillation_loss(student.model, batch(), step_key=3, train=True)
    assert terms["distill_eps"] == 0 and terms["distill_var"] == 0 and terms["distill_feat"] == 0
    assert torch.equal(terms["loss"], terms["diffusion"])  # only the data term is left


def test_student_moves_towards_the_teacher(teacher_ckpt):
    path, _ = teacher_ckpt
    student = DistillationModule(
        teacher=path, alpha_diffusion=0.0, feature_pairs=[(1, 1)], alpha_feature=0.5, **SMALL
    ).train()
    assert student.feature_proj[0].weight.shape == (32, 16)  # student width -> teacher width
    params = list(student.model.parameters()) + list(student.feature_proj.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    held_out = batch(16, seed=9)

    def distance() -> float:
        with torch.no_grad():
            t = student.distillation_loss(student.model, held_out, step_key=-5, train=False)
        return float(t["distill_eps"] + t["distill_var"])

    before = distance()
    proj_before = student.feature_proj[0].weight.detach().clone()
    for step in range(15):
        opt.zero_grad()
        student.distillation_loss(student.model, batch(16, seed=step), step_key=step, train=True)["loss"].backward()
        opt.step()
    assert distance() < 0.7 * before
    assert not torch.equal(student.feature_proj[0].weight, proj_before)  # the projection learns too
    assert all(p.grad is None for p in student.teacher.parameters())


def test_teacher_gets_no_gradients_and_stays_out_of_the_checkpoint(teacher_ckpt, tmp_path):
    path, _ = teacher_ckpt
    student = DistillationModule(teacher=path, feature_pairs=[(0, 1)], alpha_feature=1.0, **SMALL)
    teacher_before = {k: v.clone() for k, v in student.teacher.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(student, DataLoader(DictDataset(16), batch_size=8))
    assert not student.teacher.training
    assert all(p.grad is None and not p.requires_grad for p in student.teacher.parameters())
    for k, v in student.teacher.state_dict().items():
        assert torch.equal(v, teacher_before[k])
    optimised = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert not optimised & {id(p) for p in student.teacher.parameters()}
    assert {id(p) for p in student.feature_proj.parameters()} <= optimised

    ckpt_path = tmp_path / "student.ckpt"
    trainer.save_checkpoint(ckpt_path)
    saved = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    assert {k.split(".")[0] for k in saved["state_dict"]} == {"model", "ema", "feature_proj"}
    assert saved["hyper_parameters"]["teacher"] == path
    # Resume: the teacher comes back from its path, the student and projections from the file.
    restored = DistillationModule.load_from_checkpoint(ckpt_path, weights_only=True)
    for k, v in restored.teacher.state_dict().items():
        assert torch.equal(v, teacher_before[k])
    assert torch.equal(restored.feature_proj[0].weight, student.feature_proj[0].weight)
    # Without the teacher (to sample), the student alone loads.
    alone = DistillationModule.load_from_checkpoint(ckpt_path, teacher=None, weights_only=True)
    assert alone.teacher is None and torch.equal(alone.model.pos_embed, student.model.pos_embed)


def test_a_teacher_of_other_data_is_refused_clearly(tmp_path):
    other = DiTModule(**{**TINY, "latent_shape": (4, 8, 8), "num_classes": 5})
    path = save_pruned(other.model, tmp_path / "other.pt", ema=other.ema)
    with pytest.raises(
        ValueError,
        match=r"does not match the student: latent_shape: student \(1, 8, 8\), teacher \(4, 8, 8\); num_classes",
    ):
        DistillationModule(teacher=path, **SMALL)


def test_projections_are_optimised_under_the_same_warm_up(teacher_ckpt):
    path, _ = teacher_ckpt
    student = DistillationModule(teacher=path, feature_pairs=[(0, 1)], alpha_feature=1.0, warmup_steps=10, **SMALL)
    config = student.configure_optimizers()
    groups = config["optimizer"].param_groups
    assert len(groups) == 2 and groups[1]["params"][0] is student.feature_proj[0].weight
    assert groups[0]["lr"] == groups[1]["lr"] == pytest.approx(1e-4 * 0.1)  # step 0 of the warm-up
    config["lr_scheduler"]["scheduler"].step()
    assert groups[0]["lr"] == groups[1]["lr"] == pytest.approx(1e-4 * 0.2)


def test_teacher_follows_the_students_device_and_precision(teacher_ckpt):
    path, _ = teacher_ckpt
    student = DistillationModule(teacher=path, **SMALL).to(torch.bfloat16)  # as bf16-true does
    assert student.teacher_net().pos_embed.dtype == torch.bfloat16
    with torch.no_grad():
        terms = student.distillation_loss(
            student.model, {**batch(), "x": batch()["x"].bfloat16()}, step_key=0, train=True
        )
    assert torch.isfinite(terms["loss"])


class OutOfMemoryAbove(L.Callback):
    """A device that cannot hold a forward pass of more than ``limit`` samples from ``from_step`` on."""

    def __init__(self, limit: int, from_step: int) -> None:
        self.limit, self.from_step, self.raised = limit, from_step, 0

    def setup(self, trainer, pl_module, stage):
        def check(_module, args):
            if trainer.global_step >= self.from_step and args[0].shape[0] > self.limit:
                self.raised += 1
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        pl_module.model.blocks[0].register_forward_pre_hook(check)


def test_distillation_backs_off_under_auto_fit_and_follows_the_plain_trajectory(teacher_ckpt, store):
    """Distillation runs DiTModule's own step: auto-fit's out-of-memory recovery redoes a step of it
    with a smaller micro-batch, and the run matches plain Lightning accumulation with that split."""
    from dit_lightning.callbacks.autofit import AutoFit
    from dit_lightning.data import LatentDataModule

    path, _ = teacher_ckpt

    def train(callbacks, accumulate):
        L.seed_everything(0, verbose=False)
        dm = LatentDataModule(store, global_batch_size=32, num_workers=0, val_size=64, random_flip=False)
        student = DistillationModule(teacher=path, **SMALL, ema_decay=0.9, alpha_feature=1.0, feature_pairs=[[0, 1]])
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=4,
            accumulate_grad_batches=accumulate,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=callbacks,
        )
        trainer.fit(student, dm)
        return student

    device = OutOfMemoryAbove(limit=16, from_step=2)
    fit = AutoFit(enabled=False, oom_recovery=True)
    backed_off = train([device, fit], 1)
    assert device.raised >= 1 and fit.backoffs >= 1 and fit.setting.micro_batch <= 16
    assert fit.history[0]["step"] == 2
    plain = train([], 32 // fit.setting.micro_batch)
    for a, b in [
        (backed_off.model, plain.model),
        (backed_off.ema, plain.ema),
        (backed_off.feature_proj, plain.feature_proj),
    ]:
        for p, q in zip(a.parameters(), b.parameters()):
            assert (p - q).abs().max().item() <= 1e-6


def test_a_teacher_of_the_other_objective_is_refused(teacher_ckpt):
    path, _ = teacher_ckpt  # a DDPM run (its hyper-parameters record it)
    with pytest.raises(ValueError, match="objective: student flow, teacher ddpm"):
        DistillationModule(teacher=path, **{**SMALL, "learn_sigma": False}, objective="flow")


def test_a_lightningdit_teacher_distils_into_a_dit_block_student(tmp_path):
    """Blocks may differ between teacher and student (the terms compare outputs and block tokens):
    a LightningDiT-block teacher (RMSNorm, SwiGLU, rope), read with its options, teaches a DiT-block student."""
    from dit_lightning.models import build_dit

    torch.manual_seed(0)
    net = build_dit(
        "custom",
        input_size=8,
        patch_size=2,
        in_channels=1,
        hidden_size=32,
        depth=2,
        num_heads=4,
        num_classes=10,
        norm="rmsnorm",
        mlp="swiglu",
        pos_embed="rope",
    )
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name != "pos_embed":
                p.normal_(0, 0.1)
    path = save_pruned(net, tmp_path / "teacher.pt", ema=net)
    student = DistillationModule(teacher=path, feature_pairs=[(1, 1)], alpha_feature=1.0, **SMALL).train()
    assert student.teacher.mlp_kind == "swiglu" and student.teacher.feat_rope is not None
    assert student.model.mlp_kind == "gelu"
    terms = student.distillation_loss(student.model, batch(), step_key=3, train=True)
    assert terms["distill_eps"] > 0 and terms["distill_feat"] > 0
    terms["loss"].backward()


def test_a_reg_teacher_is_refused_naming_its_class_token(tmp_path):
    from dit_lightning.models.dit import build_dit

    reg = build_dit("custom", **{k: TINY[k] for k in ("hidden_size", "depth", "num_heads", "patch_size")},
                    input_size=8, in_channels=1, num_classes=10, learn_sigma=False, class_token_dim=8)  # fmt: skip
    path = save_pruned(reg, tmp_path / "reg.pt", ema=reg, extra_args={"objective": "flow"})
    with pytest.raises(ValueError, match=r"reg\.pt has REG's class token \(class_token_dim 8\)"):
        DistillationModule(teacher=path, **{**SMALL, "objective": "flow"})
