"""Auto-fit's decisions (dit_lightning/autofit.py): the planner's fastest setting that fits a budget, what
is kept as given, the message when nothing fits, the back-off ladder, the one step toward a faster
setting (which errors count as out-of-memory: tests/test_device_memory.py)."""

from __future__ import annotations

import dataclasses

import pytest

from dit_lightning.autofit import (
    AutoFitConfig,
    FitProblem,
    NothingFits,
    Setting,
    decide,
    next_faster,
    next_safer,
)
from dit_lightning.planner import plan_memory, recommend
from dit_lightning.planner.hardware import gpu_spec
from dit_lightning.planner.memory import GiB

XL2 = dict(latent_size=32, depth=28, hidden_size=1152, num_heads=16, patch_size=2, in_channels=4, num_classes=1000)


def xl2(gib: float = 23.6, **kw) -> FitProblem:
    return FitProblem(
        XL2,
        kw.pop("global_batch", 256),
        device="cuda",
        budget_bytes=int(gib * GiB),
        budget_source="test",
        gpu=gpu_spec("rtx4090"),
        model_name="DiT-XL/2",
        ddp_gradient_as_bucket_view=True,
        **kw,
    )


def test_decision_is_the_planners_fastest_fit_and_names_a_runner_up():
    decision = decide(xl2())
    rec = recommend("DiT-XL/2", gpu="rtx4090")  # `plan --fit` answers the same
    chosen = decision.chosen
    assert (chosen.precision, chosen.micro_batch, chosen.accumulate_grad_batches, chosen.checkpointed_blocks) == (
        rec.precision,
        rec.micro_batch,
        rec.accumulate_grad_batches,
        rec.checkpointed_blocks,
    )
    p = decision.problem
    assert p.fits(chosen) and p.peak(chosen) == pytest.approx(rec.memory.total, rel=1e-9)
    runner = decision.runner_up
    assert runner is not None and runner != chosen and p.fits(runner)
    assert p.step_time(runner) >= p.step_time(chosen)
    table = decision.table()
    assert "chosen" in table and "runner-up" in table and "22.07 GiB" in table
    hp = decision.hparams()
    assert hp["auto_fit/micro_batch"] == 16 and hp["auto_fit/runner_up"] == runner.short()


def test_explicit_settings_are_kept():
    p = xl2(precision="32-true", activation_checkpointing="first:20")
    d = decide(p)
    assert d.chosen.precision == "32-true" and d.chosen.activation_checkpointing == "first:20"
    assert all(s.precision == "32-true" and s.checkpointed_blocks == 20 for s in d.ranking)
    assert "kept as given: trainer.precision=32-true, model.activation_checkpointing=first:20" in d.table()
    # the planner's memory of the pinned blocks is the model's own setting
    kw = dict(
        micro_batch=d.chosen.micro_batch, precision="32-true", accumulate_grad_batches=d.chosen.accumulate_grad_batches
    )
    assert p.peak(d.chosen) == plan_memory("DiT-XL/2", activation_checkpointing="first:20", gpu="rtx4090", **kw).total
    pinned = decide(xl2(accumulate_grad_batches=4))
    assert (pinned.chosen.micro_batch, pinned.chosen.accumulate_grad_batches) == (64, 4)
    assert pinned.chosen.checkpointed_blocks > 0  # micro 64 needs recomputation on 24 GB


def test_nothing_fits_says_what_is_needed_and_which_levers_close_the_gap():
    with pytest.raises(NothingFits) as e:
        decide(xl2(10.0))
    text = str(e.value)
    assert "nothing fits" in text and "the budget is 10.00 GiB" in text and "No step was run" in text
    assert "12.57 GiB of it weights, gradients, optimiser states and EMA" in text  # DiT-XL/2's static state
    assert "--model.ema false" in text and "FSDP" in text and "a device with" in text
    assert isinstance(e.value, ValueError)  # the CLI prints it without a traceback


def test_back_off_recomputes_more_blocks_first_then_halves_the_micro_batch():
    p = xl2()
    s = decide(p).chosen
    ladder = [s]
    while (s := next_safer(p, s, 0.05)) is not None:
        ladder.append(s)
    for a, b in zip(ladder, ladder[1:]):
        assert p.peak(b) <= 0.95 * p.peak(a)  # each step is predicted to need 5% less
        assert b.micro_batch * b.accumulate_grad_batches == 256 and b.precision == a.precision
        if b.micro_batch == a.micro_batch:
            assert b.checkpointed_blocks > a.checkpointed_blocks
        else:  # only when recomputing more at this micro-batch no longer buys 5%
            assert b.micro_batch <= a.micro_batch // 2
            assert p.peak(p.setting(a.precision, a.micro_batch, 28)) > 0.95 * p.peak(a)
    assert ladder[1].micro_batch == ladder[0].micro_batch and ladder[-1].micro_batch < ladder[0].micro_batch
    assert ladder[-1].micro_batch == 1 or p.peak(ladder[-1]) < p.peak(p.setting("bf16-mixed", 1, 28)) / 0.95

    # what was given explicitly stays: pinned blocks only halve the micro-batch, a pinned
    # accumulation only recomputes more, and with both there is nowhere to go
    kept_blocks = xl2(activation_checkpointing="none")
    s = kept_blocks.setting("bf16-mixed", 16, "none")
    assert next_safer(kept_blocks, s) == kept_blocks.setting("bf16-mixed", 8, "none")
    kept_split = xl2(accumulate_grad_batches=16)
    nxt = next_safer(kept_split, kept_split.setting("bf16-mixed", 16, 0))
    assert nxt is not None and nxt.micro_batch == 16 and nxt.checkpointed_blocks > 0
    both = xl2(accumulate_grad_batches=16, activation_checkpointing="none")
    assert next_safer(both, both.setting("bf16-mixed", 16, "none")) is None


def test_speed_up_takes_the_fastest_faster_setting_the_measured_headroom_allows():
    p = xl2()
    slow = p.setting("bf16-mixed", 8, 0)  # 8 x 32 accumulation: slower than 16 x 16
    fast = next_faster(p, slow, capacity=p.budget_bytes, measured=p.peak(slow))
    assert fast is not None and p.step_time(fast) < p.step_time(slow) and p.fits(fast)
    assert fast == decide(p).chosen  # the measurement agrees with the planner: the planner's choice
    # a device that measures 30% above the prediction leaves less room: no faster setting fits it
    assert next_faster(p, decide(p).chosen, capacity=p.budget_bytes, measured=int(1.3 * p.peak(slow))) is None


def test_cpu_problems_plan_the_cpu_allocator_in_fp32():
    tiny = dict(latent_size=8, depth=2, hidden_size=32, num_heads=4, patch_size=2, in_channels=1, num_classes=10)
    p = FitProblem(tiny, 32, device="cpu", budget_bytes=int(0.004 * GiB), budget_source="--auto_fit.memory_gib")
    d = decide(p)
    assert {s.precision for s in d.ranking} == {"32-true"}
    s = d.chosen
    assert (
        p.peak(s) == plan_memory("custom", micro_batch=s.micro_batch, precision="32-true", device="cpu", **tiny).total
    )
    assert "relative" in d.table() and "0.00 GiB" not in d.table()  # MiB for small budgets


def test_settings_round_trip_and_configs_parse():
    s = Setting("bf16-mixed", 16, 16, "first:4", 4)
    assert Setting.from_dict(s.to_dict()) == s
    assert AutoFitConfig.of(None) is None and AutoFitConfig.of(False) is None
    assert AutoFitConfig.of(True) == AutoFitConfig()
    config = AutoFitConfig.of({"memory_gib": 6})
    assert config is not None and config.enabled and config.recovery and config.memory_gib == 6
    only_recovery = AutoFitConfig.of({"enabled": False, "oom_recovery": True})
    assert only_recovery is not None and not only_recovery.enabled and only_recovery.recovery
    assert AutoFitConfig.of({"enabled": False}) is None
    with pytest.raises(ValueError, match="memory_gib"):
        AutoFitConfig(memory_gib=-1)


def test_a_problem_is_the_planners_options_and_carries_their_levers():
    p = xl2(precision="32-true", accumulate_grad_batches=4)
    o = p.options()  # what recommend searches: the pins set, the rest unset
    assert (o.model, o.depth, o.precision, o.accumulate_grad_batches, o.micro_batch) == (
        "custom",
        28,
        "32-true",
        4,
        None,
    )
    s = decide(p).chosen
    assert p.plan(s) == plan_memory(p.options(s), memory_gib=23.6)
    assert p.options(s).micro_batch == s.micro_batch == 64
    # a PlanOptions field in the shape reaches every prediction
    wider = dataclasses.replace(p, shape={**XL2, "mlp_ratio": 5.0}, _cache={})
    assert wider.peak(s) > p.peak(s) and wider.options(s).mlp_ratio == 5.0
