"""`dit-lightning plan`: JSON and table output."""

import contextlib
import io
import json

import pytest
import torch
import yaml

from dit_lightning.commands.plan import plan
from dit_lightning.planner.hardware import GPUS, gpu_spec


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
    from dit_lightning.cli import main

    plain = json.loads(_run_plan(model="DiT-B/2", gpu="rtx4090", format="json"))
    main(["plan", "--model", "DiT-B/2", "--gpu", "rtx4090", "--qk_norm", "true", "--format", "json"])
    qk = json.loads(capsys.readouterr().out)
    assert qk["total"] > plain["total"] and "QK-norm" in qk["assumptions"][1]
    assert set(qk["activations_per_block"]) - set(plain["activations_per_block"]) >= {"QK-norm mean/rstd"}
    fit = json.loads(_run_plan(model="DiT-B/2", memory_gib=6, qk_norm=True, fit=True, format="json"))
    assert any("QK-norm" in a for a in fit["memory"]["assumptions"])


def test_plan_takes_fit_with_a_value_as_its_help_shows_and_knows_the_rtx5090(capsys):
    """`plan --help` shows `--fit {true,false}`, but `--fit true` was refused ("unrecognized arguments: true")."""
    from dit_lightning.cli import main

    for fit in (["--fit", "true"], ["--fit"]):  # the bare flag still reads as --fit true
        main(["plan", "--gpu", "rtx5090", *fit, "--format", "json"])
        data = json.loads(capsys.readouterr().out)
        assert data["gpu"] == "rtx5090" and data["memory"]["fits"] and data["memory"]["budget"] < 32 * 2**30
    main(["plan", "--gpu", "NVIDIA GeForce RTX 5090", "--fit", "false", "--format", "json"])  # a memory plan
    assert json.loads(capsys.readouterr().out)["gpu"] == "rtx5090"
    spec = gpu_spec("5090")
    assert (spec.memory_gb, spec.bf16_tflops, spec.bandwidth_tbs) == (32, 209.5, 1.792)
