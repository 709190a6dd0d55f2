"""SIGTERM (scancel, pre-emption, Kubernetes), Ctrl-C and SIGUSR1 during `fit` saved nothing and
SIGTERM exited with status 0: now the step in progress finishes, `last.ckpt` is written
atomically, the process exits with 128 + the signal, and resuming continues bit for bit. A
checkpoint write killed half-way leaves a temporary file, removed by the next run, and resuming
into the run's directory adds no `-v1` duplicates."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import ROOT, run_cli
from tests.reliability.conftest import fit

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 12


def losses(run_dir: Path) -> dict[int, str]:
    with open(run_dir / "metrics.csv") as f:
        return {int(r["step"]): r["train/loss"] for r in csv.DictReader(f) if r.get("train/loss")}


@pytest.fixture(scope="module")
def uninterrupted(digits, tmp_path_factory) -> dict[int, str]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    run_cli(fit(tmp, "full", STEPS, digits), tmp)
    return losses(tmp / "full")


def test_sigterm_checkpoints_exits_143_and_resumes_bit_for_bit(digits, uninterrupted, tmp_path):
    args = fit(tmp_path, "run", STEPS, digits, ["--trainer.callbacks+=tests.helpers.cli.PrintStep"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "dit_lightning.cli", *args], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:  # a live run, signalled from outside like `kill` / `scancel` do
        if line.strip() == "step 5":
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    ckpt_dir = tmp_path / "run" / "ckpt"
    saved = torch.load(ckpt_dir / "last.ckpt", weights_only=True)["global_step"]
    assert 5 <= saved < STEPS and f"stopped by SIGTERM after step {saved}: saved {ckpt_dir / 'last.ckpt'}" in out
    assert "SIGTERM received: finishing the current step" in err
    # a write killed half-way left a temporary file as large as a checkpoint: the next run removes it
    stale = ckpt_dir / ".last.ckpt.k1lled_1.tmp"
    stale.write_bytes(b"\0" * 100_000)
    resumed = run_cli(fit(tmp_path, "run", STEPS, digits, ["--ckpt_path", str(ckpt_dir / "last.ckpt")]), tmp_path)
    assert not stale.exists() and "a checkpoint save that was interrupted" in resumed.stderr
    assert not [p.name for p in ckpt_dir.iterdir() if "-v" in p.name]
    got = losses(tmp_path / "run")
    assert [s for s in got if s >= saved] == list(range(saved, STEPS))
    assert all(got[s] == uninterrupted[s] for s in range(saved, STEPS)), (got, uninterrupted)


@pytest.mark.parametrize("name, code", [("SIGINT", 130), pytest.param("SIGUSR1", 138, marks=pytest.mark.slow)])
def test_ctrl_c_and_sigusr1_checkpoint_and_exit_non_zero(digits, tmp_path, name, code):
    signum = int(getattr(signal, name))
    args = fit(tmp_path, "run", 40, digits, [
        "--trainer.callbacks+=tests.helpers.cli.SignalAtStep", "--trainer.callbacks.step", "2",
        "--trainer.callbacks.signum", str(signum),
    ])  # fmt: skip
    proc = run_cli(args, tmp_path, check=False)
    assert proc.returncode == code, proc.stderr[-3000:]
    assert torch.load(tmp_path / "run" / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert f"stopped by {name}" in proc.stdout and "resume with --ckpt_path last" in proc.stdout
