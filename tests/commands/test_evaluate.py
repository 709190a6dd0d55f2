"""`dit-lightning evaluate`: sample a checkpoint, then measure against a store."""

import json
import os

import pytest
import torch

from dit_lightning.commands.evaluate import evaluate
from tests.helpers.tiny_features import TinyFeatures

pytestmark = pytest.mark.usefixtures("one_thread")


def test_evaluate_samples_then_measures_against_a_store(tmp_path):
    from dit_lightning.data import prepare_digits
    from dit_lightning.models import DiT

    store = prepare_digits(str(tmp_path / "digits"))
    torch.manual_seed(0)
    net = DiT(input_size=8, patch_size=2, in_channels=1, hidden_size=64, depth=1, num_heads=1, num_classes=10)
    ckpt = tmp_path / "raw.pt"
    torch.save(net.state_dict(), ckpt)
    out = evaluate(
        str(ckpt), str(tmp_path / "eval"), reference=store, num_samples=12, metrics=["fid", "digits"],
        feature_extractor=TinyFeatures(),
        cache_dir=str(tmp_path / "cache"), labels="0-9", num_steps=4, device="cpu", progress=False, max_reference=200,
    )  # fmt: skip
    assert out["num_samples"] == 12 and out["num_reference"] == 200 and out["fid"] > 0
    assert out["digits"]["samples"] == 12 and "fd_svc" in out["digits"]["frechet"]
    saved = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert saved["fid"] == pytest.approx(out["fid"]) and saved["sampling"]["num_steps"] == 4
    assert os.path.exists(tmp_path / "eval" / "samples.npz")
