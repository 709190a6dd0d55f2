"""The planner's communication model: bytes per step from the network's tensors, the interconnect
table, what the backward pass hides, and how plan / --fit show it."""

from __future__ import annotations

import pytest

from dit_lightning.planner import PlanOptions, recommend
from dit_lightning.planner.communication import gradient_shapes, plan_communication, powersgd_numel
from dit_lightning.planner.hardware import DEFAULT_INTERCONNECT, GPUS, INTERCONNECTS, gpu_spec
from dit_lightning.planner.recommend import step_time

XL = PlanOptions("DiT-XL/2", precision="bf16-mixed", micro_batch=32)
P = 674_834_720  # DiT-XL/2's trainable parameters (pos_embed is fixed)


def test_the_gradient_tensors_are_the_trainable_parameters():
    for name in ("DiT-XL/2", "DiT-S/8", "DiT-B/4"):
        o = PlanOptions(name)
        shapes = gradient_shapes(o.shape)
        total = sum(_n(g) for g in shapes["root"]) + o.shape.depth * sum(_n(g) for g in shapes["block"])
        assert total == o.param_counts()["trainable"]
    assert (
        sum(_n(g) for g in gradient_shapes(XL.shape, qk_norm=True)["block"])
        == XL.replace(qk_norm=True).param_counts()["block"]
    )


def _n(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def test_ddp_all_reduces_the_gradients_once_per_optimiser_step_in_the_reduction_format():
    ddp = XL.replace(world_size=8)
    fp32 = plan_communication(ddp, "h100-80gb")
    assert fp32.payload == {"all_reduce": 4 * P}
    assert fp32.bytes_sent == pytest.approx(2 * 7 / 8 * 4 * P)
    assert plan_communication(ddp.replace(communication="bf16"), "h100-80gb").payload["all_reduce"] == 2 * P
    # accumulation: DDP sends the same bytes per optimiser step (no_sync), FSDP per micro-batch
    assert plan_communication(ddp.replace(accumulate_grad_batches=4), "h100-80gb").bytes_sent == fp32.bytes_sent
    fsdp = ddp.replace(strategy="fsdp", sharding="FULL_SHARD")
    assert plan_communication(fsdp.replace(accumulate_grad_batches=4), "h100-80gb").bytes_sent == pytest.approx(
        4 * plan_communication(fsdp, "h100-80gb").bytes_sent
    )


def test_powersgd_sends_rank_r_factors_of_the_matrices_and_every_vector():
    assert powersgd_numel((3456, 1152), 4) == (3456 + 1152) * 4  # qkv
    assert powersgd_numel((3456,), 4) == 3456  # a bias: not compressed
    assert powersgd_numel((1152, 4, 2, 2), 1) == 1152 + 16  # the patch embedding, viewed as (D, C p p)
    assert powersgd_numel((16, 8), 4) == 16 * 8  # (16 + 8) x 4 is not 2x smaller: sent as is
    r4 = plan_communication(XL.replace(world_size=2, communication="powersgd"), "rtx4090").payload["all_reduce"]
    r1 = plan_communication(XL.replace(world_size=2, communication="powersgd:1"), "rtx4090").payload["all_reduce"]
    # ~190x less than fp32 at rank 4 (14 MB for XL/2), ~540x at rank 1: the vectors keep rank 4 under 3x rank 1
    assert 4 * P / r4 > 150 and 4 * P / r1 > 500 and r1 < r4 < 3 * r1


def test_fsdp_gathers_in_the_compute_dtype_and_reduce_scatters_in_the_reduce_dtype():
    fsdp = XL.replace(world_size=8, strategy="fsdp")
    full = plan_communication(fsdp.replace(sharding="FULL_SHARD"), "a100-80gb").payload
    zero2 = plan_communication(fsdp.replace(sharding="SHARD_GRAD_OP"), "a100-80gb").payload
    total = XL.param_counts()["total"]
    assert zero2["all_gather"] == 2 * total  # bf16 weights, once (the fixed pos_embed included)
    block = XL.param_counts()["block"] * 28
    assert full["all_gather"] == 2 * (total + block)  # the blocks again in the backward
    assert full["reduce_scatter"] == 4 * P  # reduce_dtype float32 ("none")
    assert plan_communication(fsdp.replace(communication="bf16"), "a100-80gb").payload["reduce_scatter"] == 2 * P
    with pytest.raises(ValueError, match="FSDP has no comm hook"):
        plan_communication(fsdp.replace(communication="powersgd"), "a100-80gb")


def test_hsdp_all_reduces_a_shard_across_nodes_over_the_network():
    hsdp = XL.replace(world_size=32, strategy="fsdp", sharding="FULL_SHARD", shard_group=8, num_nodes=4)
    c = plan_communication(hsdp, "a100-80gb")
    assert c.payload["all_reduce"] == 4 * P / 8
    assert c.network_bytes_sent == pytest.approx(2 * 3 / 4 * 4 * P / 8)
    assert any("ib-hdr" in n for n in c.notes)
    ddp = plan_communication(XL.replace(world_size=32, num_nodes=4), "a100-80gb")
    assert ddp.link == "ib-hdr"  # DDP's ring crosses the nodes: the slower link sets the pace


def test_every_gpu_has_a_default_link_and_every_link_a_source():
    assert set(DEFAULT_INTERCONNECT) == set(GPUS)
    assert DEFAULT_INTERCONNECT["rtx4090"] == "pcie4" and DEFAULT_INTERCONNECT["h100-80gb"] == "nvlink4"
    for link in INTERCONNECTS.values():
        assert 0 < link.effective_gbs <= link.nominal_gbs and link.source
    assert INTERCONNECTS["pcie4"].effective_gbs == INTERCONNECTS["pcie4-p2p"].effective_gbs / 2
    with pytest.raises(ValueError, match="unknown interconnect"):
        plan_communication(XL.replace(world_size=2, interconnect="pcie6"), "rtx4090")


def test_pcie_without_p2p_exposes_communication_that_nvlink_hides():
    pcie = step_time(XL.replace(world_size=2, micro_batch=16, accumulate_grad_batches=8), gpu_spec("rtx4090"), 256)
    nvlink = step_time(XL.replace(world_size=8), gpu_spec("h100-80gb"), 256)
    assert pcie.communication.exposed_s > 0.05 * pcie.step_s
    assert nvlink.communication.exposed_s < 0.05 * nvlink.step_s
    # the backward hides what it can: exposed = comm - backward window + the last bucket
    c = pcie.communication
    assert c.exposed_s == pytest.approx(max(0, c.seconds - pcie.micro_s * (2 / 3)) + c.seconds * 25 * 2**20 / (4 * P))
    # compression shrinks what is left
    bf16 = step_time(
        XL.replace(world_size=2, micro_batch=16, accumulate_grad_batches=8, communication="bf16"),
        gpu_spec("rtx4090"),
        256,
    )
    assert bf16.communication.seconds == pytest.approx(c.seconds / 2) and bf16.step_s < pcie.step_s


def test_fit_prices_the_compression_alternatives_and_keeps_the_runs_own():
    rec = recommend("DiT-XL/2", gpu="rtx4090", num_gpus=2)
    assert rec.communication is not None and rec.communication.communication == "none"
    assert set(rec.communication_options) == {"none", "bf16", "powersgd"}
    assert rec.communication_options["none"][0] == pytest.approx(rec.step_time_s)
    assert rec.communication_options["bf16"][0] < rec.step_time_s
    pinned = recommend("DiT-XL/2", gpu="rtx4090", num_gpus=2, communication="powersgd")
    assert pinned.strategy == "ddp" and "--trainer.strategy.communication powersgd" in pinned.lightning_args


def test_plan_prints_the_communication_time_and_its_share(capsys):
    from dit_lightning.cli import main

    main(["plan", "--model", "DiT-XL/2", "--gpu", "rtx4090", "--world_size", "2", "--micro_batch", "16"])
    out = capsys.readouterr().out
    assert "communication (ddp, none): 2.70 GB sent per GPU per step" in out and "of the" in out
