"""Precision in one place: every spelling a user may write, the torch dtype it means, and the
dtype a running Trainer really computes in.

Users meet four vocabularies: Lightning's ``precision`` ("32-true", "16-mixed", "bf16-mixed",
"bf16-true"...), short names ("fp32", "bf16", "fp16"), torch's dtype names ("float32",
"bfloat16", "float16", "torch.bfloat16") and the FSDP strategies' ``param_dtype``. They all map
to a :class:`torch.dtype` here (:func:`to_dtype`) and back to each vocabulary
(:func:`lightning_precision`, :func:`short_name`, :func:`dtype_name`); the planner, auto-fit and
the hardware profiles plan in :data:`TrainingPrecision` and take the one rule for a device's
16-bit precision from :func:`best_mixed_precision`. :func:`compute_dtype` tells the matmul
dtype of a Trainer: the strategy's mixed-precision ``param_dtype`` when it sets one (FSDP2 with
``precision: 32-true`` and ``param_dtype: bfloat16`` computes in bf16), else the precision
plugin's. :func:`grad_scaler` and :func:`pending_grad_scale` tell whether ``16-mixed`` loss
scaling is active and whether the gradients a hook sees are still scaled. Pure PyTorch:
Lightning objects are inspected by attribute, never imported.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal, Optional, Union, get_args

import torch

# The precisions the training configs and the planner speak (Lightning's names).
TrainingPrecision = Literal["32-true", "16-mixed", "bf16-mixed"]
TRAINING_PRECISIONS: tuple[TrainingPrecision, ...] = get_args(TrainingPrecision)
# The short names the sampling commands take.
SamplingPrecision = Literal["fp32", "bf16", "fp16"]
# torch's dtype names, as the FSDP strategies take them (``param_dtype``, ``reduce_dtype``).
DTypeName = Literal["float32", "bfloat16", "float16"]
DTypeLike = Union[str, int, torch.dtype, None]

_SPELLINGS: dict[str, torch.dtype] = {}
for _dtype, _names in (
    (torch.float32, ("32", "32-true", "fp32", "float32", "float", "full", "32-mixed")),
    (torch.bfloat16, ("bf16", "bfloat16", "bf16-mixed", "bf16-true")),
    (torch.float16, ("16", "fp16", "float16", "half", "16-mixed", "16-true")),
    (torch.float64, ("64", "64-true", "fp64", "float64", "double")),
):
    for _name in _names:
        _SPELLINGS[_name] = _dtype

_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
_LIGHTNING_MIXED: dict[torch.dtype, TrainingPrecision] = {
    torch.float32: "32-true",
    torch.bfloat16: "bf16-mixed",
    torch.float16: "16-mixed",
}


def to_dtype(precision: DTypeLike) -> torch.dtype:
    """The torch dtype of any precision spelling (``None`` means float32).

    >>> to_dtype("bf16-mixed"), to_dtype("fp16"), to_dtype("float32"), to_dtype(16)
    (torch.bfloat16, torch.float16, torch.float32, torch.float16)
    """
    if precision is None:
        return torch.float32
    if isinstance(precision, torch.dtype):
        return precision
    key = str(precision).strip().lower().removeprefix("torch.")
    if key in _SPELLINGS:
        return _SPELLINGS[key]
    raise ValueError(
        f"unknown precision {precision!r}: use 32-true, 16-mixed or bf16-mixed (training), fp32, bf16 or fp16 "
        "(sampling), or a torch dtype name (float32, bfloat16, float16)"
    )


def optional_dtype(precision: DTypeLike) -> Optional[torch.dtype]:
    """:func:`to_dtype`, but ``None`` stays ``None`` ("not set": let the caller decide)."""
    return None if precision is None else to_dtype(precision)


def short_name(precision: DTypeLike) -> str:
    """ "fp32", "bf16", "fp16" (or "fp64") for any spelling."""
    dtype = to_dtype(precision)
    if dtype not in _SHORT:  # a dtype passed through as itself (torch.int8...)
        raise ValueError(f"no short precision name for {dtype}")
    return _SHORT[dtype]


def dtype_name(precision: DTypeLike) -> str:
    """torch's name of the dtype of any spelling ("bfloat16" for "bf16-mixed"), as the FSDP strategies'
    ``param_dtype`` / ``reduce_dtype`` take it."""
    return str(to_dtype(precision)).removeprefix("torch.")


def lightning_precision(precision: DTypeLike) -> TrainingPrecision:
    """The training precision (Lightning's mixed-precision name: "32-true", "bf16-mixed" or "16-mixed")
    of any spelling; a 16-bit ``*-true`` spelling maps to its mixed precision."""
    dtype = to_dtype(precision)
    if dtype not in _LIGHTNING_MIXED:
        raise ValueError(f"no Lightning mixed precision for {dtype}: train in {', '.join(TRAINING_PRECISIONS)}")
    return _LIGHTNING_MIXED[dtype]


def best_mixed_precision(bf16_supported: bool) -> TrainingPrecision:
    """The 16-bit training precision to use on a device: ``bf16-mixed`` where it computes in bf16
    (fp32's range: no loss scaling), else ``16-mixed`` (fp16 with a GradScaler)."""
    return "bf16-mixed" if bf16_supported else "16-mixed"


def is_mixed(precision: DTypeLike) -> bool:
    """True for the 16-bit precisions (matmuls in bf16 or fp16), False for fp32 and fp64."""
    return to_dtype(precision) in (torch.bfloat16, torch.float16)


def itemsize(precision: DTypeLike) -> int:
    """Bytes per element of the precision's dtype: 2 for the 16-bit precisions, 4 for fp32."""
    return to_dtype(precision).itemsize


def is_fp16(precision: DTypeLike) -> bool:
    """True for the float16 precisions ("16-mixed", "16-true", "fp16"...), which need loss scaling."""
    return to_dtype(precision) == torch.float16


def autocast(device_type: str, precision: DTypeLike) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to the 16-bit dtype of ``precision``; a no-op for fp32."""
    dtype = to_dtype(precision)
    if dtype in (torch.float32, torch.float64):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def set_tf32(enabled: bool) -> None:
    """Let fp32 matmuls (and cuDNN convolutions) use TF32 tensor cores on Ampere and newer GPUs,
    through torch's public precision switches: ~2-3x faster fp32 training at a tiny precision cost."""
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


def strategy_param_dtype(strategy: Any) -> Optional[torch.dtype]:
    """The dtype a sharding strategy gathers parameters in (its mixed-precision policy), if set:
    FSDP2 (``DiTFSDP2Strategy.fsdp_options["param_dtype"]``) or FSDP1 (``mixed_precision``)."""
    options = getattr(strategy, "fsdp_options", None)
    if isinstance(options, dict) and options.get("param_dtype") is not None:
        return to_dtype(options["param_dtype"])
    mixed = getattr(strategy, "mixed_precision", None)
    if mixed is not None and getattr(mixed, "param_dtype", None) is not None:
        return to_dtype(mixed.param_dtype)
    return None


def compute_dtype(trainer: Any) -> torch.dtype:
    """The dtype the matmuls of a Trainer's training step run in.

    The strategy's parameter dtype wins (FSDP2/FSDP1 mixed precision casts the gathered weights,
    whatever ``trainer.precision`` says), then the precision plugin's ``trainer.precision``.
    """
    param_dtype = strategy_param_dtype(getattr(trainer, "strategy", None))
    if param_dtype is not None:
        return param_dtype
    precision = getattr(trainer, "precision", None)
    if str(precision).startswith("transformer-engine"):
        return torch.int8  # FP8 matmuls: Lightning's peak table files Transformer Engine under int8
    return to_dtype(precision)


def grad_scaler(trainer: Any) -> Optional[torch.amp.GradScaler]:
    """The enabled GradScaler of a Trainer's precision plugin (``16-mixed``: Lightning's
    ``MixedPrecision.scaler``, FSDP1's ``ShardedGradScaler``), else None (fp32, bf16)."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
        return None
    return scaler


def optimizer_unscales_itself(optimizer: Any) -> bool:
    """True for optimisers that unscale the gradients inside their ``step`` (``fused=True`` AdamW/Adam/SGD
    set ``_step_supports_amp_scaling``): GradScaler hands them the scale instead of unscaling first."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's LightningOptimizer wrapper
    return bool(getattr(inner, "_step_supports_amp_scaling", False))


def pending_grad_scale(trainer: Any, optimizer: Any) -> Optional[float]:
    """The loss scale the gradients still carry in ``on_before_optimizer_step``, or None when they are
    true gradients.

    Under ``16-mixed`` Lightning unscales the gradients before that hook, except for optimisers
    that unscale inside their step (fused AdamW): there a gradient norm read in the hook is the
    true norm times the scale (65536 at the start). Reads the scale from the device (a sync).
    """
    scaler = grad_scaler(trainer)
    if scaler is None or not optimizer_unscales_itself(optimizer):
        return None
    return float(scaler.get_scale())
