"""Unwritable and full outputs: every output location is tried before the first step (or the first
sample), results are printed before they are written, and a full disk reads as one and leaves the
previous checkpoint as it was (no partial files)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.cli import DEMO, ROOT, TINY, run_cli
from tests.reliability.conftest import call, fit, one_message

pytestmark = pytest.mark.usefixtures("one_thread")


def _full_disk(directory, files, args, cwd) -> subprocess.CompletedProcess:
    """``dit-lightning ARGS`` on a disk that fills up under ``directory`` after ``files`` files
    (``"N:B"``: and B bytes of the next one)."""
    return subprocess.run(
        [sys.executable, "-m", "tests.helpers.full_disk", str(directory), str(files), "--", *args],
        cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.parametrize(
    "option, what",
    [("--checkpoint.dirpath", "checkpoint directory"), ("--trainer.logger.save_dir", "log directory")],
)
def test_an_unwritable_checkpoint_or_log_directory_fails_before_training(digits, tmp_path, capsys, option, what):
    """It was found only at the first save, after training up to it."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be")
    code, out, err = call([*fit(tmp_path, "run", 4, digits), option, str(blocker / "sub")], capsys)
    assert code == 1 and f"cannot write the {what}" in err and f"{blocker} is a file" in err and option in err, err
    assert "nothing was trained yet" in err and "step" not in out
    one_message(err)


@pytest.mark.slow
def test_an_unwritable_sample_grid_fails_before_the_first_step(digits, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    args = fit(tmp_path, "run", 4, digits, [
        "--trainer.callbacks+=dit_lightning.callbacks.SampleGrid", "--trainer.callbacks.output", str(blocker / "g.png"),
        "--trainer.callbacks+=tests.helpers.cli.PrintStep",
    ])  # fmt: skip
    proc = run_cli(args, tmp_path, check=False)
    assert proc.returncode == 1 and "cannot write the sample grid's directory" in proc.stderr, proc.stderr[-2000:]
    assert "the SampleGrid's output" in proc.stderr and "step 1" not in proc.stdout


def test_test_checks_its_metrics_file_first_and_prints_results_before_writing(trained, digits, tmp_path):
    """`test` sampled and scored everything, then failed to write, never printing the results."""
    base = ["test", "--config", DEMO, *TINY, "--data.path", str(digits), "--trainer.logger", "false",
            "--evaluation.num_samples", "20", "--evaluation.num_steps", "3", "--ckpt_path", str(trained)]  # fmt: skip
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    proc = run_cli([*base, "--evaluation.output", str(blocker / "m.json")], tmp_path, check=False)
    assert proc.returncode == 1 and "cannot write the metrics file's directory" in proc.stderr
    assert "--evaluation.output" in proc.stderr and "test/digits_accuracy" not in proc.stdout
    # a disk that fills up just before the metrics are written: they are on the screen anyway
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    proc = _full_disk(metrics_dir, "0:0", [*base, "--evaluation.output", str(metrics_dir / "m.json")], tmp_path)
    assert proc.returncode == 1 and f"no space left on {metrics_dir}" in proc.stderr, proc.stderr[-2000:]
    assert "test metrics: " in proc.stdout and '"digits_accuracy"' in proc.stdout
    assert os.listdir(metrics_dir) == []


def test_a_full_disk_reads_as_one_and_keeps_the_last_checkpoint(digits, tmp_path):
    """It read "131072 requested and 85952 written" (or "unexpected pos"), naming no disk."""
    ckpt_dir = tmp_path / "run" / "ckpt"
    proc = _full_disk(ckpt_dir, 2, fit(tmp_path, "run", 8, digits), tmp_path)  # room for step 4's two files
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"no space left on {ckpt_dir} while writing epoch=0-step=8.ckpt" in proc.stderr
    assert "free some space there or write to another disk" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=0-step=4.ckpt", "last.ckpt"]  # no partial or temporary file
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=True)["global_step"] == 4
