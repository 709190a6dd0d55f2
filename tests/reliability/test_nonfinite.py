"""A store holding NaN trained to a NaN loss with exit status 0 and saved all-NaN weights as
``last.ckpt``: now the run stops at the first non-finite loss (or after the allowed patience) with
a clear error, and no checkpoint is written from non-finite weights."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tests.helpers.cli import run_cli
from tests.reliability.conftest import fit

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def poisoned(digits_copy):
    """The digits store with NaN in every sample of its first shard, written in place (same sizes:
    opening it does not notice; `verify` and the checksums do)."""
    data = np.load(digits_copy / "shards" / "shard-00000.npy", mmap_mode="r+")
    data[:, 0, 0, 0, 0, 0] = np.nan
    data.flush()
    del data
    return digits_copy


@pytest.fixture
def resumable(trained, tmp_path):
    """A copy of the 4-step run's last.ckpt in a fresh checkpoint directory."""
    ckpt_dir = tmp_path / "run" / "ckpt"
    ckpt_dir.mkdir(parents=True)
    return shutil.copy(trained, ckpt_dir / "last.ckpt")


def test_a_nan_loss_stops_the_run_and_keeps_the_good_checkpoint(poisoned, resumable, tmp_path):
    before = open(resumable, "rb").read()
    proc = run_cli(fit(tmp_path, "run", 8, poisoned, ["--ckpt_path", str(resumable)]), tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "the training loss is NaN or inf at step 5: training stopped" in proc.stderr
    assert "(step 4), was written before and is kept" in proc.stderr and "dit-lightning verify" in proc.stderr
    assert "nonfinite_patience" in proc.stderr and "Traceback" not in proc.stderr
    assert open(resumable, "rb").read() == before
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir()) == ["last.ckpt"]


@pytest.mark.slow
def test_with_patience_no_checkpoint_is_written_from_non_finite_weights(poisoned, resumable, tmp_path):
    before = open(resumable, "rb").read()
    args = fit(
        tmp_path, "run", 8, poisoned, ["--ckpt_path", str(resumable), "--fault_tolerance.nonfinite_patience", "9"]
    )
    proc = run_cli(args, tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "the weights hold NaN or inf at step 8: no checkpoint was written from them" in proc.stderr
    assert open(resumable, "rb").read() == before
    assert torch.load(resumable, weights_only=True)["global_step"] == 4
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir()) == ["last.ckpt"]
