"""Peak dense FLOP/s of the accelerators DiT is trained on, by device name and precision.

MFU divides achieved FLOP/s by these numbers, so they must be the *dense* tensor-core peaks
for the precision actually used (NVIDIA datasheets print "with sparsity" figures, twice the
dense ones). Lightning's :func:`~lightning.fabric.utilities.throughput.get_available_flops`
has a table too, but it does not recognise ``"NVIDIA H200"`` (it only knows "H200 SXM1/NVL1"
spellings, with the sparse figures) and lists the GeForce cards at their non-tensor FP32
rates; so the devices below are looked up here first, and Lightning's table is the fallback
for everything else.
"""

from __future__ import annotations

import re
from typing import Optional, Union

import torch

from ..planner.hardware import GPUS

TFLOPS = 1e12

# FLOP/s per device, dense, by compute precision, from the one GPU table of the project
# (planner/hardware.py). "tf32" is the rate of FP32 matmuls when TF32 tensor cores are
# allowed; "fp32" the rate without them; FP16/BF16 with FP32 accumulation.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    name: {
        "fp32": g.fp32_tflops * TFLOPS,
        "tf32": g.tf32_tflops * TFLOPS,
        "bf16": g.bf16_tflops * TFLOPS,
        "fp16": g.fp16_tflops * TFLOPS,
    }
    for name, g in GPUS.items()
}

# torch.cuda.get_device_name() spellings, matched in order on the lower-cased name (first hit
# wins, so the more specific patterns come first). Examples: "NVIDIA H200", "NVIDIA H100 80GB
# HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB", "NVIDIA A100
# 80GB PCIe", "NVIDIA L40S", "NVIDIA GeForce RTX 4090", "NVIDIA GH200 480GB".
_NAME_PATTERNS: list[tuple[str, str]] = [
    ("gh200", r"\bgh200\b"),
    ("h200-nvl", r"\bh200\b.*\bnvl"),
    ("h200", r"\bh200\b"),
    ("h100-nvl", r"\bh100\b.*\bnvl"),
    ("h100-pcie", r"\bh100\b.*\b(pcie|hbm2e)\b"),
    ("h100-80gb", r"\bh100\b"),  # "H100 80GB HBM3", "H100 SXM5 80GB"
    ("a100-80gb", r"\ba100\b"),  # 40 and 80 GB parts share one compute peak
    ("l40s", r"\bl40s\b"),  # not the L40 (half the tensor rate): Lightning's table covers it
    ("rtx4090", r"\brtx 4090\b(?!\s*d\b)"),  # the 4090 D has fewer SMs
    ("rtx3090-ti", r"\brtx 3090 ti\b"),
    ("rtx3090", r"\brtx 3090\b"),
]

_DTYPE_KEYS: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}


def device_key(device_name: str) -> Optional[str]:
    """The :data:`PEAK_FLOPS` key of a ``torch.cuda.get_device_name()`` string, or None."""
    name = device_name.lower()
    for key, pattern in _NAME_PATTERNS:
        if re.search(pattern, name):
            return key
    return None


def precision_dtype(precision: Union[str, int, None]) -> torch.dtype:
    """The matmul dtype of a Lightning ``precision`` ("bf16-mixed", "16-true", "32-true"...)."""
    p = str(precision).lower()
    if p.startswith("bf16"):
        return torch.bfloat16
    if p.startswith("16") or p.startswith("fp16") or p == "half":
        return torch.float16
    if p.startswith("64"):
        return torch.float64
    if p.startswith("transformer-engine"):
        # FP8 matmuls; leave the lookup to Lightning (it maps TE to int8 rates)
        return torch.int8
    return torch.float32


def tf32_enabled() -> bool:
    """Whether FP32 matmuls may use TF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32``
    and ``set_float32_matmul_precision("high")`` both show up here)."""
    return torch.get_float32_matmul_precision() != "highest"


def peak_flops_for(device_name: str, dtype: Union[torch.dtype, str], tf32: bool = False) -> Optional[float]:
    """Dense peak FLOP/s of one device for matmuls in ``dtype`` (``"tf32"`` accepted), from
    :data:`PEAK_FLOPS`; None when the device or dtype is not in the table."""
    key = device_key(device_name)
    if key is None:
        return None
    if isinstance(dtype, str):
        dkey = dtype
    else:
        dkey = _DTYPE_KEYS.get(dtype)
        if dkey == "fp32" and tf32:
            dkey = "tf32"
    if dkey is None:
        return None
    return PEAK_FLOPS[key].get(dkey)


def device_peak_flops(device: torch.device, precision: Union[str, int, None]) -> Optional[float]:
    """Peak dense FLOP/s of ``device`` at a Lightning ``precision``: this module's table first,
    then Lightning's :func:`get_available_flops`; None on CPU (no meaningful peak to assume)."""
    if device.type != "cuda":
        return None
    dtype = precision_dtype(precision)
    name = torch.cuda.get_device_name(device)
    peak = peak_flops_for(name, dtype, tf32=tf32_enabled())
    if peak is not None:
        return peak
    from lightning.fabric.utilities.throughput import get_available_flops

    fallback = get_available_flops(device, dtype)
    return float(fallback) if fallback else None
