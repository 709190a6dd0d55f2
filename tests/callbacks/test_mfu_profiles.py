"""Which peak FLOP/s the MFU of each hardware profile (configs/hardware/*.yaml) is measured against.

The throughput monitor takes its peak from the compute dtype (``precision.compute_dtype``): the
strategy's ``param_dtype`` when it sets one, else ``trainer.precision``. Under the FSDP2 profiles
``trainer.precision`` is ``32-true`` while the matmuls run in bf16, so a peak taken from the precision
alone would be the TF32 one (half the bf16 peak on an H200) and the logged MFU twice too high.
Each profile's strategy is built from its YAML exactly as the CLI would (class_path + init_args),
without launching processes; the peak lookup is the monitor's table for an H200.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml

from dit_lightning.planner.hardware import peak_flops_for
from dit_lightning.precision import compute_dtype, to_dtype

ROOT = Path(__file__).resolve().parents[2]
PROFILES = sorted((ROOT / "configs" / "hardware").glob("*.yaml"))

# The compute dtype each profile trains in, i.e. the peak its MFU must use.
EXPECTED = {
    "1x24gb": torch.bfloat16,  # the planner's answer for an RTX 4090 (tests/planner/test_profiles.py)
    "2x24gb": torch.bfloat16,
    "4xa100-80gb": torch.bfloat16,
    "8gpu": torch.bfloat16,
    "cpu": torch.float32,
    "fsdp-full-shard-8gpu": torch.bfloat16,
    "fsdp-shard-grad-op-8gpu": torch.bfloat16,
    "fsdp-v2-8gpu": torch.bfloat16,  # precision 32-true, param_dtype bfloat16
    "fsdp-v2-cpu": torch.float32,
    "fsdp-v2-hybrid-multinode": torch.bfloat16,  # precision 32-true, param_dtype bfloat16
    "multinode": torch.bfloat16,
}
H200 = "NVIDIA H200"


def build_strategy(spec):
    """A strategy from a config's ``trainer.strategy`` (a name, or class_path + init_args)."""
    if spec is None or isinstance(spec, str):
        return spec
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**spec.get("init_args", {}))


def profile(path: Path) -> tuple[SimpleNamespace, dict]:
    config = yaml.safe_load(path.read_text())
    trainer = config.get("trainer", {})
    stand_in = SimpleNamespace(
        precision=str(trainer.get("precision", "32-true")), strategy=build_strategy(trainer.get("strategy"))
    )
    return stand_in, config


def test_every_profile_has_an_expected_compute_dtype():
    assert sorted(p.stem for p in PROFILES) == sorted(EXPECTED), "a profile was added or removed: update EXPECTED"


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_mfu_peak_of_each_profile(path):
    trainer, config = profile(path)
    dtype = compute_dtype(trainer)
    assert dtype == EXPECTED[path.stem]
    tf32 = config.get("model", {}).get("tf32", True)  # DiTModule's default: TF32 on for fp32 matmuls
    peak = peak_flops_for(H200, dtype, tf32=tf32)
    want = {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 494e12}[dtype]
    assert peak == pytest.approx(want)
    from_precision_alone = peak_flops_for(H200, to_dtype(trainer.precision), tf32=tf32)
    if to_dtype(trainer.precision) != dtype:  # the FSDP2 profiles: the bug this guards against
        assert from_precision_alone == pytest.approx(494e12) and peak > 1.9 * from_precision_alone


def test_fsdp2_profile_on_a_real_trainer_computes_in_bf16():
    """The same answer from a real Trainer: FSDP2 with param_dtype bfloat16 and precision 32-true."""
    _, config = profile(ROOT / "configs" / "hardware" / "fsdp-v2-8gpu.yaml")
    strategy = build_strategy(config["trainer"]["strategy"])
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision=config["trainer"]["precision"], logger=False
    )
    assert trainer.precision == "32-true"
    assert compute_dtype(trainer) == torch.bfloat16
    assert peak_flops_for(H200, compute_dtype(trainer)) == pytest.approx(989e12)
