"""The planner's recommendations (``--fit``): the fewest checkpointed blocks that fit, exact
global batches, time and cost."""

import pytest

from dit_lightning.planner import PlanOptions, plan_memory, recommend


def test_fit_picks_the_minimum_number_of_checkpointed_blocks_and_is_monotonic():
    ks = []
    for gib in (17, 18, 20, 22, 24, 28, 32, 48):
        rec = recommend(
            "DiT-XL/2", gpu="a100-80gb", memory_gib=gib, micro_batch=32, precision="bf16-mixed", global_batch=256
        )
        assert rec.feasible
        k = rec.checkpointed_blocks
        ks.append(k)
        kw = dict(
            micro_batch=32,
            precision="bf16-mixed",
            memory_gib=gib,
            accumulate_grad_batches=8,
            ddp_gradient_as_bucket_view=True,
        )
        assert plan_memory("DiT-XL/2", activation_checkpointing=k, **kw).fits
        if k > 0:  # one block fewer does not fit: the minimum
            assert not plan_memory("DiT-XL/2", activation_checkpointing=k - 1, **kw).fits
    assert ks == sorted(ks, reverse=True)  # more memory, fewer recomputed blocks
    assert ks[0] > 0 and ks[-1] == 0 and 0 < ks[2] < 28  # selective, not all-or-nothing


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 8])
def test_fit_divides_the_global_batch_exactly(gpus):
    global_batch = 240 if gpus == 3 else 256
    rec = recommend("DiT-XL/2", gpu="rtx4090", num_gpus=gpus, global_batch=global_batch)
    assert rec.micro_batch * gpus * rec.accumulate_grad_batches == global_batch
    for c in rec.alternatives:
        assert c.micro_batch * gpus * c.accumulate_grad_batches == global_batch


def test_fit_rejects_an_indivisible_global_batch():
    with pytest.raises(ValueError, match="divisible"):
        recommend("DiT-XL/2", gpu="a100-80gb", num_gpus=3, global_batch=256)
    with pytest.raises(ValueError, match="does not divide"):
        recommend("DiT-XL/2", gpu="a100-80gb", num_gpus=2, global_batch=256, micro_batch=48)


def test_fit_estimates_time_and_cost():
    rec = recommend("DiT-XL/2", gpu="a100-80gb", num_gpus=4, steps=1000, price_per_gpu_hour=2.0)
    assert rec.feasible and rec.memory.fits
    assert rec.cost == pytest.approx(rec.hours * 4 * 2.0)
    assert rec.hours == pytest.approx(1000 * rec.step_time_s / 3600)
    # the upper bound at 100% utilisation of 4 A100s (useful FLOPs only)
    assert rec.images_per_s < 4 * 312e12 / 712e9
    slow = recommend("DiT-XL/2", gpu="a100-80gb", num_gpus=4, mfu=0.1, precision="bf16-mixed")
    assert slow.images_per_s < rec.images_per_s


def test_fit_takes_the_plan_options_and_pins_what_they_set():
    """recommend(PlanOptions) is the keyword call; set settings are pinned, an accumulation pins the micro-batch."""
    options = PlanOptions("DiT-B/2", precision="16-mixed", optimizer="sgd", ema=False, world_size=2)
    rec = recommend(options, gpu="rtx4090", global_batch=128)
    assert rec == recommend("DiT-B/2", gpu="rtx4090", global_batch=128, num_gpus=2, precision="16-mixed",
                            optimizer="sgd", ema=False)  # fmt: skip
    assert rec.precision == "16-mixed" and not rec.memory.ema and rec.memory.optimizer == "sgd"
    pinned = recommend(options.replace(accumulate_grad_batches=4), gpu="rtx4090", global_batch=128)
    assert (pinned.micro_batch, pinned.accumulate_grad_batches) == (16, 4)
    assert {(c.micro_batch, c.accumulate_grad_batches) for c in pinned.alternatives} == {(16, 4)}
    with pytest.raises(ValueError, match="do not divide"):
        recommend(options.replace(accumulate_grad_batches=5), gpu="rtx4090", global_batch=128)
    # a lever of the options reaches every candidate's memory plan
    fixed = options.replace(micro_batch=64, activation_checkpointing="none")
    with_ema = recommend(fixed.replace(ema=True), gpu="rtx4090", global_batch=128)
    assert with_ema.memory.total > recommend(fixed, gpu="rtx4090", global_batch=128).memory.total
