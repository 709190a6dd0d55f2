"""The optimiser and learning-rate schedule of a training run, from the factories LightningCLI builds
(``--model.optimizer``, ``--model.lr_scheduler``): the fused AdamW kernel where it is compatible, the
schedule's warm-up and decay length taken from the run where the factory leaves them unset.

Lightning glue (it reads the Trainer's precision, strategy and step estimate); used by ``DiTModule``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Optional

import torch
from lightning.pytorch.strategies import FSDPStrategy

from .precision import is_fp16
from .schedules import WarmupDecayLR

log = logging.getLogger(__name__)


def factory_class(factory: Any) -> Any:
    """The class an optimiser / scheduler factory builds: the class itself, a ``functools.partial``
    of it, or jsonargparse's partial (which passes the class as a positional argument)."""
    if isinstance(factory, type):
        return factory
    if isinstance(factory, functools.partial):
        if isinstance(factory.func, type):
            return factory.func
        return next((a for a in factory.args if isinstance(a, type)), None)
    return None


def use_fused_adamw(choice: Any, device: torch.device, trainer: Any) -> bool:
    """Whether AdamW takes its fused kernel: ``choice`` True / False / "auto" (when compatible), on CUDA only."""
    if choice is False or device.type != "cuda":
        return False
    clip = trainer is not None and trainer.gradient_clip_val not in (None, 0)
    fp16 = trainer is not None and is_fp16(trainer.precision)
    if clip and fp16:
        # Lightning refuses to clip gradients for optimisers that unscale internally
        # (fused AdamW under GradScaler): keep clipping, use the foreach kernel.
        if choice is True:
            log.warning("fused AdamW cannot be combined with gradient clipping under 16-mixed: using foreach AdamW")
        return False
    if fp16 and trainer is not None and isinstance(trainer.strategy, FSDPStrategy):
        # FSDP1's ShardedGradScaler agrees on inf/NaN across ranks only in unscale_(), which Lightning
        # skips for optimisers that unscale inside their step: each rank would skip steps on its own.
        if choice is True:
            log.warning("fused AdamW under FSDP1 with 16-mixed would skip steps per rank: using foreach AdamW")
        return False
    return True


def build_scheduler(factory: Any, optimizer: torch.optim.Optimizer, warmup_steps: int, trainer: Any) -> Any:
    """The schedule ``factory`` builds; a ``WarmupDecayLR`` takes the deprecated ``warmup_steps`` and,
    for a decay without ``decay_steps``, the run's total optimiser steps."""
    keywords = getattr(factory, "keywords", {})
    if factory_class(factory) is WarmupDecayLR:
        if warmup_steps > 0 and not keywords.get("warmup_steps"):
            factory = functools.partial(factory, warmup_steps=warmup_steps)
        if keywords.get("decay", "none") != "none" and keywords.get("decay_steps") is None:
            # the decay ends with the run: its total optimiser steps
            # (read before int(): an endless run estimates inf, and int(inf) would raise OverflowError)
            total = trainer.estimated_stepping_batches if trainer is not None else None
            if not total or total == float("inf") or total <= 0:
                raise ValueError("lr_scheduler decay needs decay_steps, or trainer.max_steps to take it from")
            factory = functools.partial(factory, decay_steps=int(total))
    return factory(optimizer)


def configure_training_optimizers(
    params: Any,
    optimizer_factory: Optional[Any],
    lr_scheduler_factory: Optional[Any],
    *,
    fused: Callable[[], bool],
    warmup_steps: int,
    trainer: Any,
) -> Any:
    """``configure_optimizers``'s answer: the optimiser (default AdamW lr 1e-4, betas (0.9, 0.999), no weight
    decay, the paper's), with its schedule stepped every optimiser step when there is one."""
    if optimizer_factory is not None:
        factory: Any = optimizer_factory  # OptimizerCallable: calling it with fused= is a partial's override
        keywords = getattr(factory, "keywords", {})
        if (
            factory_class(factory) is torch.optim.AdamW
            and keywords.get("fused") is None
            and keywords.get("foreach") is None
            and fused()
        ):
            optimizer = factory(params, fused=True)  # fused AdamW where the user left it unset
        else:
            optimizer = factory(params)
    else:
        use = fused()
        optimizer = torch.optim.AdamW(
            params, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0, fused=use or None, foreach=None if use else True
        )
    if lr_scheduler_factory is not None:
        scheduler = build_scheduler(lr_scheduler_factory, optimizer, warmup_steps, trainer)
    elif warmup_steps > 0:
        scheduler = WarmupDecayLR(optimizer, warmup_steps=warmup_steps)
    else:
        return optimizer
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
