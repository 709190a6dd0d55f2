"""`dit-lightning plan`: JSON and table output."""

import contextlib
import io
import json

from dit_lightning.commands.plan import plan


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
