"""Gradient communication on 2 gloo processes (comm_runs.py, a subprocess: ``strategy="ddp"`` inside
pytest would re-run pytest in the child rank): the bytes each setting hands to the collectives match
the planner's count, and PowerSGD's state resumes bit for bit from a checkpoint that loads with
``weights_only=True``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dit_lightning.distributed import DiTDDPStrategy
from dit_lightning.planner import PlanOptions
from dit_lightning.planner.communication import plan_communication
from tests.distributed import comm_runs
from tests.helpers.ports import with_master_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "distributed" / "comm_runs.py")
RUNS = "ddp_none_accum,ddp_bf16,powersgd,powersgd_resume,fsdp2_accum"


def planned(store_shape: dict, **levers) -> dict[str, float]:
    """The planner's payload bytes per optimiser step for comm_runs' network on 2 ranks."""
    options = PlanOptions(**comm_runs.NET, **store_shape, world_size=2, precision="32-true", **levers)
    return plan_communication(options).payload


@pytest.fixture(scope="module")
def runs(store, tmp_path_factory):
    out = tmp_path_factory.mktemp("comm")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--data", store, "--out", str(out), "--runs", RUNS],
        env=with_master_port(env),
        cwd=out,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = {name: torch.load(out / f"{name}.pt", weights_only=False) for name in RUNS.split(",")}
    return {"out": out, **results}


@pytest.fixture(scope="module")
def shape(store):
    from dit_lightning.data import LatentDataModule

    dm = LatentDataModule(store, global_batch_size=comm_runs.GLOBAL_BATCH)
    channels, size, _ = dm.latent_shape
    return {"latent_size": size, "in_channels": channels, "num_classes": dm.num_classes}


def per_step(result: dict, accumulate: int = 1) -> list[dict[str, int]]:
    """Bytes per optimiser step (the counter records per training batch, i.e. per micro-batch)."""
    steps = result["steps"]
    merged = []
    for i in range(0, len(steps), accumulate):
        total: dict[str, int] = {}
        for micro in steps[i : i + accumulate]:
            for k, v in micro.items():
                total[k] = total.get(k, 0) + v
        merged.append(total)
    return merged


def assert_within(measured: dict[str, int], plan: dict[str, float], rel: float = 0.05) -> None:
    assert measured.keys() == plan.keys(), (measured, plan)
    for k in plan:
        assert abs(measured[k] - plan[k]) <= rel * plan[k], (k, measured[k], plan[k])


def test_ddp_sends_what_the_planner_counts_once_per_optimiser_step(runs, shape):
    micro = runs["ddp_none_accum"]["steps"]
    assert [bool(m) for m in micro] == [False, True, False, True]  # no_sync: the first micro-batch sends nothing
    for step in per_step(runs["ddp_none_accum"], accumulate=2):
        assert_within(step, planned(shape, accumulate_grad_batches=2), rel=0.0)  # fp32 gradients, exactly
    for step in per_step(runs["ddp_bf16"]):
        assert_within(step, planned(shape, communication="bf16"), rel=0.0)
    assert planned(shape, communication="bf16")["all_reduce"] * 2 == planned(shape)["all_reduce"]


def test_powersgd_sends_its_low_rank_factors_after_the_warm_up(runs, shape):
    steps = per_step(runs["powersgd"])
    warm = comm_runs.WARMUP
    for step in steps[:warm]:
        assert_within(step, planned(shape), rel=0.0)  # plain fp32 all-reduce while it warms up
    compressed = planned(shape, communication="powersgd:2")
    for step in steps[warm:]:
        assert_within(step, compressed)
    assert compressed["all_reduce"] < planned(shape)["all_reduce"] / 10


def test_fsdp2_gathers_and_reduce_scatters_what_the_planner_counts_every_micro_batch(runs, shape):
    micro = runs["fsdp2_accum"]["steps"]
    plan = planned(shape, strategy="fsdp", sharding="FULL_SHARD")  # per optimiser step of one micro-batch
    for m in micro:  # FSDP2 gathers and reduce-scatters for every micro-batch (no no_sync)
        assert_within(m, plan)
    accumulated = planned(shape, strategy="fsdp", sharding="FULL_SHARD", accumulate_grad_batches=2)
    for step in per_step(runs["fsdp2_accum"], accumulate=2):
        assert_within(step, accumulated)


def test_powersgd_resumes_bit_for_bit_from_a_weights_only_checkpoint(runs):
    full, resumed = runs["powersgd"], runs["powersgd_resume"]
    assert resumed["global_step"] == full["global_step"] == comm_runs.STEPS
    for part in ("model", "ema"):
        for k in full[part]:
            assert torch.equal(resumed[part][k], full[part][k]), f"{part}.{k}"
    # PowerSGD ran on both sides of the checkpoint, in the resumed process too (fewer bytes)
    assert len(resumed["steps"]) == comm_runs.STEPS - comm_runs.CKPT_STEP
    assert resumed["steps"][0] == full["steps"][-1]
    ckpt = torch.load(runs["out"] / "powersgd" / f"epoch=0-step={comm_runs.CKPT_STEP}.ckpt", weights_only=True)
    state = ckpt["powersgd"]
    assert state["iter"] == comm_runs.CKPT_STEP and state["rank"] == 2
    assert len(state["error"]) == 2  # each rank's own error feedback
    errors = [torch.cat([e.flatten() for e in rank.values()]) for rank in state["error"]]
    assert not torch.equal(errors[0], errors[1]) and errors[0].abs().sum() > 0
    assert state["p"].keys() == state["q"].keys() and len(state["p"]) > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(communication="int8"), "'int8' is not understood: choose none, bf16, fp16, powersgd or powersgd:R"),
        (dict(communication="powersgd:0"), "'powersgd:0' is not understood"),
        (dict(communication="bf16", powersgd_rank=2), "powersgd_rank applies only to communication powersgd"),
        (dict(communication="bf16", powersgd_warmup_steps=10), "powersgd_warmup_steps applies only to"),
        (dict(communication="powersgd", powersgd_warmup_steps=1), "DDP rebuilds its buckets"),
        (dict(communication="powersgd", powersgd_rank=0), "powersgd_rank must be >= 1"),
        (dict(communication="powersgd:2", powersgd_rank=3), "names rank 2 and powersgd_rank is 3: give the rank once"),
    ],
)
def test_a_setting_the_hooks_cannot_run_is_refused_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DiTDDPStrategy(**kwargs)


def test_the_options_are_config_keys(capsys):
    from dit_lightning.cli import main

    with pytest.raises(SystemExit) as e:
        main(
            [
                "fit",
                "--config",
                str(ROOT / "configs" / "demo.yaml"),
                "--trainer.strategy",
                "dit_lightning.distributed.DiTDDPStrategy",
                "--trainer.strategy.communication",
                "powersgd",
                "--trainer.strategy.powersgd_rank",
                "2",
                "--print_config",
            ]
        )
    assert e.value.code == 0
    import yaml

    args = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]["init_args"]
    assert args["communication"] == "powersgd" and args["powersgd_rank"] == 2
    assert "powersgd_warmup_steps" in args


def test_the_planners_spelling_of_a_rank_is_the_strategys():
    ranked = DiTDDPStrategy(communication="powersgd:2")
    assert (ranked.communication, ranked.powersgd_rank) == ("powersgd", 2)
    assert DiTDDPStrategy(communication="powersgd", powersgd_rank=2).powersgd_rank == 2
    assert DiTDDPStrategy(communication="powersgd").powersgd_rank == 4


# ---- the command line: the project's own one-line message, never jsonargparse's "Expected a <class 'str'>"

DDP = ["--trainer.strategy", "dit_lightning.distributed.DiTDDPStrategy"]
FSDP2 = ["--trainer.strategy", "dit_lightning.distributed.DiTFSDP2Strategy"]


@pytest.mark.parametrize(
    "args, code, message",
    [
        (
            [*DDP, "--trainer.strategy.communication", "powersgd:0"],
            1,
            "DiTDDPStrategy: communication 'powersgd:0' is not understood: choose none, bf16, fp16, powersgd or "
            "powersgd:R (R >= 1)",
        ),
        ([*DDP, "--trainer.strategy.communication", "banana"], 1, "DiTDDPStrategy: communication 'banana' is not"),
        (
            [*DDP, "--trainer.strategy.powersgd_rank", "0"],
            1,
            "DiTDDPStrategy: powersgd_rank applies only to communication powersgd (communication is 'none'): set "
            "communication powersgd or drop powersgd_rank",
        ),
        (
            [*DDP, "--trainer.strategy.communication", "powersgd", "--trainer.strategy.powersgd_rank", "0"],
            1,
            "DiTDDPStrategy: powersgd_rank must be >= 1 (got 0)",
        ),
        (
            [*FSDP2, "--trainer.strategy.communication", "powersgd"],
            2,
            "--trainer.strategy.communication: DiTFSDP2Strategy has no option 'communication': FSDP has no comm hook: "
            "it reduce-scatters its gradients in its reduce_dtype",
        ),
        (
            [*DDP, "--trainer.strategy.powersgd_rank", "two"],
            2,
            "--trainer.strategy.powersgd_rank: expected int or None",
        ),
    ],
    ids=["powersgd:0", "banana", "rank-without-powersgd", "rank-0", "powersgd-under-fsdp2", "rank-not-a-number"],
)
def test_a_bad_communication_is_the_projects_one_line_message(store, capsys, args, code, message):
    from dit_lightning.cli import main
    from tests.helpers.cli import DEMO, TINY

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", DEMO, *TINY, "--data.path", store, "--trainer.logger", "false", *args])
    err = capsys.readouterr().err
    assert e.value.code == code and f"dit-lightning fit: error: {message}" in err, err
    assert "Expected a <class" not in err and "Traceback" not in err and len(err.strip().splitlines()) == 2, err


def test_a_strategys_class_path_alone_is_the_class(store, tmp_path, capsys, monkeypatch):
    """`--trainer.strategy dit_lightning.distributed.DiTDDPStrategy` with no option of its own was taken for
    a registered name, lower-cased ("invalid strategy name"). (In this process: the Trainer is built, then
    the command stops before fitting.)"""
    from dit_lightning.cli import main
    from dit_lightning.lightning_cli import DiTCLI
    from tests.helpers.cli import fit_args

    built = {}
    instantiate_trainer = DiTCLI.instantiate_trainer

    def stop_once_built(self, **kwargs):
        built["trainer"] = instantiate_trainer(self, **kwargs)
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(DiTCLI, "instantiate_trainer", stop_once_built)
    args = [*fit_args(tmp_path, "run", 1), "--data.path", store]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*args, *DDP])
    err = capsys.readouterr().err
    assert "stopped by the test" in err and "invalid strategy name" not in err, err
    assert type(built["trainer"].strategy) is DiTDDPStrategy
    with pytest.raises(SystemExit) as e:
        main([*args, "--trainer.strategy", "dit_lightning.distributed.NoSuchStrategy"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "--trainer.strategy dit_lightning.distributed.NoSuchStrategy: no such class" in err
