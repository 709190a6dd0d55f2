"""Learning-rate schedules: linear warm-up, then constant (the paper), cosine or linear decay."""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR

Decay = Literal["none", "cosine", "linear"]


class WarmupDecayLR(LambdaLR):
    """``lr = base_lr * factor(step)``, stepped once per optimiser step.

    The factor rises linearly over ``warmup_steps`` (``(step + 1) / warmup_steps``, so the first
    step already trains), then stays 1 (``decay: none``, the DiT paper's constant learning rate) or
    falls to ``min_lr_ratio`` at ``decay_steps`` by a cosine or a straight line and stays there.

    Args:
        optimizer: the wrapped optimiser.
        warmup_steps: optimiser steps of linear warm-up (0: none).
        decay: ``none``, ``cosine`` or ``linear``.
        decay_steps: the step at which the decay ends (warm-up included); DiTModule fills in
            the run's total optimiser steps when it is left unset.
        min_lr_ratio: the final factor of the decay.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int = 0,
        decay: Decay = "none",
        decay_steps: Optional[int] = None,
        min_lr_ratio: float = 0.0,
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if decay not in ("none", "cosine", "linear"):
            raise ValueError(f"decay must be 'none', 'cosine' or 'linear', got {decay!r}")
        if decay != "none" and (decay_steps is None or decay_steps <= warmup_steps):
            raise ValueError(
                f"decay '{decay}' needs decay_steps > warmup_steps ({warmup_steps}), got {decay_steps}: "
                "set lr_scheduler.init_args.decay_steps (or trainer.max_steps, which DiTModule uses by default)"
            )
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.warmup_steps = warmup_steps
        self.decay = decay
        self.decay_steps = decay_steps
        self.min_lr_ratio = min_lr_ratio
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return min(1.0, (step + 1) / self.warmup_steps)
        if self.decay == "none":
            return 1.0
        assert self.decay_steps is not None
        progress = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.decay == "cosine" else 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape
