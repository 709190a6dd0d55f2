"""`dit-lightning plan`: JSON and table output, the planner's options object as flags, and the
model and levers of a fit run (`--run`: its directory, its config.yaml or a checkpoint)."""

import contextlib
import dataclasses
import inspect
import io
import json

import pytest
import torch
import yaml

from dit_lightning.cli import main
from dit_lightning.commands.plan import parser, plan
from dit_lightning.planner import PlanOptions
from dit_lightning.planner.hardware import GPUS, gpu_spec

FIELDS = {f.name for f in dataclasses.fields(PlanOptions)}


def _run_plan(**kw) -> str:
    """plan() of keyword settings: PlanOptions' fields go into the options object."""
    options = PlanOptions(**{k: kw.pop(k) for k in list(kw) if k in FIELDS})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan(options, **kw)
    return out.getvalue()


def _cli(args, capsys) -> tuple[int, str, str]:
    """``dit-lightning plan ARGS`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        main(["plan", *args])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


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


def test_a_memory_budget_alone_is_enough_to_fit():
    """`plan --memory_gib 24 --fit`: no GPU type needed (the ranking uses a nominal device)."""
    data = json.loads(_run_plan(model="DiT-XL/2", memory_gib=24, fit=True, format="json"))
    assert data["feasible"] and data["nominal_device"] and data["gpu"] is None
    assert data["memory"]["total"] <= 24 * 2**30
    text = _run_plan(model="DiT-XL/2", memory_gib=24, fit=True)
    assert "relative to a nominal device" in text


def test_gpu_names_ambiguous_device_names_and_the_help_list():
    with pytest.raises(ValueError, match="ambiguous: say which one, a100-40gb or a100-80gb"):
        plan(gpu="A100", fit=True)
    assert gpu_spec("NVIDIA H100 80GB HBM3").name == "h100-80gb"  # what torch.cuda.get_device_name() prints
    assert gpu_spec("NVIDIA A100-SXM4-40GB").name == "a100-40gb"
    assert gpu_spec("NVIDIA GeForce RTX 4090").name == "rtx4090" and gpu_spec("NVIDIA L4").name == "l4"
    plan_memory = json.loads(_run_plan(gpu="NVIDIA H100 80GB HBM3", format="json"))
    assert plan_memory["gpu"] == "h100-80gb"
    with pytest.raises(ValueError) as e:
        gpu_spec("foo")
    for name in GPUS:  # the error and the help list the same table
        assert name in str(e.value) and name in (plan.__doc__ or "")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where no GPU is visible")
def test_gpu_auto_without_a_gpu_says_what_to_do_instead():
    with pytest.raises(ValueError, match="no CUDA device is visible here; name the GPU"):
        plan(gpu="auto")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_auto_reads_the_local_device():
    result = json.loads(_run_plan(gpu="auto", format="json"))
    assert result["budget"] > 0


def test_the_models_checkpointing_syntax_and_a_hardware_profile_as_yaml():
    first = json.loads(_run_plan(activation_checkpointing="first:16", gpu="rtx4090", format="json"))
    number = json.loads(_run_plan(activation_checkpointing=16, gpu="rtx4090", format="json"))
    assert first["checkpointed_blocks"] == 16 and first["total"] == number["total"]
    every = json.loads(_run_plan(activation_checkpointing="every:2", gpu="rtx4090", format="json"))
    assert every["checkpointed_blocks"] == 14
    profile = yaml.safe_load(_run_plan(gpu="rtx4090", fit=True, format="yaml"))
    assert profile["trainer"]["precision"] == "bf16-mixed" and profile["model"]["activation_checkpointing"] == "none"
    with pytest.raises(ValueError, match="add --fit"):
        plan(gpu="rtx4090", format="yaml")


def test_qk_norm_flag_plans_the_models_qk_norm(capsys):
    """`--qk_norm true` (the model's own option) reaches the memory plan and the --fit search."""
    plain = json.loads(_run_plan(model="DiT-B/2", gpu="rtx4090", format="json"))
    main(["plan", "--model", "DiT-B/2", "--gpu", "rtx4090", "--qk_norm", "true", "--format", "json"])
    qk = json.loads(capsys.readouterr().out)
    assert qk["total"] > plain["total"] and "QK-norm" in qk["assumptions"][1]
    assert set(qk["activations_per_block"]) - set(plain["activations_per_block"]) >= {"QK-norm mean/rstd"}
    fit = json.loads(_run_plan(model="DiT-B/2", memory_gib=6, qk_norm=True, fit=True, format="json"))
    assert any("QK-norm" in a for a in fit["memory"]["assumptions"])


def test_plan_takes_fit_with_a_value_as_its_help_shows_and_knows_the_rtx5090(capsys):
    """`plan --help` shows `--fit {true,false}`, but `--fit true` was refused ("unrecognized arguments: true")."""
    for fit in (["--fit", "true"], ["--fit"]):  # the bare flag still reads as --fit true
        main(["plan", "--gpu", "rtx5090", *fit, "--format", "json"])
        data = json.loads(capsys.readouterr().out)
        assert data["gpu"] == "rtx5090" and data["memory"]["fits"] and data["memory"]["budget"] < 32 * 2**30
    main(["plan", "--gpu", "NVIDIA GeForce RTX 5090", "--fit", "false", "--format", "json"])  # a memory plan
    assert json.loads(capsys.readouterr().out)["gpu"] == "rtx5090"
    spec = gpu_spec("5090")
    assert (spec.memory_gb, spec.bf16_tflops, spec.bandwidth_tbs) == (32, 209.5, 1.792)


# ---- the options object and its flags --------------------------------------------------------------


def test_plan_takes_the_planners_options_object_and_every_field_is_a_flag(capsys):
    params = inspect.signature(plan).parameters
    assert len(params) <= 12 and params["options"].annotation in ("Optional[PlanOptions]", PlanOptions)
    assert not FIELDS & set(params)  # no field restated as a parameter
    flags = {o for a in parser()._actions for o in a.option_strings}
    assert {f"--{name}" for name in FIELDS} <= flags and {"--gpu", "--fit", "--run", "--fit_micro_batch"} <= flags
    # the flags of earlier command lines: --fit_micro_batch pins the micro-batch of --fit
    code, out, _ = _cli(["--gpu", "rtx4090", "--fit", "--fit_micro_batch", "8", "--format", "json"], capsys)
    assert code == 0 and json.loads(out)["micro_batch"] == 8
    code, out, _ = _cli(
        ["--model", "DiT-B/2", "--micro_batch", "16", "--accumulate_grad_batches", "2", "--json"], capsys
    )
    data = json.loads(out)
    assert code == 0 and (data["micro_batch"], data["accumulate_grad_batches"], data["model"]) == (16, 2, "DiT-B/2")


# ---- a fit run's model and levers ------------------------------------------------------------------

RUN_CONFIG = {
    "trainer": {
        "devices": 2,
        "num_nodes": 1,
        "precision": "16-mixed",
        "accumulate_grad_batches": 2,
        "strategy": {
            "class_path": "dit_lightning.distributed.DiTDDPStrategy",
            "init_args": {"communication": "powersgd", "powersgd_rank": 2, "gradient_as_bucket_view": True},
        },
    },
    "model": {
        "class_path": "dit_lightning.module.DiTModule",
        "init_args": {
            "model": "custom",
            "depth": 3,
            "hidden_size": 64,
            "num_heads": 4,
            "patch_size": 2,
            "activation_checkpointing": "half",
            "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}},
        },
    },
    "data": {"global_batch_size": 64, "path": "data/nowhere"},
}


def _run_directory(tmp_path, config=RUN_CONFIG):
    run = tmp_path / "version_0"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    hparams = {**config["model"]["init_args"], "latent_shape": [4, 16, 16], "num_classes": 10, "global_batch_size": 64}
    hparams.pop("optimizer")
    (run / "hparams.yaml").write_text(yaml.safe_dump(hparams))
    return run


def test_plan_reads_a_runs_model_and_levers_and_the_command_line_wins(tmp_path, capsys):
    run = _run_directory(tmp_path)
    code, out, err = _cli(["--run", str(run), "--gpu", "rtx4090", "--format", "json"], capsys)
    data = json.loads(out)
    assert code == 0 and (data["depth"], data["hidden_size"], data["latent_size"], data["patch_size"]) == (3, 64, 16, 2)
    assert (data["world_size"], data["precision"], data["accumulate_grad_batches"]) == (2, "16-mixed", 2)
    assert data["micro_batch"] == 64 // (2 * 2) and data["optimizer"] == "sgd" and data["checkpointed_blocks"] == 1
    assert f"--run {run}: --model custom --depth 3" in err and "--communication powersgd:2" in err
    same = json.loads(_run_plan(**{**_as_options(err), "gpu": "rtx4090", "format": "json"}))
    assert same["total"] == data["total"]  # the flags it prints plan the same
    code, out, _ = _cli(
        ["--run", str(run / "config.yaml"), "--gpu", "rtx4090", "--precision", "bf16-mixed", "--json"], capsys
    )
    assert code == 0 and json.loads(out)["precision"] == "bf16-mixed"  # given here: wins
    code, out, _ = _cli(["--run", str(run), "--gpu", "rtx4090", "--fit", "--json"], capsys)
    fit = json.loads(out)  # --fit searches the run's micro-batch, precision...; its global batch stays
    assert code == 0 and fit["micro_batch"] * 2 * fit["accumulate_grad_batches"] == 64


def _as_options(err: str) -> dict:
    """The flags ``--run`` printed, as keyword settings."""
    import shlex

    words = shlex.split(err.split(": ", 1)[1].split(" (from ")[0])  # --flag value pairs
    values = dict(zip(words[::2], words[1::2]))
    typed = {}
    for flag, value in values.items():
        name = flag[2:]
        if name in ("global_batch", "fsdp2"):
            continue
        typed[name] = yaml.safe_load(value) if name not in ("model", "communication") else value
    return typed


def test_plan_reads_a_checkpoint_and_an_fsdp2_run(tmp_path, capsys):
    from dit_lightning.checkpoints import save_dit
    from dit_lightning.models import DiT

    run = _run_directory(tmp_path)
    (run / "hparams.yaml").unlink()
    (run / "checkpoints").mkdir()
    save_dit(DiT(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=4, num_classes=10),
             run / "checkpoints" / "last.ckpt")  # fmt: skip
    for path in (run, run / "checkpoints" / "last.ckpt"):  # the run reads its checkpoint; the checkpoint its run
        code, out, err = _cli(["--run", str(path), "--gpu", "rtx4090", "--format", "json"], capsys)
        data = json.loads(out)
        assert code == 0 and (data["depth"], data["hidden_size"], data["latent_size"]) == (2, 32, 8), err
        assert data["world_size"] == 2 and "last.ckpt" in err
    fsdp2 = {**RUN_CONFIG, "trainer": {**RUN_CONFIG["trainer"], "devices": 4, "num_nodes": 2, "precision": "32-true"}}
    fsdp2["trainer"]["strategy"] = {
        "class_path": "dit_lightning.distributed.DiTFSDP2Strategy",
        "init_args": {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16", "hybrid_shard_size": 4},
    }
    (tmp_path / "fsdp2").mkdir()
    code, _, err = _cli(
        ["--run", str(_run_directory(tmp_path / "fsdp2", fsdp2)), "--gpu", "a100-80gb", "--json"], capsys
    )
    assert code == 0 and "--world_size 8 --num_nodes 2" in err and "--strategy fsdp" in err, err
    assert "--shard_group 4" in err and "--communication bf16" in err and "--precision bf16-mixed" in err
    assert "--fsdp2 true" in err


def test_plan_refuses_a_fit_config_as_its_own_and_a_path_that_is_no_run(tmp_path, capsys):
    """`plan --config <run>/config.yaml` printed jsonargparse's dump of the whole parser."""
    run = _run_directory(tmp_path)
    code, _, err = _cli(["--config", str(run / "config.yaml")], capsys)
    assert code == 1 and f"--config {run}/config.yaml is a fit config" in err
    assert f"dit-lightning plan --run {run}/config.yaml" in err and len(err.strip().splitlines()) == 2
    code, _, err = _cli(["--run", str(tmp_path / "missing")], capsys)
    assert code == 1 and "does not exist: give a fit run's directory" in err
