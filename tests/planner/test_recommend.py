"""The planner's recommendations (``--fit``): the fewest checkpointed blocks that fit, exact
global batches, time and cost."""

import pytest

from dit_lightning.planner import plan_memory, recommend


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
