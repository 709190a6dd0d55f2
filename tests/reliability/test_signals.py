"""SIGTERM (scancel, pre-emption, Kubernetes), Ctrl-C and SIGUSR1 during `fit` saved nothing and
SIGTERM exited with status 0: now the step in progress finishes, `last.ckpt` is written
atomically, the process exits with 128 + the signal, and resuming continues bit for bit. A
checkpoint write killed half-way leaves a temporary file, removed by the next run, and resuming
into the run's directory adds no `-v1` duplicates.

A second SIGTERM during `fit` exited 0 (Lightning's handler took it), and SIGTERM did not stop
`test` (its sampling went on, twice signalled): every command now stops on the first signal at
a safe point (`validate` / `test` / `predict` at the batch or sampling step in progress; the
tools at the next denoising step, batch or shard) with 143 / 130, one line saying what is kept and
how to resume, nothing half-written, and at once on the second signal."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import DEMO, ROOT, TINY, run_cli
from tests.helpers.data import make_image_folder, make_tiny_vae
from tests.helpers.signals import run_signalled
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
    assert sorted(got) == list(range(STEPS))  # the steps before the stop kept their rows too
    assert got == uninterrupted, (got, uninterrupted)


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


def temporaries(root: Path) -> list[str]:
    """Files and directories of writes cut short (``.<name>.<8 characters>.tmp``) under ``root``."""
    return [str(p) for p in root.rglob(".*.tmp")]


def test_a_second_sigterm_stops_fit_at_once_with_143_not_0(digits, tmp_path):
    """`scancel` twice, or a supervisor's escalation: the second SIGTERM arrives while last.ckpt is
    being written; the run stops there, keeps the previous checkpoint and says so."""
    args = fit(tmp_path, "run", 12, digits, [
        "--checkpoint.every_n_train_steps", "2",
        "--trainer.callbacks+=tests.helpers.cli.SignalAt", "--trainer.callbacks.hook", "on_train_batch_end",
        "--trainer.callbacks.step", "3",
        "--trainer.callbacks+=tests.helpers.cli.SignalAt", "--trainer.callbacks.hook", "on_save_checkpoint",
        "--trainer.callbacks.step", "3",
    ])  # fmt: skip
    proc = run_cli(args, tmp_path, check=False)
    assert proc.returncode == 143, proc.stderr[-3000:]
    ckpt_dir = tmp_path / "run" / "ckpt"
    assert "SIGTERM received: finishing the current step" in proc.stderr and "received again" in proc.stderr
    assert (
        f"dit-lightning fit: stopped at once by a second SIGTERM: at step 3: the last checkpoint, "
        f"{ckpt_dir / 'last.ckpt'} (step 2), was written before and is kept; resume with --ckpt_path last"
        in proc.stdout
    )
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=True)["global_step"] == 2
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=0-step=2.ckpt", "last.ckpt"] and not temporaries(tmp_path)


def test_two_sigterms_inside_the_runs_first_checkpoint_write_exit_143_not_1(digits, tmp_path):
    """Both SIGTERMs of `scancel` twice land inside torch.save of the run's first checkpoint: the second
    stops at once, and torch's zip writer then failed on its half-written record, so the run exited 1
    with "[enforce fail at inline_container.cc:672]" instead of the signal's status and line."""
    args = fit(tmp_path, "run", 12, digits)  # the first checkpoint: step 4
    proc = run_signalled("write:epoch=0-step=4.ckpt", "TERM,TERM", args, tmp_path)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "inline_container" not in proc.stdout + proc.stderr and "received again: stopping at once" in proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == (
        "dit-lightning fit: stopped at once by a second SIGTERM: at step 4: no checkpoint was written."
    ), proc.stdout[-2000:]
    assert os.listdir(tmp_path / "run" / "ckpt") == [] and not temporaries(tmp_path)


@pytest.mark.parametrize(
    "command, signum, hook, kept",
    [
        ("validate", "SIGTERM", "on_validation_batch_end", "nothing was logged or written"),
        ("test", "SIGINT", "on_test_epoch_end", "nothing was logged or written"),  # in GenerationMetrics' sampling
        ("predict", "SIGTERM", "on_predict_batch_end", "the images already in"),
    ],
    ids=["validate", "test", "predict"],
)
def test_validate_test_and_predict_stop_on_the_first_signal(trained, digits, tmp_path, command, signum, hook, kept):
    code = 128 + int(getattr(signal, signum))
    logs, predictions, metrics = tmp_path / "logs", tmp_path / "predictions", tmp_path / "metrics.json"
    args = [
        command, "--config", DEMO, *TINY, "--data.path", str(digits), "--ckpt_path", str(trained),
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(logs),
        "--evaluation.num_samples", "20", "--evaluation.num_steps", "3", "--evaluation.output", str(metrics),
        "--data.predict_num_samples", "8", "--model.sample_steps", "3",
        *(["--data.global_batch_size", "4"] if command == "predict" else []),
        "--trainer.callbacks+=dit_lightning.callbacks.PredictionWriter", "--trainer.callbacks.output_dir",
        str(predictions),
        "--trainer.callbacks+=tests.helpers.cli.SignalAt", "--trainer.callbacks.hook", hook,
        "--trainer.callbacks.signum", str(code - 128),
    ]  # fmt: skip
    proc = run_cli(args, tmp_path, check=False)
    assert proc.returncode == code, proc.stderr[-3000:]
    name = "SIGINT (Ctrl-C)" if signum == "SIGINT" else signum
    assert f"dit-lightning {command}: {name} received: stopping at the next safe point" in proc.stderr
    assert f"dit-lightning {command}: stopped by {name}: {kept}" in proc.stdout, proc.stdout[-2000:]
    assert "run the same command again" in proc.stdout
    assert not list(logs.rglob("metrics.csv")) and not metrics.exists() and not temporaries(tmp_path)
    if command == "predict":  # the first batch of 4, each PNG whole; no more
        assert sorted(p.name for p in predictions.iterdir()) == [f"00000{i}-c{i}.png" for i in range(4)]


@pytest.fixture(scope="module")
def images_and_vae(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("extract")
    make_image_folder(str(tmp / "images"), with_bad=False)  # 9 images
    return tmp / "images", Path(make_tiny_vae(str(tmp / "vae")))


def _sample(out: Path, trained: Path) -> list[str]:
    # 12 samples in 3 batches of 4, 4 steps: safe points 1-5 are batch 1 (its start, its steps), 7 batch 2's 1st step
    return ["--checkpoint", str(trained), "--output", str(out), "--num_samples", "12", "--batch_size", "4",
            "--num_steps", "4", "--labels", "0-9", "--device", "cpu"]  # fmt: skip


@pytest.mark.parametrize("tool, signals, at", [
    ("sample", "TERM", 7), ("evaluate", "INT,INT", 7), ("extract", "TERM", 4), ("export", "TERM", 1),
])  # fmt: skip
def test_the_tools_stop_on_the_first_signal_resumable_and_at_once_on_the_second(
    tool, signals, at, trained, images_and_vae, tmp_path
):
    out = tmp_path / "out"
    args = {
        "sample": ["sample", *_sample(out, trained)],
        "evaluate": ["evaluate", *_sample(out, trained), "--metrics", "digits"],
        # 9 images in shards of 2, one per batch: before the 4th, shard 0 is written and shard 1 half-done
        "extract": ["extract", "--image_root", str(images_and_vae[0]), "--output", str(out), "--vae",
                    str(images_and_vae[1]), "--image_size", "16", "--shard_size", "2", "--batch_size", "1",
                    "--num_workers", "0", "--device", "cpu", "--progress", "false"],
        # the one safe point of an export: the checkpoint is read, nothing is written yet
        "export": ["export", "--checkpoint", str(trained), "--output", str(out), "--format", "raw"],
    }[tool]  # fmt: skip
    names = [("SIGINT (Ctrl-C)" if n == "INT" else f"SIG{n}") for n in signals.split(",")]
    proc = run_signalled(at, signals, args, tmp_path)
    assert proc.returncode == 128 + int(getattr(signal, f"SIG{signals.split(',')[0]}")), proc.stderr[-3000:]
    assert f"dit-lightning {tool}: {names[0]} received: stopping at the next safe point" in proc.stderr
    how = f"at once by a second {names[0]}" if len(names) > 1 else f"by {names[0]}"
    stopped = proc.stdout.strip().splitlines()[-1]
    assert stopped.startswith(f"dit-lightning {tool}: stopped {how}: "), proc.stdout[-2000:]
    assert "run the same command again" in stopped and not temporaries(tmp_path)
    if tool == "export":
        assert "nothing was written" in stopped and not os.path.exists(out) and not os.path.exists(f"{out}.json")
        return
    if tool == "extract":
        assert f"1 of 5 shards of {out} are written (each whole)" in stopped
        shards = sorted(p.name for p in (out / "shards").iterdir())
        assert shards == ["shard-00000.json", "shard-00000.labels.npy", "shard-00000.npy"]  # shard 1 was dropped
        assert not (out / "meta.json").exists()
    else:
        assert f"4 of 12 samples are in {out / 'samples'} (each written whole)" in stopped
        assert len(list((out / "samples").iterdir())) == 4 and sorted(p.name for p in out.iterdir()) == [
            "sample_config.json", "samples"]  # no grid, no .npz, no metrics.json  # fmt: skip
    if signals != "TERM":
        return
    resumed = run_cli(args, tmp_path)  # the same command resumes from what was kept
    if tool == "extract":
        assert json.loads((out / "meta.json").read_text())["count"] == 9
    else:
        assert "8 samples to make, 4 already on disk" in resumed.stderr and (out / "samples.npz").exists()
