"""The learning-rate schedule: warm-up as before, then constant (the paper), cosine or linear decay."""

import pytest
import torch

from dit_lightning.schedules import WarmupDecayLR


def _lrs(steps: int, **kw) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = WarmupDecayLR(opt, **kw)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_equals_the_previous_lambda_then_stays_constant():
    warm = 4
    assert _lrs(8, warmup_steps=warm) == [2.0 * min(1.0, (s + 1) / warm) for s in range(8)]
    assert _lrs(3) == [2.0, 2.0, 2.0]  # no warm-up, no decay: the paper's constant rate


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_decay_reaches_the_floor_at_decay_steps_and_stays(decay):
    lrs = _lrs(14, warmup_steps=2, decay=decay, decay_steps=10, min_lr_ratio=0.1)
    assert lrs[:2] == [1.0, 2.0] and lrs[2] == pytest.approx(2.0)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))  # monotone decay
    assert lrs[10:] == pytest.approx([0.2] * 4)
    mid = lrs[6]  # halfway through the decay
    assert mid == pytest.approx(0.2 + 1.8 * 0.5)


def test_bad_settings_say_what_to_set():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="decay_steps"):
        WarmupDecayLR(opt, warmup_steps=5, decay="cosine")
    with pytest.raises(ValueError, match="min_lr_ratio"):
        WarmupDecayLR(opt, min_lr_ratio=2.0)


def test_a_decay_without_an_end_says_so_instead_of_overflowing():
    """DiTModule takes decay_steps from the run's total steps; an endless run (max_steps -1,
    max_epochs -1) has none, which must read as the setting to give, not int(inf)'s OverflowError."""
    import functools
    from types import SimpleNamespace

    from dit_lightning.optimizers import build_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    factory = functools.partial(WarmupDecayLR, decay="cosine")
    for total in (float("inf"), -1):
        with pytest.raises(ValueError, match="decay_steps, or trainer.max_steps"):
            build_scheduler(factory, opt, 0, SimpleNamespace(estimated_stepping_batches=total))
    assert build_scheduler(factory, opt, 0, SimpleNamespace(estimated_stepping_batches=40)).decay_steps == 40
