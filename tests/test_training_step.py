"""The one training step (``DiTModule.training_step``): what reaches the host per optimiser step, and
gradient clipping with and without auto-fit's redoable step.

Host reads are counted by wrapping every Tensor method that copies a value to the host (``item``,
``tolist``, ``cpu``, ``numpy``, ``__bool__``, ``__float__``, ``__int__``) and keeping the calls made
from this package's own code while a run trains (Lightning's own reads at its logging points are
Lightning's). On CUDA each such read drains the queue. Between two logged steps the package reads
nothing; at a logged step the loss path (the step, EMA, auto-fit, the fault-tolerance checks) reads
once, and the monitors turn their host-side timings into the logged rates.
"""

from __future__ import annotations

import functools
import os
import sys
from collections import Counter
from typing import Any, Optional

import lightning as L
import pytest
import torch

import dit_lightning
from dit_lightning.callbacks import DiTThroughputMonitor, GPUMemoryMonitor
from dit_lightning.callbacks.autofit import AutoFit
from dit_lightning.callbacks.fault_tolerance import FaultTolerance
from dit_lightning.data import LatentDataModule
from dit_lightning.module import DiTModule

pytestmark = pytest.mark.usefixtures("one_thread")

PACKAGE = os.path.dirname(dit_lightning.__file__) + os.sep
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
STEPS, EVERY = 8, 4
# the modules on the loss path: everything between the batch and the weights, and the checks on it
LOSS_PATH = ("module.py", "distill.py", "autofit.py", "callbacks/autofit.py", "callbacks/fault_tolerance.py",
             "distributed/", "diffusion/", "models/", "keyed_random.py")  # fmt: skip


class HostReads(L.Callback):
    """Counts host reads made by dit_lightning's code, per optimiser step, while the run trains."""

    def __init__(self) -> None:
        self.by_step: Counter[int] = Counter()  # every read by the package
        self.loss_path: Counter[int] = Counter()  # reads by the loss path
        self.where: Counter[str] = Counter()
        self._trainer: Optional[L.Trainer] = None
        self._saved: dict[str, Any] = {}

    def _wrap(self, name: str) -> Any:
        original = getattr(torch.Tensor, name)

        @functools.wraps(original)
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PACKAGE) and self._trainer is not None:
                step, where = self._trainer.global_step, os.path.relpath(caller.f_code.co_filename, PACKAGE)
                self.by_step[step] += 1
                self.loss_path[step] += where.startswith(LOSS_PATH)
                self.where[f"{where}:{caller.f_lineno} {name}"] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._trainer = trainer
        for name in READS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._trainer = None


def module_and_data(store: str, **kwargs: Any) -> tuple[DiTModule, LatentDataModule]:
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
        vae=dm.spec.vae,
        **kwargs,
    )
    return module, dm


def trainer(callbacks: list[L.Callback], steps: int = STEPS, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        precision="32-true",
        logger=L.pytorch.loggers.CSVLogger(kwargs.pop("log_dir"), name="", version="")
        if "log_dir" in kwargs
        else False,
        log_every_n_steps=EVERY,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **kwargs,
    )


@pytest.mark.parametrize("auto_fit", [False, True], ids=["plain", "auto-fit-step-mode"])
def test_the_step_reads_the_host_at_most_once_per_logged_step(store, tmp_path, auto_fit):
    module, dm = module_and_data(store)
    reads = HostReads()
    callbacks: list[L.Callback] = [reads, FaultTolerance(), DiTThroughputMonitor(warmup_steps=1), GPUMemoryMonitor()]
    fit: Optional[AutoFit] = None
    if auto_fit:  # 2.6 MiB: 16 x 2, so every step is split and accumulated inside the module's step
        fit = AutoFit(memory_gib=2.6 / 1024)
        callbacks.append(fit)
    trainer(callbacks, log_dir=str(tmp_path)).fit(module, dm)
    if fit is not None:
        assert fit.step_mode and fit.setting is not None and fit.setting.micro_batch == 16
        assert module.micro_batch_size is None  # given back at the end of fit
    logged_steps = [s for s in range(1, STEPS + 1) if s % EVERY == 0]
    detail = dict(reads.where)
    # global_step counts the steps done: reads during step s (0-based) are counted at s, reads in the
    # hooks after it at s + 1, which is where the logged steps are
    quiet = {s: n for s, n in reads.by_step.items() if s not in logged_steps}
    assert not quiet, (quiet, detail)
    assert all(reads.loss_path[s] == 1 for s in logged_steps), (dict(reads.loss_path), detail)
    # that one read is the fault-tolerance check (which saw every step's loss on the device)
    assert [w for w in detail if w.startswith(LOSS_PATH)] == [w for w in detail if "fault_tolerance" in w], detail


def test_a_nan_between_two_reads_is_reported_at_its_own_step(store, tmp_path):
    """The non-finite watch runs on the device; the read at the next logged step names the step."""

    class Poison(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
            if trainer.global_step == 5:  # the 6th step's loss is NaN
                batch["x"][0, 0, 0, 0] = float("nan")

    module, dm = module_and_data(store)
    with pytest.raises(Exception, match=r"the training loss is NaN or inf at step 6: training stopped"):
        trainer([Poison(), FaultTolerance()], steps=12).fit(module, dm)


def sgd_update_norm(store: str, tmp_path: Any, clip: Optional[float], auto_fit: bool) -> float:
    """The norm of the first SGD update: lr x the (clipped) gradient norm."""
    module, dm = module_and_data(store, optimizer=functools.partial(torch.optim.SGD, lr=0.1), ema=False)
    before = torch.cat([p.detach().flatten().clone() for p in module.model.parameters()])
    # 16 x 2 either way: Lightning's accumulation, or the redoable step (recovery alone) accumulating
    # inside the module's step
    callbacks: list[L.Callback] = [AutoFit(enabled=False, oom_recovery=True)] if auto_fit else []
    trainer(callbacks, steps=1, gradient_clip_val=clip, accumulate_grad_batches=2).fit(module, dm)
    if auto_fit:
        assert callbacks[0].setting is not None and callbacks[0].setting.micro_batch == 16  # type: ignore[attr-defined]
    after = torch.cat([p.detach().flatten() for p in module.model.parameters()])
    return float((after - before).norm())


def test_gradient_clipping_applies_with_and_without_auto_fit(store, tmp_path):
    free = sgd_update_norm(store, tmp_path, None, auto_fit=False)
    assert free > 0.1 * 0.05  # the unclipped gradient norm is well above the clip below
    for auto_fit in (False, True):
        clipped = sgd_update_norm(store, tmp_path, 0.05, auto_fit=auto_fit)
        assert clipped == pytest.approx(0.1 * 0.05, rel=1e-4), auto_fit
    # and the redoable step takes the same unclipped step as Lightning's accumulation
    assert sgd_update_norm(store, tmp_path, None, auto_fit=True) == pytest.approx(free, rel=1e-5)
