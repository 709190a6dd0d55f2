"""Precision spellings -> dtypes, and the dtype a Trainer computes in (precision.py). Trainers and
strategies are stand-ins with the attributes precision.py reads."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from dit_lightning.precision import (
    TRAINING_PRECISIONS,
    DTypeLike,
    autocast,
    best_mixed_precision,
    compute_dtype,
    dtype_name,
    is_fp16,
    is_mixed,
    itemsize,
    lightning_precision,
    optional_dtype,
    short_name,
    strategy_param_dtype,
    to_dtype,
)

SPELLINGS: dict[torch.dtype, list[DTypeLike]] = {
    torch.float32: ["32", "32-true", "32-mixed", "fp32", "float32", "float", "full", "torch.float32", 32, None],
    torch.bfloat16: ["bf16", "bfloat16", "bf16-mixed", "bf16-true", "torch.bfloat16"],
    torch.float16: ["16", "16-mixed", "16-true", "fp16", "float16", "half", "torch.float16", 16],
    torch.float64: ["64", "64-true", "fp64", "float64", "double", 64],
}
# ... and each torch dtype stands for itself
CASES = [(spelling, dtype) for dtype, spellings in SPELLINGS.items() for spelling in [*spellings, dtype]]


@pytest.mark.parametrize("spelling, dtype", CASES, ids=[repr(s) for s, _ in CASES])
def test_every_spelling_maps_to_its_dtype(spelling, dtype):
    assert to_dtype(spelling) is dtype


@pytest.mark.parametrize(
    "spelling, dtype", [("BF16-Mixed", torch.bfloat16), (" fp16 ", torch.float16), ("Torch.Float32", torch.float32)]
)
def test_spellings_are_read_case_and_space_insensitively(spelling, dtype):
    assert to_dtype(spelling) is dtype


@pytest.mark.parametrize("bad", ["fp8", "bf32", "int8", "32-bit", "", "transformer-engine", 8])
def test_an_unknown_spelling_names_the_accepted_ones(bad):
    with pytest.raises(ValueError) as e:
        to_dtype(bad)
    msg = str(e.value)
    assert repr(bad) in msg
    for accepted in ("32-true", "16-mixed", "bf16-mixed", "fp32", "bf16", "fp16", "float32", "bfloat16", "float16"):
        assert accepted in msg


def test_optional_short_and_lightning_names():
    assert optional_dtype(None) is None and optional_dtype("bf16-true") is torch.bfloat16
    assert [short_name(s) for s in ("32-true", "bf16-mixed", "half", torch.float64)] == ["fp32", "bf16", "fp16", "fp64"]
    assert [lightning_precision(s) for s in ("fp32", "bfloat16", "fp16")] == ["32-true", "bf16-mixed", "16-mixed"]
    with pytest.raises(ValueError, match="no Lightning mixed precision"):
        lightning_precision("fp64")


def test_the_training_precisions_and_their_other_names():
    assert TRAINING_PRECISIONS == ("32-true", "16-mixed", "bf16-mixed")
    assert [lightning_precision(p) for p in TRAINING_PRECISIONS] == list(TRAINING_PRECISIONS)
    assert [dtype_name(p) for p in TRAINING_PRECISIONS] == ["float32", "float16", "bfloat16"]
    assert [itemsize(p) for p in TRAINING_PRECISIONS] == [4, 2, 2]
    assert [is_mixed(p) for p in TRAINING_PRECISIONS] == [False, True, True]
    assert not is_mixed("fp64") and is_mixed("bf16-true")
    with pytest.raises(ValueError, match="train in 32-true, 16-mixed, bf16-mixed"):
        lightning_precision("64-true")
    with pytest.raises(ValueError, match="no short precision name"):
        short_name(torch.int8)  # compute_dtype's Transformer Engine stand-in


def test_the_best_16_bit_precision_is_bf16_where_the_device_has_it():
    assert best_mixed_precision(True) == "bf16-mixed"
    assert best_mixed_precision(False) == "16-mixed"  # V100, T4: fp16 with a GradScaler


def test_is_fp16_only_for_float16():
    assert all(is_fp16(s) for s in ("16-mixed", "16-true", "fp16", "half", "float16", 16, torch.float16))
    assert not any(is_fp16(s) for s in ("bf16-mixed", "bf16-true", "bf16", "32-true", "fp32", None, torch.float64))


@pytest.mark.parametrize("precision", ["32-true", "fp32", None, "fp64"])
def test_autocast_is_a_no_op_for_full_precision(precision):
    a = torch.randn(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.autocast(dtype=float32) would warn and disable itself
        with autocast("cpu", precision):
            assert not torch.is_autocast_enabled("cpu")
            assert (a @ a).dtype == torch.float32


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_autocast_casts_matmuls_to_the_16_bit_dtype(precision):
    a = torch.randn(4, 4)
    with autocast("cpu", precision):
        assert torch.is_autocast_enabled("cpu")
        assert (a @ a).dtype == torch.bfloat16
    assert (a @ a).dtype == torch.float32


def _trainer(precision="32-true", strategy=None):
    return SimpleNamespace(precision=precision, strategy=strategy if strategy is not None else SimpleNamespace())


def test_compute_dtype_follows_the_precision_plugin_without_a_strategy_policy():
    assert compute_dtype(_trainer("32-true")) is torch.float32
    assert compute_dtype(_trainer("bf16-mixed")) is torch.bfloat16
    assert compute_dtype(_trainer("16-mixed")) is torch.float16
    assert compute_dtype(SimpleNamespace(precision="bf16-true")) is torch.bfloat16  # no strategy attribute
    assert compute_dtype(SimpleNamespace()) is torch.float32  # nothing set: full precision
    # a strategy whose policy leaves the parameter dtype unset does not decide
    unset = [
        SimpleNamespace(fsdp_options={"param_dtype": None, "reduce_dtype": torch.float32}),
        SimpleNamespace(fsdp_options={}),
        SimpleNamespace(fsdp_options=None, mixed_precision=None),
        SimpleNamespace(mixed_precision=SimpleNamespace(param_dtype=None, reduce_dtype=torch.float32)),
    ]
    for strategy in unset:
        assert strategy_param_dtype(strategy) is None
        assert compute_dtype(_trainer("bf16-mixed", strategy)) is torch.bfloat16


def test_compute_dtype_prefers_the_strategys_param_dtype_over_the_trainer_precision():
    fsdp2 = SimpleNamespace(fsdp_options={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    assert compute_dtype(_trainer("32-true", fsdp2)) is torch.bfloat16
    fsdp2_fp16 = SimpleNamespace(fsdp_options={"param_dtype": torch.float16})
    assert compute_dtype(_trainer("bf16-mixed", fsdp2_fp16)) is torch.float16
    fsdp1 = SimpleNamespace(mixed_precision=SimpleNamespace(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert compute_dtype(_trainer("32-true", fsdp1)) is torch.bfloat16
    fsdp1_fp32 = SimpleNamespace(mixed_precision=SimpleNamespace(param_dtype=torch.float32))
    assert compute_dtype(_trainer("bf16-mixed", fsdp1_fp32)) is torch.float32


def test_transformer_engine_counts_as_int8():
    assert compute_dtype(_trainer("transformer-engine")) is torch.int8
    assert compute_dtype(_trainer("transformer-engine-float16")) is torch.int8


def test_the_real_strategies_expose_what_compute_dtype_reads():
    """The stand-ins above have the attribute names of the project's strategies."""
    from dit_lightning.distributed import DiTFSDP2Strategy, DiTFSDPStrategy

    assert strategy_param_dtype(DiTFSDP2Strategy(param_dtype="bf16")) is torch.bfloat16
    assert strategy_param_dtype(DiTFSDP2Strategy()) is None
    assert strategy_param_dtype(DiTFSDPStrategy(param_dtype="float16")) is torch.float16
    assert strategy_param_dtype(DiTFSDPStrategy()) is None
