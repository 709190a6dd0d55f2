"""The resource planner: the memory model against real CPU training steps, and the --fit logic."""

import contextlib
import io
import json

import pytest
import torch

from dit_lightning.models import build_dit, dit_params, shape_of
from dit_lightning.commands.plan import plan
from dit_lightning.planner import GiB, block_activation_terms, param_counts, plan_memory, recommend
from dit_lightning.planner.measure import TrainingStep, cpu_allocator_peak, measure_cpu_step_peak

SMALL = dict(depth=3, hidden_size=96, num_heads=4, patch_size=2, num_classes=10)


def _measured_and_planned(latent=16, batch=8, ckpt="none", attention="auto", precision="32-true", **sizes):
    from dit_lightning.module import DiTModule

    kw = {**SMALL, **sizes}
    module = DiTModule(
        model="custom",
        latent_shape=(4, latent, latent),
        activation_checkpointing=None if ckpt == "none" else ckpt,
        attention_backend="math" if attention == "math" else "auto",
        **kw,
    )
    batch_ = {"x": torch.randn(batch, 4, latent, latent), "y": torch.randint(0, kw["num_classes"], (batch,)), "index": torch.arange(batch)}
    measured = measure_cpu_step_peak(TrainingStep(module, batch_, precision))
    planned = plan_memory(
        "custom", latent_size=latent, micro_batch=batch, precision=precision, activation_checkpointing=ckpt,
        attention=attention, device="cpu", **kw,
    )
    return measured, planned


@pytest.mark.parametrize(
    "case",
    [
        dict(batch=8),  # no checkpointing: the peak is the start of the backward pass
        dict(batch=16, ckpt="all"),  # every block recomputed: a different peak phase
        dict(batch=16, ckpt=2),  # selective checkpointing, other batch
        dict(latent=32, batch=4, hidden_size=64, attention="math"),  # T^2 attention matrix
        dict(batch=4, depth=2, hidden_size=64, num_heads=2, precision="bf16-mixed"),  # autocast
    ],
    ids=["fp32", "ckpt-all-b16", "ckpt-2-b16", "math-attention", "bf16-mixed"],
)
def test_prediction_matches_measured_peak_of_a_real_step(case):
    measured, planned = _measured_and_planned(**case)
    assert planned.peak_allocated == pytest.approx(measured, rel=0.15), (planned.peak_phase, measured, planned.peak_allocated)


def test_block_activation_terms_are_the_tensors_autograd_saves():
    """The per-block list is the saved-tensor set of DiTBlock.forward, byte for byte (+-1%)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = build_dit("custom", input_size=16, patch_size=2, hidden_size=64, depth=1, num_heads=4, num_classes=10)
    block, shape, n = model.blocks[0], shape_of("custom", input_size=16, patch_size=2, hidden_size=64, depth=1, num_heads=4, num_classes=10), 2
    param_ptrs = {p.untyped_storage().data_ptr() for p in block.parameters()}
    for attention, amp in [("flash", None), ("math", None), ("flash", torch.bfloat16)]:
        x = torch.randn(n, shape.tokens, 64, requires_grad=True)
        c = torch.randn(n, 64, requires_grad=True)
        saved: dict[int, int] = {}
        weights16 = 0

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in param_ptrs:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        kernel = sdpa_kernel(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext()
        cast = torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), kernel, cast:
            block(x, c)
        if amp:
            weights16 = 2 * sum(p.numel() for name, p in block.named_parameters() if name.endswith("weight"))
        measured = sum(saved.values()) - c.numel() * 4 - weights16  # c is shared by all blocks
        predicted = sum(block_activation_terms(shape, n, amp is not None, attention, "cpu").values())
        assert predicted == pytest.approx(measured, rel=0.01), (attention, amp)


def test_cpu_allocator_peak_sees_temporaries():
    def fn():
        a = torch.empty(1_000_000)  # 4 MB
        b = torch.empty(500_000)  # 2 MB, while a is alive
        del a, b
        return torch.empty(10)

    _, peak = cpu_allocator_peak(fn)
    assert peak == pytest.approx(6_000_000, rel=0.01)


def test_known_static_memory_of_dit_xl2():
    """fp32 AdamW + EMA: 4 (weights) + 4 (grads) + 8 (AdamW) + 4 (EMA) bytes per parameter."""
    p = plan_memory("DiT-XL/2", micro_batch=1, precision="32-true", optimizer="adamw", ema=True)
    counts = param_counts(shape_of("DiT-XL/2"))
    assert counts["total"] == dit_params(shape_of("DiT-XL/2")) == 675_129_632
    trainable = counts["total"] - 256 * 1152  # the fixed pos_embed has no gradient or state
    assert p.static == 4 * counts["total"] + 4 * trainable + 8 * trainable + 4 * counts["total"]
    assert p.static == pytest.approx(675_129_632 * 20, rel=1e-3)
    no_ema = plan_memory("DiT-XL/2", micro_batch=1, precision="32-true", ema=False)
    assert p.static - no_ema.static == 4 * counts["total"]
    sgd = plan_memory("DiT-XL/2", micro_batch=1, precision="32-true", optimizer="sgd", ema=False)
    assert sgd.optimizer_states == 4 * trainable


def test_mixed_precision_and_checkpointing_reduce_activations():
    fp32 = plan_memory("DiT-XL/2", micro_batch=32, precision="32-true")
    bf16 = plan_memory("DiT-XL/2", micro_batch=32, precision="bf16-mixed")
    ckpt = plan_memory("DiT-XL/2", micro_batch=32, precision="bf16-mixed", activation_checkpointing="all")
    assert bf16.activations < 0.65 * fp32.activations  # 16-bit matmul tensors, fp32 LayerNorm/residual
    assert ckpt.activations < 0.1 * bf16.activations
    assert fp32.parameters == bf16.parameters  # fp32 master weights under Lightning's mixed precision


def test_fits_follows_the_budget():
    small = plan_memory("DiT-XL/2", micro_batch=32, precision="bf16-mixed", gpu="rtx4090")
    assert small.budget == int(23.6 * GiB) and small.fits is False
    big = plan_memory("DiT-XL/2", micro_batch=32, precision="bf16-mixed", gpu="h200")
    assert big.fits is True
    for gib in (10, 20, 40, 80):
        p = plan_memory("DiT-XL/2", micro_batch=32, precision="bf16-mixed", memory_gib=gib)
        assert p.fits == (p.total <= gib * GiB)
    assert plan_memory("DiT-XL/2", micro_batch=32).fits is None  # no budget given


def test_fit_picks_the_minimum_number_of_checkpointed_blocks_and_is_monotonic():
    ks = []
    for gib in (17, 18, 20, 22, 24, 28, 32, 48):
        rec = recommend("DiT-XL/2", gpu="a100-80gb", memory_gib=gib, micro_batch=32, precision="bf16-mixed", global_batch=256)
        assert rec.feasible
        k = rec.checkpointed_blocks
        ks.append(k)
        kw = dict(micro_batch=32, precision="bf16-mixed", memory_gib=gib, accumulate_grad_batches=8, ddp_gradient_as_bucket_view=True)
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


def test_fsdp_shards_the_static_state_by_the_world_size():
    one = plan_memory("DiT-XL/2", micro_batch=8, world_size=1)
    for world in (2, 4, 8):
        full = plan_memory("DiT-XL/2", micro_batch=8, strategy="fsdp", sharding="FULL_SHARD", world_size=world)
        grad_op = plan_memory("DiT-XL/2", micro_batch=8, strategy="fsdp", sharding="SHARD_GRAD_OP", world_size=world)
        assert full.static == pytest.approx(one.static / world, rel=1e-3)
        assert grad_op.static == pytest.approx(one.static / world, rel=1e-3)
        assert full.peak_allocated < grad_op.peak_allocated < one.peak_allocated + 4 * GiB
    ddp = plan_memory("DiT-XL/2", micro_batch=8, world_size=8)
    assert ddp.static == one.static  # DDP replicates
    assert ddp.communication_buffers == 4 * param_counts(shape_of("DiT-XL/2"))["trainable"]  # bucket copy


def test_fit_estimates_time_and_cost():
    rec = recommend("DiT-XL/2", gpu="a100-80gb", num_gpus=4, steps=1000, price_per_gpu_hour=2.0)
    assert rec.feasible and rec.memory.fits
    assert rec.cost == pytest.approx(rec.hours * 4 * 2.0)
    assert rec.hours == pytest.approx(1000 * rec.step_time_s / 3600)
    # the upper bound at 100% utilisation of 4 A100s (useful FLOPs only)
    assert rec.images_per_s < 4 * 312e12 / 712e9
    slow = recommend("DiT-XL/2", gpu="a100-80gb", num_gpus=4, mfu=0.1, precision="bf16-mixed")
    assert slow.images_per_s < rec.images_per_s


def _run_plan(**kw) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan(**kw)
    return out.getvalue()


def test_json_output_parses():
    data = json.loads(_run_plan(model="DiT-XL/2", micro_batch=32, gpu="rtx4090", format="json"))
    assert data["fits"] is False and data["total"] > data["peak_allocated"] > data["static"]
    assert set(data["activations_per_block"]) >= {"qkv output (q, k, v views)", "fc1 output (GELU)"}
    fit = json.loads(_run_plan(model="DiT-XL/2", gpu="rtx4090", world_size=2, fit=True, format="json"))
    assert fit["micro_batch"] * 2 * fit["accumulate_grad_batches"] == 256
    assert fit["memory"]["fits"] is True


def test_table_output_renders():
    text = _run_plan(model="DiT-B/2", micro_batch=64, gpu="l40s", format="table")
    assert "activations" in text and "fits" in text
    text = _run_plan(model="DiT-XL/2", gpu="rtx4090", fit=True, price_per_gpu_hour=0.5)
    assert "candidates" in text and "dit-lightning fit" in text
