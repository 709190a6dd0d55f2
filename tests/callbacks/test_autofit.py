"""Auto-fit in a run (dit_lightning/callbacks/autofit.py), on CPU with the test device model
(tests/helpers/device_model.py: out-of-memory whenever the planner's peak of the setting in force
exceeds a simulated capacity).

The proof of the back-off is the trajectory: a run that starts too big, runs out of memory, backs off
and redoes the step logs the same loss at every step as a run started with the final setting, and ends
with the same weights, EMA and optimiser state as a plain Lightning run (automatic optimisation, its
own gradient accumulation) with that setting.
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from dit_lightning.callbacks.autofit import AutoFit
from dit_lightning.data import LatentDataModule
from dit_lightning.models import build_dit
from dit_lightning.module import DiTModule
from tests.helpers.device_model import SimulatedDevice

pytestmark = pytest.mark.usefixtures("one_thread")

MiB = 1024**2
# The tiny DiT on the digits (global batch 32), as the planner sees it on CPU, fp32 (MiB per device):
# 32 x 1 no recompute 3.91, 32 x 1 first block recomputed 2.68, 16 x 2 no recompute 2.53.
BUDGET_GIB = 0.004  # 4.1 MiB: auto-fit starts with 32 x 1
CAPACITY_MIB = 2.65  # what the simulated device really has: 16 x 2 fits, 32 x 1 does not
STEPS = 6


def run(
    store: str,
    out: Path,
    name: str,
    callbacks: list[L.Callback],
    accumulate: int = 1,
    steps: int = STEPS,
    ckpt_path: Optional[str] = None,
    save: Optional[str] = None,
    checkpointing: Any = None,
) -> tuple[DiTModule, L.Trainer]:
    L.seed_everything(0, verbose=False)
    dm = LatentDataModule(store, global_batch_size=32, num_workers=0, val_size=64, random_flip=False)
    module = DiTModule(
        "custom",
        latent_shape=dm.latent_shape,
        num_classes=dm.num_classes,
        depth=2,
        hidden_size=32,
        num_heads=4,
        patch_size=2,
        ema_decay=0.9,  # moves visibly in a few steps
        ema_warmup=True,  # the decay depends on the step: a step counted twice would show
        vae=dm.spec.vae,
        activation_checkpointing=checkpointing,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        precision="32-true",
        logger=CSVLogger(str(out), name=name, version=""),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        val_check_interval=steps if accumulate == 1 else steps * accumulate,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        gradient_clip_val=0.5,  # clipping by norm happens in the redone step as in a plain one
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(save)
    return module, trainer


def logged(out: Path, name: str) -> dict[str, dict[int, float]]:
    values: dict[str, dict[int, float]] = {}
    with open(out / name / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value and key not in ("step", "epoch"):
                    values.setdefault(key, {})[int(row["step"])] = float(value)
    return values


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def optimizer_diff(a: L.Trainer, b: L.Trainer) -> float:
    sa, sb = a.optimizers[0].state_dict()["state"], b.optimizers[0].state_dict()["state"]
    assert sa.keys() == sb.keys()
    return max((sa[i][k] - sb[i][k]).abs().max().item() for i in sa for k in ("exp_avg", "exp_avg_sq"))


def test_a_run_that_starts_too_big_backs_off_redoes_the_step_and_follows_the_final_settings_trajectory(
    store, tmp_path, capsys
):
    device = SimulatedDevice(capacity_mib=CAPACITY_MIB, from_step=2)
    fit = AutoFit(memory_gib=BUDGET_GIB)
    a, ta = run(store, tmp_path, "backed_off", [device, fit])
    out = capsys.readouterr().out
    # it started with the planner's choice for the (too large) budget, ran out at step 2, backed off twice
    assert "chosen     32 x 1 x 1" in out
    assert [h["to"]["micro_batch"] for h in fit.history] == [32, 16]
    assert [h["to"]["checkpointed_blocks"] for h in fit.history] == [1, 0]  # more recomputed blocks first
    assert [r[0] for r in device.raised] == [2, 2]  # both errors in step 2, which was redone
    assert fit.setting is not None and (fit.setting.micro_batch, fit.setting.accumulate_grad_batches) == (16, 2)
    assert out.count("redoing step 2") == 2
    assert ta.global_step == STEPS

    # the same run started with the final setting (auto-fit picks it for a budget it fits)
    c, _ = run(store, tmp_path, "final_setting", [AutoFit(memory_gib=2.6 / 1024)])
    # a plain Lightning run with the final setting: automatic optimisation, Lightning's accumulation
    b, tb = run(store, tmp_path, "plain", [], accumulate=2)

    got, want, plain = logged(tmp_path, "backed_off"), logged(tmp_path, "final_setting"), logged(tmp_path, "plain")
    assert sorted(got["train/loss"]) == list(range(STEPS))
    for step, loss in want["train/loss"].items():  # every step, before and after the back-off
        assert abs(got["train/loss"][step] - loss) <= 1e-6, (step, got["train/loss"], want["train/loss"])
    assert abs(got["val/loss"][STEPS - 1] - plain["val/loss"][STEPS - 1]) <= 1e-6
    assert max_diff(a.model, c.model) <= 1e-6 and max_diff(a.model, b.model) <= 1e-6
    assert a.ema is not None and b.ema is not None and max_diff(a.ema, b.ema) <= 1e-6
    assert optimizer_diff(ta, tb) <= 1e-6
    # the change is logged: back-offs and the setting in force, per step
    assert got["auto_fit/backoffs"] == {0: 0, 1: 0, 2: 2, 3: 2, 4: 2, 5: 2}
    assert got["auto_fit/micro_batch"][1] == 32 and got["auto_fit/micro_batch"][2] == 16
    hparams = (tmp_path / "backed_off" / "hparams.yaml").read_text()
    assert "auto_fit/micro_batch: 32" in hparams and "auto_fit/runner_up" in hparams


def test_recovery_alone_in_the_forward_pass_and_a_checkpoint_that_resumes_anywhere(store, tmp_path):
    """Out-of-memory recovery without auto-fit (opt-in), an error in the forward pass, and the
    checkpoint of such a run: it holds the setting that worked and resumes in a plain run too."""
    ckpt = str(tmp_path / "four.ckpt")
    device = SimulatedDevice(capacity_mib=CAPACITY_MIB, from_step=1, phase="forward")
    fit = AutoFit(enabled=False, oom_recovery=True)
    _, t4 = run(store, tmp_path, "recovery", [device, fit], steps=4, save=ckpt)
    assert fit.backoffs == 2 and fit.setting is not None and fit.setting.micro_batch == 16
    assert device.raised[0][0] == 1
    state = torch.load(ckpt, weights_only=False)
    assert state["callbacks"]["AutoFit"]["setting"]["micro_batch"] == 16 and state["global_step"] == 4
    # resumed by auto-fit: it starts with the recorded setting (the device would refuse 32 x 1)
    device2 = SimulatedDevice(capacity_mib=CAPACITY_MIB, from_step=0)
    resumed, _ = run(
        store, tmp_path, "resumed", [device2, AutoFit(enabled=False, oom_recovery=True)], steps=8, ckpt_path=ckpt
    )
    assert device2.raised == []
    # resumed by a plain run with that setting (accumulate 2): same steps, same data, same weights
    plain, tp = run(store, tmp_path, "resumed_plain", [], accumulate=2, steps=8, ckpt_path=ckpt)
    assert tp.global_step == 8
    full, _ = run(store, tmp_path, "uninterrupted", [AutoFit(memory_gib=2.6 / 1024)], steps=8)
    assert max_diff(resumed.model, full.model) <= 1e-6 and max_diff(plain.model, full.model) <= 1e-6
    assert plain.ema is not None and full.ema is not None and max_diff(plain.ema, full.ema) <= 1e-6
    # and the other way: a plain run's checkpoint (accumulating 2 x 16), resumed with auto-fit's step
    plain_ckpt = str(tmp_path / "plain_four.ckpt")
    run(store, tmp_path, "plain_four", [], accumulate=2, steps=4, save=plain_ckpt)
    adopted, ta = run(store, tmp_path, "adopted", [AutoFit(memory_gib=2.6 / 1024)], steps=8, ckpt_path=plain_ckpt)
    assert ta.global_step == 8 and max_diff(adopted.model, full.model) <= 1e-6


def test_speed_up_when_safe_steps_back_up_and_keeps_only_what_fits(store, tmp_path, capsys):
    # a transient shortage (steps 1-2) forces a back-off; later the measured peak is far below the
    # capacity, so auto-fit tries the faster setting again, and keeps it
    device = SimulatedDevice(capacity_mib=CAPACITY_MIB, from_step=1, until_step=2)
    fit = AutoFit(memory_gib=BUDGET_GIB, speed_up_after=2)
    a, _ = run(store, tmp_path, "transient", [device, fit], steps=8)
    kinds = [h["kind"] for h in fit.history]
    assert kinds[:2] == ["back-off 1 of 4", "back-off 2 of 4"] and kinds[2] == "speed-up"
    assert fit.setting is not None and fit.setting.micro_batch == 32 and fit._speed["done"]
    assert "speed-up kept" in capsys.readouterr().out
    reference, _ = run(store, tmp_path, "reference", [AutoFit(memory_gib=BUDGET_GIB)], steps=8)
    assert max_diff(a.model, reference.model) <= 1e-6
    # when the device still cannot hold it, the trial ends at its first error: back to what worked
    device = SimulatedDevice(capacity_mib=CAPACITY_MIB, from_step=1)
    fit = AutoFit(memory_gib=BUDGET_GIB, speed_up_after=2)
    b, _ = run(store, tmp_path, "lasting", [device, fit], steps=8)
    assert [h["kind"] for h in fit.history][-2:] == ["speed-up", "the faster setting being tried ran out of memory"]
    assert fit.setting is not None and fit.setting.micro_batch == 16 and fit.backoffs == 2
    assert max_diff(b.model, reference.model) <= 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dit_xl2_started_too_big_on_a_real_gpu_backs_off_to_a_setting_that_fits(tmp_path):
    """The GPU acceptance of auto-fit: DiT-XL/2 at a global batch of 512 on one GPU, the planner told
    the card has four times its free memory (so it starts at a micro-batch that cannot fit), real
    CUDA out-of-memory errors, back-offs, and two completed steps on a setting the planner predicts
    to fit the card's real free memory."""
    from dit_lightning.autofit import cuda_budget, decide
    from dit_lightning.planner.memory import GiB
    from tests.helpers.data import make_random_store

    store = make_random_store(str(tmp_path / "latents"), n=1024, latent_shape=(4, 32, 32), shard_size=512)
    budget, _ = cuda_budget(0, margin_gib=1.0)
    L.seed_everything(0, verbose=False)
    dm = LatentDataModule(store.path, global_batch_size=512, num_workers=2, val_size=0)
    module = DiTModule("DiT-XL/2", latent_shape=dm.latent_shape, num_classes=dm.num_classes, vae=dm.spec.vae)
    # 10% per back-off: fewer rungs between micro-batch 512 without recompute and what the card holds
    fit = AutoFit(memory_gib=4 * budget / GiB, max_backoffs=16, backoff_reduction=0.1)
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[fit],
        num_sanity_val_steps=0,
    )
    trainer.fit(module, dm)
    assert trainer.global_step == 2 and fit.backoffs >= 1 and fit.setting is not None and fit.problem is not None
    real = fit.problem.with_budget(budget, "the card's free memory")
    landed = fit.setting
    assert real.fits(landed), (
        f"the run survived on {landed.short()}, which the planner predicts needs {real.peak(landed) / GiB:.1f} GiB of "
        f"the card's {budget / GiB:.1f}: the planner's CUDA constants overestimate this card"
    )
    # the planner's own choice at the micro-batch it landed on, for the memory really there
    pinned = decide(dataclasses.replace(real, accumulate_grad_batches=landed.accumulate_grad_batches, _cache={}))
    measured = fit.probe.peak() if fit.probe is not None else 0
    print(
        f"GPU auto-fit: {torch.cuda.get_device_name()}, free budget {budget / GiB:.1f} GiB; started "
        f"{fit.history[0]['from']}, landed on {landed.short()} after {fit.backoffs} back-offs "
        f"(predicted {real.peak(landed) / GiB:.1f} GiB, measured {measured / GiB:.1f} GiB); the planner's "
        f"setting for that micro-batch: {pinned.chosen.short()}"
    )
    assert landed.checkpointed_blocks >= pinned.chosen.checkpointed_blocks or landed.micro_batch < 512


def test_the_problem_of_a_module_plans_its_qk_norm():
    """build_problem reads the network's QK-norm, so auto-fit plans its extra saved tensors."""
    from dit_lightning.callbacks.autofit import build_problem

    kw: dict[str, Any] = dict(
        depth=2, hidden_size=32, num_heads=4, patch_size=2, latent_shape=(4, 8, 8), num_classes=10
    )
    plain = build_problem(DiTModule("custom", **kw), 32, 1, "cpu", None, {})
    qk = build_problem(DiTModule("custom", qk_norm=True, **kw), 32, 1, "cpu", None, {})
    assert qk.shape == {**plain.shape, "qk_norm": True} and plain.shape["qk_norm"] is False
    s = plain.setting("32-true", 32, 0)
    assert qk.peak(s) > plain.peak(s)
    module = DiTModule("custom", **kw)  # REG's class token (the network's; its training is the module's concern)
    module.model = build_dit("custom", input_size=8, in_channels=4, class_token_dim=16, **{
        k: v for k, v in kw.items() if k != "latent_shape"
    })  # fmt: skip
    token = build_problem(module, 32, 1, "cpu", None, {})
    assert token.shape == {**plain.shape, "class_token_dim": 16} and token.peak(s) > plain.peak(s)
