"""The planner's memory model: predictions against the measured peak of real CPU training steps,
the saved-tensor terms per block, static state, mixed precision, budgets and sharding."""

import contextlib

import pytest
import torch
import yaml

from dit_lightning.models import DiTShape, build_dit, dit_params, shape_of
from dit_lightning.planner import (
    GiB,
    PlanOptions,
    block_activation_terms,
    param_counts,
    plan_memory,
    state_per_device,
)
from dit_lightning.planner.measure import TrainingStep, cpu_allocator_peak, measure_cpu_step_peak
from dit_lightning.planner.memory import PLAN_DEFAULTS, qk_norm_terms

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
    batch_ = {
        "x": torch.randn(batch, 4, latent, latent),
        "y": torch.randint(0, kw["num_classes"], (batch,)),
        "index": torch.arange(batch),
    }
    measured = measure_cpu_step_peak(TrainingStep(module, batch_, precision))
    planned = plan_memory(
        "custom",
        latent_size=latent,
        micro_batch=batch,
        precision=precision,
        activation_checkpointing=ckpt,
        attention=attention,
        device="cpu",
        **kw,
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
    assert planned.peak_allocated == pytest.approx(measured, rel=0.15), (
        planned.peak_phase,
        measured,
        planned.peak_allocated,
    )


def test_block_activation_terms_are_the_tensors_autograd_saves():
    """The per-block list is the saved-tensor set of DiTBlock.forward, byte for byte (+-1%)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = build_dit("custom", input_size=16, patch_size=2, hidden_size=64, depth=1, num_heads=4, num_classes=10)
    block, shape, n = (
        model.blocks[0],
        shape_of("custom", input_size=16, patch_size=2, hidden_size=64, depth=1, num_heads=4, num_classes=10),
        2,
    )
    param_ptrs = {p.untyped_storage().data_ptr() for p in block.parameters()}
    for attention, amp in [("flash", None), ("math", None), ("flash", torch.bfloat16)]:
        x = torch.randn(n, shape.tokens, 64, requires_grad=True)
        c = torch.randn(n, 64, requires_grad=True)
        saved: dict[int, int] = {}
        weights16 = 0

        def pack(t, saved=saved):
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


def test_state_per_device_shards_as_documented():
    """The planner's static state per device (docs/distributed.md's table) for each layout."""
    n = dit_params(shape_of("DiT-XL/2"))
    ddp = state_per_device("DiT-XL/2", 8, "ddp")
    full = state_per_device("DiT-XL/2", 8, "fsdp", "FULL_SHARD")
    zero2 = state_per_device("DiT-XL/2", 8, "fsdp", "SHARD_GRAD_OP")
    hybrid = state_per_device("DiT-XL/2", 32, "fsdp", "FULL_SHARD", shard_group=8)
    assert abs(ddp["params"] - 4 * n / 1024**3) < 1e-9 and abs(ddp["total"] - 20 * n / 1024**3) < 0.01
    assert ddp["gathered"] == 0
    state = ("params", "grads", "optimizer", "ema")
    assert abs(sum(full[k] for k in state) - sum(ddp[k] for k in state) / 8) < 0.01
    # SHARD_GRAD_OP shards the state like FULL_SHARD but keeps the whole model gathered (bf16)
    assert all(zero2[k] == full[k] for k in state) and abs(zero2["gathered"] - 2 * n / 1024**3) < 1e-9
    assert full["gathered"] < zero2["gathered"] / 5
    assert hybrid == full
    # the planner's peak uses exactly this state
    plan = plan_memory("DiT-XL/2", world_size=8, strategy="fsdp", sharding="FULL_SHARD", micro_batch=1)
    assert plan.optimizer_states / 1024**3 == pytest.approx(full["optimizer"])
    assert plan.ema_weights / 1024**3 == pytest.approx(full["ema"])


def test_plan_options_are_the_keyword_call_and_plan_the_documented_defaults():
    """``plan_memory(PlanOptions(...))`` and the keyword call are one plan; unset settings are PLAN_DEFAULTS."""
    o = PlanOptions(
        "DiT-B/2", micro_batch=16, precision="16-mixed", activation_checkpointing="half", strategy="fsdp", world_size=4
    )
    keywords = dict(
        micro_batch=16, precision="16-mixed", activation_checkpointing="half", strategy="fsdp", world_size=4
    )
    assert plan_memory(o, gpu="rtx4090") == plan_memory("DiT-B/2", gpu="rtx4090", **keywords)
    assert plan_memory(o, ema=False) == plan_memory(o.replace(ema=False)) != plan_memory(o)
    assert PlanOptions().planned() == PlanOptions(**PLAN_DEFAULTS)
    default = plan_memory(PlanOptions())
    assert (default.model, default.micro_batch, default.precision, default.checkpointed_blocks) == (
        "DiT-XL/2",
        32,
        "bf16-mixed",
        0,
    )
    assert (default.strategy, default.accumulate_grad_batches) == ("single device", 1)
    with pytest.raises(TypeError, match="micro_batchh"):
        plan_memory("DiT-XL/2", micro_batchh=8)  # a misspelt lever is an error, not ignored
    with pytest.raises(ValueError, match="precision must be 32-true, 16-mixed, bf16-mixed"):
        plan_memory(precision="bf16")


def _saved_block_bytes(qk_norm: bool, attention: str, amp, device: str = "cpu", n: int = 2, **options) -> int:
    """Bytes one DiTBlock (16x16 latents, patch 2, width 64, 4 heads) saves for its backward, its
    parameters and their autocast copies excluded (and rope's tables, the network's buffers)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    net = build_dit(
        "custom",
        input_size=16,
        patch_size=2,
        hidden_size=64,
        depth=1,
        num_heads=4,
        num_classes=10,
        qk_norm=qk_norm,
        **options,
    ).to(device)
    block = net.blocks[0]
    rope = net.feat_rope.tables() if net.feat_rope is not None else None
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    params |= {r.untyped_storage().data_ptr() for r in rope or ()}
    x = torch.randn(n, 64, 64, device=device, requires_grad=True)
    c = torch.randn(n, 64, device=device, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    kernel = sdpa_kernel(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext()
    cast = torch.autocast(device, dtype=amp) if amp else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), kernel, cast:
        block(x, c, rope)
    # autocast's 16-bit copies of the matmul weights (the QK-norm's LayerNorm weights are not cast)
    copies = 2 * sum(p.numel() for name, p in block.named_parameters() if p.dim() == 2) if amp else 0
    return sum(saved.values()) - c.numel() * 4 - copies


QK_CASES = [("flash", None), ("math", None), ("flash", torch.bfloat16), ("math", torch.bfloat16)]


@pytest.mark.parametrize("attention, amp", QK_CASES, ids=["flash", "math", "flash-bf16", "math-bf16"])
def test_qk_norm_adds_the_tensors_autograd_saves(attention, amp):
    """The QK-norm's terms are what its LayerNorms add to a block's saved set, byte for byte (CPU)."""
    shape = shape_of("custom", input_size=16, patch_size=2, hidden_size=64, depth=1, num_heads=4, num_classes=10)
    measured = _saved_block_bytes(True, attention, amp) - _saved_block_bytes(False, attention, amp)
    assert sum(qk_norm_terms(shape, 2, amp is not None, attention, "cpu").values()) == measured
    assert param_counts(shape, qk_norm=True)["block"] - param_counts(shape)["block"] == 4 * 16  # 2 LayerNorms(16)


# What the QK-norm added to that block's saved set on an NVIDIA H200 (torch 2.11, SDPA's default kernel:
# flash for 16 bits, memory-efficient for fp32), in bytes: CUDA autocast runs LayerNorm in fp32.
QK_NORM_ON_H200 = {("flash", None): 73728, ("math", None): 106496, ("flash", "bf16"): 122880, ("math", "bf16"): 73728}


def test_qk_norm_terms_on_cuda_are_what_an_h200_saved():
    shape = shape_of("custom", input_size=16, patch_size=2, hidden_size=64, depth=1, num_heads=4, num_classes=10)
    for (attention, amp), measured in QK_NORM_ON_H200.items():
        assert sum(qk_norm_terms(shape, 2, amp is not None, attention, "cuda").values()) == measured, attention


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attention, amp", QK_CASES, ids=["flash", "math", "flash-bf16", "math-bf16"])
def test_qk_norm_adds_the_tensors_autograd_saves_on_cuda(attention, amp):
    shape = shape_of("custom", input_size=16, patch_size=2, hidden_size=64, depth=1, num_heads=4, num_classes=10)
    measured = _saved_block_bytes(True, attention, amp, "cuda") - _saved_block_bytes(False, attention, amp, "cuda")
    assert sum(qk_norm_terms(shape, 2, amp is not None, attention, "cuda").values()) == measured


@pytest.mark.parametrize(
    "case",
    [dict(batch=8), dict(batch=4, depth=2, hidden_size=64, num_heads=2, precision="bf16-mixed")],
    ids=["fp32", "bf16-mixed"],
)
def test_qk_norm_prediction_matches_the_measured_peak_of_a_real_step(case):
    """The lever end to end: a DiTModule with qk_norm, one real CPU step, against the planner."""
    measured, planned = _measured_and_planned(qk_norm=True, **case)
    assert planned.peak_allocated == pytest.approx(measured, rel=0.05), (planned.peak_phase, measured)
    assert any("QK-norm" in a for a in planned.assumptions)
    measured_without, planned_without = _measured_and_planned(**case)
    # what the lever adds, predicted within 2% of what the step measured
    added = planned.peak_allocated - planned_without.peak_allocated
    assert added == pytest.approx(measured - measured_without, rel=0.02)


# LightningDiT's block options (one at a time, with RMSNorm QK-norm, and LightningDiT's published block)
LIGHTNING_OPTIONS = [
    {"norm": "rmsnorm"},
    {"mlp": "swiglu"},
    {"pos_embed": "rope"},
    {"wo_shift": True},
    {"norm": "rmsnorm", "qk_norm": True},
    {"norm": "rmsnorm", "mlp": "swiglu", "pos_embed": "rope"},
]


@pytest.mark.parametrize("attention, amp", QK_CASES, ids=["flash", "math", "flash-bf16", "math-bf16"])
def test_lightningdit_block_terms_are_the_tensors_autograd_saves(attention, amp):
    """Each option's block terms are what its block saves for backward, byte for byte (CPU)."""
    for options in LIGHTNING_OPTIONS:
        options = dict(options)
        qk = options.pop("qk_norm", False)
        shape = shape_of(
            "custom", input_size=16, patch_size=2, hidden_size=64, depth=1, num_heads=4, num_classes=10, **options
        )
        planned = sum(block_activation_terms(shape, 2, amp is not None, attention, "cpu", qk).values())
        assert planned == _saved_block_bytes(qk, attention, amp, **options), options


@pytest.mark.parametrize("options", LIGHTNING_OPTIONS, ids=lambda o: "-".join(map(str, o.values())))
def test_lightningdit_parameter_counts_are_the_built_networks(options):
    from dit_lightning.planner.communication import gradient_shapes

    options = dict(options)
    qk = options.pop("qk_norm", False)
    sizes = dict(depth=2, hidden_size=64, num_heads=4, patch_size=2, num_classes=10)
    net = build_dit("custom", input_size=16, qk_norm=qk, **sizes, **options)
    counts = PlanOptions(model="custom", latent_size=16, qk_norm=qk, **sizes, **options).param_counts()
    assert counts["total"] == sum(p.numel() for p in net.parameters())
    assert counts["block"] == sum(p.numel() for p in net.blocks[0].parameters())
    assert counts["block_matmul"] == sum(p.numel() for n, p in net.blocks[0].named_parameters() if "norm" not in n)
    shapes = gradient_shapes(DiTShape.of(net), qk)
    assert sorted(shapes["block"]) == sorted(tuple(p.shape) for p in net.blocks[0].parameters())
    if not qk:  # dit_params leaves a QK-norm out
        assert dit_params(DiTShape.of(net)) == counts["total"]


def test_lightningdit_macs_are_what_the_flop_counter_counts():
    """The MAC formula against PyTorch's counter (which does not count CPU SDPA: added back)."""
    from torch.utils.flop_counter import FlopCounterMode

    from dit_lightning.models import dit_macs

    for options in (
        {},
        {"mlp": "swiglu"},
        {"wo_shift": True},
        {"norm": "rmsnorm", "mlp": "swiglu", "pos_embed": "rope"},
    ):
        net = build_dit(
            "custom", input_size=16, patch_size=2, hidden_size=64, depth=2, num_heads=4, num_classes=10, **options
        )
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            net.eval()(torch.randn(1, 4, 16, 16), torch.tensor([3]), torch.tensor([1]))
        s = DiTShape.of(net)
        attention = s.depth * 2 * s.tokens * s.tokens * s.qkv_dim
        assert dit_macs(s) == counter.get_total_flops() // 2 + attention, options
    assert shape_of("LightningDiT-XL/1").mlp_hidden == 3072 and shape_of("LightningDiT-XL/1").norm == "rmsnorm"


@pytest.mark.parametrize(
    "precision",
    ["32-true", "bf16-mixed"],
)
def test_lightningdit_block_prediction_matches_the_measured_peak_of_a_real_step(precision):
    """LightningDiT's published block (RMSNorm, SwiGLU, rope) end to end: one real CPU step of a
    DiTModule against the planner."""
    case = dict(batch=4, depth=2, hidden_size=64, num_heads=2, precision=precision)
    options = dict(norm="rmsnorm", mlp="swiglu", pos_embed="rope")
    measured, planned = _measured_and_planned(**options, **case)
    assert planned.peak_allocated == pytest.approx(measured, rel=0.05), (planned.peak_phase, measured)
    assert any("LightningDiT's block" in a for a in planned.assumptions)
    with pytest.raises(ValueError, match="mlp='swish' is not a block option"):
        PlanOptions(mlp="swish").param_counts()


def test_regs_class_token_is_counted_as_the_built_network_has_it(tmp_path):
    """REG's class token (class_token_dim): parameters, gradient shapes and MACs exact against the built
    network, a block's saved tensors over its 1 + T tokens byte for byte, and ``plan --run`` reads it."""
    from torch.utils.flop_counter import FlopCounterMode

    from dit_lightning.checkpoints import save_dit
    from dit_lightning.models import dit_macs
    from dit_lightning.planner.communication import gradient_shapes
    from dit_lightning.planner.runs import read_run

    sizes = dict(depth=2, hidden_size=64, num_heads=4, patch_size=2, num_classes=10)
    net = build_dit("custom", input_size=16, class_token_dim=24, **sizes)
    s = DiTShape.of(net)
    assert (s.class_token_dim, s.tokens, s.sequence) == (24, 64, 65)
    counts = PlanOptions(model="custom", latent_size=16, class_token_dim=24, **sizes).param_counts()
    assert counts["total"] == sum(p.numel() for p in net.parameters()) == dit_params(s)
    outside = {n: p for n, p in net.named_parameters() if not n.startswith("blocks.") and n != "pos_embed"}
    assert counts["head"] + counts["tail"] == sum(p.numel() for p in outside.values())
    cast = [p for name, p in outside.items() if "embedding_table" not in name and ".norm." not in name]
    assert counts["matmul_nonblock"] == sum(p.numel() for p in cast)  # what autocast casts: not the norm, the table
    assert sorted(gradient_shapes(s)["root"]) == sorted(tuple(p.shape) for p in outside.values())
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net.eval()(torch.randn(1, 4, 16, 16), torch.tensor([3]), torch.tensor([1]), class_token=torch.randn(1, 24))
    attention = s.depth * 2 * s.sequence * s.sequence * s.qkv_dim  # CPU SDPA is not counted: added back
    assert dit_macs(s) == counter.get_total_flops() // 2 + attention
    plain = DiTShape(**{**vars(s), "class_token_dim": None})
    assert dit_macs(s) > dit_macs(plain) + 2 * 64 * 24  # the projections and one more token in every block

    # a block over 1 + T tokens saves what the formula says (flash, fp32)
    block, n = net.blocks[0], 2
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x, c = torch.randn(n, 65, 64, requires_grad=True), torch.randn(n, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block.train()(x, c)
    assert sum(block_activation_terms(s, n, False, "flash", "cpu").values()) == sum(saved.values()) - c.numel() * 4

    # plan --run: a REG run's config (the encoder's feature width), a checkpoint (the weights' width)
    model = dict(model="custom", latent_shape=[4, 16, 16], **sizes)
    model["repa"] = {"encoder": "enc.pt", "class_token_weight": 0.03, "feature_dim": 24, "projector_dim": 16}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": model, "trainer": {"devices": 1}, "data": {}}))
    options = read_run(str(tmp_path / "config.yaml")).options
    assert options["class_token_dim"] == 24 and PlanOptions(**options).param_counts()["total"] == counts["total"]
    save_dit(net, tmp_path / "reg.pt")
    assert read_run(str(tmp_path / "reg.pt")).options["class_token_dim"] == 24
