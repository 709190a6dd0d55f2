"""Distributed training: DDP, FSDP2 (ModelParallelStrategy), HSDP, sharded EMA, sharded
checkpoints and their consolidation, against the same training in one process.

The distributed runs happen in subprocesses (parity.py, next to this file): one 2-process job
(Lightning's own launcher, single node) and one 2-node x 1-process job (two torchrun agents),
started together by the module fixture ``runs`` while this process trains the 1-process
references. Every test that reads those runs stays in this file, so they happen once.
(``store``, the digits store, comes from tests/conftest.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities import GradClipAlgorithmType

from dit_lightning.checkpoints import infer_dit_config, is_sharded_checkpoint, load_dit_weights, read_checkpoint
from dit_lightning.commands.consolidate import consolidate
from dit_lightning.models import DiT
from tests.distributed import parity
from tests.helpers.ports import free_port, with_master_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "distributed" / "parity.py")
TIMEOUT = 420
ATOL = 1e-6  # float32 reduction-order differences after 4 steps are ~3e-8; the updates are ~4e-3


def _env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_PORT")
    }
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _wait(procs: dict[str, subprocess.Popen], logs: dict[str, Path], deadline: float) -> None:
    for name, proc in procs.items():
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise AssertionError(f"{name} timed out\n{logs[name].read_text()[-4000:]}") from None
        if rc != 0:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
            raise AssertionError(f"{name} exited with {rc}\n{logs[name].read_text()[-6000:]}")


def _state(module, samples: bool = False) -> dict[str, Any]:
    state: dict[str, Any] = {
        "model": {k: v.detach().cpu().clone() for k, v in module.model.state_dict().items()},
        "ema": {k: v.detach().cpu().clone() for k, v in module.ema.state_dict().items()},
    }
    if samples:
        state["samples"] = torch.cat(
            [module.sample([1, 2], num_steps=2, cfg_scale=c, seed=0) for c in (1.0, 2.0)]
        ).cpu()
    return state


@pytest.fixture(scope="module")
def runs(store, tmp_path_factory):
    base = tmp_path_factory.mktemp("dist")
    out, multi, ref_dir = base / "single_node", base / "multi_node", base / "reference"
    env = _env()
    logs = {"2 processes": base / "single_node.log", "node 0": base / "node0.log", "node 1": base / "node1.log"}
    procs = {
        "2 processes": subprocess.Popen(
            [sys.executable, SCRIPT, "--data", store, "--out", str(out), "--devices", "2"],
            cwd=base,
            env=with_master_port(env),
            stdout=open(logs["2 processes"], "w"),
            stderr=subprocess.STDOUT,
        )
    }
    port = free_port()
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node_rank",
            str(node),
            "--nproc_per_node",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            SCRIPT,
            "--data",
            store,
            "--out",
            str(multi),
            "--devices",
            "1",
            "--num-nodes",
            "2",
            "--runs",
            "ddp",
        ]
        procs[f"node {node}"] = subprocess.Popen(
            cmd, cwd=base, env=env, stdout=open(logs[f"node {node}"], "w"), stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + TIMEOUT
    try:
        # Meanwhile, the references: one process, micro-batch = the global batch of 16.
        ref_module, ref_trainer = parity.reference(store, ref_dir)
        clip_module, _ = parity.reference(store, ref_dir, "single_clip", clip=parity.CLIP)
        flow_module, _ = parity.reference(store, ref_dir, "single_flow_repa", recipe="flow-repa")
    except BaseException:
        for p in procs.values():
            p.kill()
        raise
    _wait(procs, logs, deadline)
    load = lambda d, name: torch.load(d / f"{name}.pt", weights_only=False)  # noqa: E731
    names = parity.CPU_RUNS.split(",")
    return {
        "out": out,
        "ref": {**_state(ref_module, samples=True), "logged": parity.logged(ref_dir, "single")},
        "ref_opt": ref_trainer.optimizers[0].state_dict(),
        "ref_clip": {**_state(clip_module), "logged": parity.logged(ref_dir, "single_clip")},
        "ref_flow_repa": {**_state(flow_module, samples=True), "logged": parity.logged(ref_dir, "single_flow_repa")},
        "init": _state(parity.build(store)[0]),
        "init_sgd": _state(parity.build(store, optimizer="sgd")[0]),
        "ref_dir": ref_dir,
        "store": store,
        **{name: load(out, name) for name in names},
        "multi_node_ddp": load(multi, "ddp"),
    }


def assert_same_weights(got, want, atol=ATOL):
    for part in ("model", "ema"):
        assert got[part].keys() == want[part].keys()
        for k in want[part]:
            torch.testing.assert_close(
                got[part][k], want[part][k], rtol=0, atol=atol, msg=lambda m, part=part, k=k: f"{part}.{k}: {m}"
            )


def max_diff(a, b, part="model"):
    return max((a[part][k] - b[part][k]).abs().max().item() for k in b[part])


def assert_same_logs(got, want, atol=1e-5, keys=("train/loss", "train/grad_norm", "val/loss")):
    for key in keys:
        assert got[key].keys() == want[key].keys(), key
        for step in want[key]:
            assert abs(got[key][step] - want[key][step]) <= atol * max(1.0, abs(want[key][step])), (
                key,
                step,
                got[key],
                want[key],
            )


# ---- DDP -------------------------------------------------------------------------------


def test_ddp_two_ranks_equal_one_process_with_the_doubled_micro_batch(runs):
    ddp = runs["ddp"]
    assert (
        ddp["world_size"] == 2 and ddp["micro_batch"] == parity.GLOBAL_BATCH // 2 and ddp["global_step"] == parity.STEPS
    )
    assert max_diff(runs["ref"], runs["init"]) > 1e-3  # training moved the weights...
    assert_same_weights(ddp, runs["ref"])  # ...exactly as one process did (model and EMA)
    assert_same_logs(ddp["logged"], runs["ref"]["logged"])  # loss reduced over ranks, global grad norm


def test_ddp_static_graph_is_switched_off_under_gradient_accumulation(runs):
    accum = runs["ddp_accum"]
    assert accum["static_graph"] is False and accum["micro_batch"] == parity.GLOBAL_BATCH // 4
    assert_same_weights(accum, runs["ref"])
    assert_same_logs(accum["logged"], runs["ref"]["logged"], keys=("train/grad_norm",))


def test_ddp_multi_node_two_nodes_of_one_process(runs):
    multi = runs["multi_node_ddp"]
    assert multi["world_size"] == 2
    assert_same_weights(multi, runs["ref"])


def test_every_trainable_parameter_gets_a_gradient(store):
    """What makes find_unused_parameters=False safe: one training step gives every trainable
    parameter a gradient; pos_embed and the EMA are frozen (requires_grad=False)."""
    module, dm = parity.build(store)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    module.diffusion_loss(module.model, batch, step_key=0, train=True)["loss"].backward()
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    assert frozen == {"model.pos_embed"} | {f"ema.{n}" for n, _ in module.ema.named_parameters()}
    missing = [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]
    assert trainable and not missing


def _digits_of_keyed_samples(store: str, ema: dict[str, torch.Tensor]) -> dict:
    """The digits metrics of samples 0..GENERATED-1 of these EMA weights, made in one process."""
    import numpy as np

    from dit_lightning.evaluation.digits import digits_metrics, uint8_digit_features
    from dit_lightning.images import to_uint8
    from dit_lightning.sampling import parse_labels

    module, _ = parity.build(store)
    assert module.ema is not None
    module.ema.load_state_dict(ema)
    labels = parse_labels("0-9", 10)(np.arange(parity.GENERATED))
    images = to_uint8(module.decode(module.sample(labels, indices=torch.arange(parity.GENERATED), seed=0)))
    return digits_metrics(uint8_digit_features(torch.from_numpy(images).permute(0, 3, 1, 2)), labels.numpy())


@pytest.mark.parametrize("run", ["ddp", "fsdp2"])
def test_test_generation_metrics_over_two_ranks_equal_one_process(runs, run):
    """`test` samples its share on each rank (under FSDP2 a collective: equal batch counts),
    gathers the features in sample order and measures them as one process would."""
    got = runs[run]["generation"]
    want = _digits_of_keyed_samples(runs["store"], runs[run]["ema"])
    assert got["details"]["num_samples"] == parity.GENERATED and got["details"]["digits"]["samples"] == parity.GENERATED
    assert got["details"]["digits"]["per_class"] == want["per_class"]
    assert got["logged"]["test/digits_accuracy"] == pytest.approx(want["accuracy"])
    assert got["logged"]["test/digits_fd_pixels"] == pytest.approx(want["frechet"]["fd_pixels"], rel=1e-4)
    assert got["logged"]["test/loss"] > 0


# ---- FSDP2 -----------------------------------------------------------------------------


def test_fsdp2_two_ranks_equal_one_process(runs):
    fsdp = runs["fsdp2"]
    assert fsdp["model_sharded"] and fsdp["ema_sharded"] and fsdp["placements"] == "(Shard(dim=0),)"
    # each rank holds about half of the model and half of the EMA
    assert fsdp["local_numel"] < 0.6 * fsdp["full_numel"] and fsdp["ema_local_numel"] < 0.6 * fsdp["full_numel"]
    assert_same_weights(fsdp, runs["ref"])  # the EMA too: sharded EMA == unsharded EMA
    # grad norm of DTensor gradients; validation of the sharded EMA
    assert_same_logs(fsdp["logged"], runs["ref"]["logged"])
    assert runs["ref"]["logged"]["val/loss"]
    # sampling (with and without classifier-free guidance) from the sharded EMA
    torch.testing.assert_close(fsdp["samples"], runs["ref"]["samples"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("run", ["ddp_flow_repa", "fsdp2_flow_repa"])
def test_flow_matching_with_repa_on_two_ranks_equals_one_process(runs, run):
    got, ref = runs[run], runs["ref_flow_repa"]
    assert ref["logged"]["train/loss"] and ref["logged"]["train/class_token"]  # REG's class token too
    assert_same_weights(got, ref)  # the projector's gradients are reduced (else the ranks' DiTs would drift)
    assert_same_logs(got["logged"], ref["logged"], keys=("train/loss", "train/grad_norm", "train/class_token"))
    # the class token sampled jointly from the (sharded) EMA, with and without guidance: one process's samples
    torch.testing.assert_close(got["samples"], ref["samples"], rtol=1e-5, atol=1e-5)
    if run.startswith("fsdp2"):
        assert got["model_sharded"]


def test_fsdp2_sharded_resume_equals_the_uninterrupted_run(runs):
    ckpt = runs["out"] / "fsdp2" / "ckpt" / f"epoch=0-step={parity.CKPT_STEP}.ckpt"
    assert is_sharded_checkpoint(ckpt) and len(list(ckpt.glob("*.distcp"))) == 2
    resumed, full = runs["fsdp2_resume"], runs["fsdp2"]
    assert resumed["global_step"] == parity.STEPS
    assert sorted(resumed["logged"]["train/loss"]) == list(range(parity.CKPT_STEP, parity.STEPS))
    assert_same_weights(resumed, full, atol=1e-7)
    assert_same_logs(
        resumed["logged"], {k: {s: v for s, v in d.items() if s >= parity.CKPT_STEP} for k, d in full["logged"].items()}
    )


def test_fsdp2_gradient_clipping_by_norm(runs):
    clip, ref = runs["fsdp2_clip"], runs["ref_clip"]
    assert all(n > parity.CLIP for n in ref["logged"]["train/grad_norm"].values())  # every step clips
    assert_same_weights(clip, ref)
    # SGD (lr 0.5) steps of gradient norm <= CLIP: the weights moved by at most 4 * 0.5 * CLIP
    # in L2 norm (unclipped, with gradient norms ~1.5, they would move ~30x more)
    moved = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(clip["model"][k] - runs["init_sgd"]["model"][k]) for k in clip["model"]])
    )
    assert 0.5 * parity.CLIP < moved <= parity.STEPS * 0.5 * parity.CLIP + 1e-6, moved


def test_fsdp2_mixed_precision_bf16_compute_fp32_reduce(runs):
    bf16 = runs["fsdp2_bf16"]
    assert bf16["param_dtype"] == "torch.float32"  # fp32 master shards; bf16 only when gathered
    diff = max_diff(bf16, runs["ref"])
    assert 1e-6 < diff < 5e-3, diff  # bf16 compute: close to, not equal to, the fp32 run
    losses = bf16["logged"]["train/loss"]
    assert len(losses) == parity.STEPS and all(
        abs(losses[s] - runs["ref"]["logged"]["train/loss"][s]) < 1e-2 for s in losses
    )


def test_hsdp_replicate_across_groups(runs):
    hsdp = runs["hsdp"]
    assert hsdp["placements"] == "(Replicate(), Shard(dim=0))" and "replicate=2, shard=1" in hsdp["mesh"]
    assert_same_weights(hsdp, runs["ref"])


# ---- consolidation ---------------------------------------------------------------------


def test_consolidated_checkpoint_loads_into_a_plain_dit(runs, tmp_path):
    ckpt = runs["out"] / "fsdp2" / "ckpt" / f"epoch=0-step={parity.STEPS}.ckpt"
    out = consolidate(str(ckpt), str(tmp_path / "dit.pt"))
    obj = torch.load(out, map_location="cpu", weights_only=True)
    assert set(obj) == {"model", "ema", "opt", "args"} and obj["args"]["global_step"] == parity.STEPS
    cfg = obj["args"]["model_config"]
    # the full architecture: shapes from the weights, the heads the run was configured with
    # (which the weights cannot show: infer_dit_config alone guesses hidden/64)
    assert cfg == {**infer_dit_config(runs["ref"]["model"]), "num_heads": obj["args"]["num_heads"]}
    assert cfg["num_heads"] != infer_dit_config(runs["ref"]["model"])["num_heads"]
    for part in ("model", "ema"):
        net = DiT(**cfg)
        net.load_state_dict(obj[part], strict=True)
        for k, v in net.state_dict().items():
            torch.testing.assert_close(v, runs["ref"][part][k], rtol=0, atol=ATOL)
    # the optimiser state is keyed by position, like torch.optim's and the reference scripts'
    net = DiT(**cfg)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    opt.load_state_dict(obj["opt"])
    ref_state = runs["ref_opt"]["state"]
    assert obj["opt"]["state"].keys() == ref_state.keys()
    for i in ref_state:
        torch.testing.assert_close(obj["opt"]["state"][i]["exp_avg"], ref_state[i]["exp_avg"], rtol=0, atol=1e-6)
    # readable by every loader of the project (sampling, init_from, export)
    back = read_checkpoint(out)
    load_dit_weights(DiT(**cfg), back.ema)
    raw = consolidate(str(ckpt), str(tmp_path / "raw.pt"), format="raw")
    raw_sd = torch.load(raw, weights_only=True)
    assert raw_sd.keys() == obj["ema"].keys() and all(torch.equal(raw_sd[k], obj["ema"][k]) for k in raw_sd)


def test_consolidate_a_single_file_checkpoint_is_an_export(runs, tmp_path):
    module, _ = parity.build(runs["store"])
    path = tmp_path / "single.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    out = torch.load(consolidate(str(path), str(tmp_path / "out.pt"), include_optimizer=False), weights_only=True)
    assert set(out) == {"model", "ema", "args"}


# ---- FSDP1 (GPU only in Lightning 2.6) -----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Lightning's FSDPStrategy (FSDP1) needs CUDA")
def test_fsdp1_on_gpus_matches_one_gpu_and_resumes(store, tmp_path):
    devices = min(2, torch.cuda.device_count())
    out = tmp_path / "fsdp1"
    log = tmp_path / "fsdp1.log"
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--data",
            store,
            "--out",
            str(out),
            "--devices",
            str(devices),
            "--runs",
            "fsdp1,fsdp1_resume,fsdp1_clip",
        ],
        cwd=tmp_path,
        env=_env(),
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, log.read_text()[-6000:]
    ref_module, _ = parity.reference(store, tmp_path / "ref", accelerator="gpu")
    clip_module, _ = parity.reference(store, tmp_path / "ref", "single_clip", clip=parity.CLIP, accelerator="gpu")
    load = lambda name: torch.load(out / f"{name}.pt", weights_only=False)  # noqa: E731
    fsdp1, resumed, clip = load("fsdp1"), load("fsdp1_resume"), load("fsdp1_clip")
    assert_same_weights(fsdp1, _state(ref_module), atol=1e-5)
    assert_same_weights(resumed, fsdp1, atol=1e-6)
    assert_same_weights(clip, _state(clip_module), atol=1e-5)
    if devices > 1:
        assert fsdp1["ema_local_numel"] < 0.6 * fsdp1["full_numel"]
    ckpt = out / "fsdp1" / "ckpt" / f"epoch=0-step={parity.STEPS}.ckpt"
    obj = torch.load(consolidate(str(ckpt), str(tmp_path / "dit.pt")), weights_only=True)
    net = DiT(**obj["args"]["model_config"])
    net.load_state_dict(obj["ema"], strict=True)
    for k, v in net.state_dict().items():
        torch.testing.assert_close(v, fsdp1["ema"][k], rtol=0, atol=1e-6)


def test_consolidate_is_a_command_line_tool(runs, tmp_path):
    """The signature works as ``dit-lightning consolidate --checkpoint DIR --output FILE``."""
    from jsonargparse import CLI

    ckpt = runs["out"] / "fsdp2" / "ckpt" / f"epoch=0-step={parity.STEPS}.ckpt"
    CLI(
        consolidate,
        args=["--checkpoint", str(ckpt), "--output", str(tmp_path / "x" / "dit.pt"), "--format", "raw"],
        as_positional=False,
    )
    assert torch.load(tmp_path / "x" / "dit.pt", weights_only=True).keys() == runs["ref"]["ema"].keys()


@pytest.mark.parametrize("algorithm", ["norm", GradClipAlgorithmType.NORM], ids=["string", "lightning-enum"])
def test_clipping_by_norm_under_fsdp1_uses_the_wrappers_global_norm(algorithm):
    """The Trainer passes its GradClipAlgorithmType (whose str() is 'GradClipAlgorithmType.NORM'):
    clipping must still take FSDP1's global-norm path, not Lightning's (which FSDPPrecision refuses).
    Found by `make gpu-check` on an H200; FSDP1 itself needs a GPU, so its root module is stood in."""
    from unittest import mock

    from dit_lightning.distributed import DiTFSDPStrategy
    from dit_lightning.distributed.ops import clip_gradients

    strategy = DiTFSDPStrategy()
    root = mock.Mock()
    pl_module = mock.Mock(spec=["_trainer", "clip_gradients"])
    pl_module._trainer = mock.Mock(strategy=strategy)
    with mock.patch.object(DiTFSDPStrategy, "model", new_callable=mock.PropertyMock, return_value=root):
        clip_gradients(pl_module, mock.Mock(), 0.5, algorithm)
    root.clip_grad_norm_.assert_called_once_with(0.5)
    pl_module.clip_gradients.assert_not_called()
