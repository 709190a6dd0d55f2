"""A test device model for auto-fit (importable as tests.helpers.device_model): a CPU run behaves as if
its device had ``capacity_mib`` of memory, by the planner's own measure.

:class:`SimulatedDevice` is a callback. From optimiser step ``from_step`` on, every training pass whose
setting in force (the micro-batch it really runs, the blocks the model really recomputes, the
precision, the accumulation) the planner predicts to need more than the capacity raises
``torch.OutOfMemoryError`` where a CUDA device would: at the start of the backward pass (the peak,
``phase="backward"``), or in the forward pass of the last block (``phase="forward"``); up to
``until_step`` if given (a transient shortage). ``ranks`` limits it to some ranks (one rank of a DDP
run running out). It also serves as auto-fit's memory
probe (the predicted peak of the setting in force), so "speed up when safe" can be tested on CPU.
CLI runs load it by dotted path: ``--trainer.callbacks+=tests.helpers.device_model.SimulatedDevice``.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch

from dit_lightning.autofit import FitProblem
from dit_lightning.callbacks.autofit import AutoFit, _precision_name, build_problem
from dit_lightning.planner.memory import MiB


class SimulatedDevice(L.Callback):
    def __init__(
        self,
        capacity_mib: float,
        from_step: int = 0,
        until_step: Optional[int] = None,
        ranks: Optional[list[int]] = None,
        phase: str = "backward",
    ) -> None:
        self.capacity = int(capacity_mib * MiB)
        self.from_step, self.until_step, self.ranks, self.phase = from_step, until_step, ranks, phase
        self.raised: list[tuple[int, int, int]] = []  # (step, micro-batch, predicted bytes) of each error
        self._trainer: Optional[L.Trainer] = None
        self._module: Any = None
        self._problem: Optional[FitProblem] = None

    def _autofit(self) -> Optional[AutoFit]:
        assert self._trainer is not None
        return next((c for c in self._trainer.callbacks if isinstance(c, AutoFit)), None)  # type: ignore[attr-defined]

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer, self._module = trainer, pl_module
        net: Any = pl_module.model
        if self.phase == "backward":  # (autograd runs the backward pass with grad mode off)
            net.final_layer.register_full_backward_pre_hook(lambda m, grad: self._check(grad[0].shape[0], True))
        else:
            net.blocks[-1].register_forward_pre_hook(lambda m, args: self._check(args[0].shape[0], False))
        autofit = self._autofit()
        if autofit is not None:
            autofit.probe = self

    def predicted(self, micro_batch: int) -> int:
        """The planner's peak for the setting really in force, at this micro-batch."""
        trainer, module = self._trainer, self._module
        assert trainer is not None
        if self._problem is None:
            dm = trainer.datamodule  # type: ignore[attr-defined]
            self._problem = build_problem(
                module, dm.global_batch_size, trainer.world_size, "cpu", trainer.strategy, pins={}
            )
        blocks = list(module.model.checkpoint_blocks)
        setting = self._problem.setting(_precision_name(trainer), micro_batch, blocks)
        return self._problem.peak(setting)

    def _check(self, micro_batch: int, backward: bool) -> None:
        trainer = self._trainer
        if trainer is None or not trainer.training or not (backward or torch.is_grad_enabled()):
            return
        if trainer.global_step < self.from_step or (
            self.until_step is not None and trainer.global_step >= self.until_step
        ):
            return  # (until_step: a transient shortage, e.g. another process held memory for a while)
        if self.ranks is not None and trainer.global_rank not in self.ranks:
            return
        need = self.predicted(micro_batch)
        if need > self.capacity:
            self.raised.append((trainer.global_step, micro_batch, need))
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated device of {self.capacity / MiB:.2f} MiB: the planner predicts "
                f"{need / MiB:.2f} MiB for micro-batch {micro_batch})"
            )

    # auto-fit's memory probe
    def reset(self) -> None:
        pass

    def peak(self) -> int:
        autofit = self._autofit()
        assert autofit is not None and autofit.setting is not None and autofit.problem is not None
        return autofit.problem.peak(autofit.setting)
