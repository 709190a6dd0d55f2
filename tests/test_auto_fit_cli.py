"""`dit-lightning fit --auto_fit ...`: the table before training, explicit settings kept, "nothing fits"
before step 1, a back-off that survives kill -9 and resume, the give-up checkpoint, and two DDP ranks
backing off together when one runs out. The device is the test device model
(tests/helpers/device_model.py), loaded by the CLI like any callback."""

from __future__ import annotations

import contextlib
import csv
import io
import os
from pathlib import Path

import pytest
import torch

from dit_lightning.cli import main
from tests.helpers.cli import fit_args, run_cli

# One intra-op thread in this process (the in-process runs) and in the subprocesses: a tiny model's
# steps gain nothing from more, and on a busy 2-core machine the threads' spin-waits cost seconds.
pytestmark = pytest.mark.usefixtures("one_omp_thread")

BUDGET = ["--auto_fit.memory_gib", "0.004"]  # the planner then starts the shrunk demo at 32 x 1 (3.91 MiB)


def device(capacity_mib: float = 2.65, from_step: int = 3, *extra: str) -> list[str]:
    """The simulated device: 2.65 MiB holds 16 x 2 (2.53 MiB), not 32 x 1 (3.91 MiB) nor 32 x 1 with a block
    recomputed (2.68 MiB)."""
    return [
        "--trainer.callbacks+=tests.helpers.device_model.SimulatedDevice",
        "--trainer.callbacks.capacity_mib",
        str(capacity_mib),
        "--trainer.callbacks.from_step",
        str(from_step),
        *extra,
    ]


def run_main(args: list[str]) -> tuple[int, str, str]:
    """``dit-lightning ARGS`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
        except SystemExit as e:
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


def logged(run_dir: Path, key: str) -> dict[int, float]:
    with open(run_dir / "metrics.csv") as f:
        return {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key)}


@pytest.fixture(scope="module")
def one_omp_thread():
    before, threads = os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if before is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = before


@pytest.fixture(scope="module")
def reference(tmp_path_factory, one_omp_thread) -> Path:
    """10 steps of the shrunk demo with auto-fit, the device model and its back-offs at step 3, uninterrupted."""
    tmp = tmp_path_factory.mktemp("auto_fit")
    code, out, err = run_main(fit_args(tmp, "full", 10, [*BUDGET, *device()]))
    assert code == 0, err[-3000:]
    assert "chosen     32 x 1 x 1" in out and "back-off 2 of 4" in out and "redoing step 3" in out
    return tmp


def test_a_back_off_survives_kill_9_and_the_resumed_run_starts_with_it(reference):
    tmp = reference
    killed = run_cli(
        fit_args(
            tmp,
            "killed",
            10,
            [*BUDGET, *device(), "--trainer.callbacks+=tests.helpers.cli.KillAtStep", "--trainer.callbacks.step", "6"],
        ),
        tmp,
        check=False,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert "back-off 2 of 4" in killed.stdout  # it backed off at step 3, then checkpointed at step 4
    ckpt = tmp / "killed" / "ckpt" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["callbacks"]["AutoFit"]["setting"]["micro_batch"] == 16
    code, out, err = run_main(fit_args(tmp, "killed", 10, [*BUDGET, *device(), "--ckpt_path", str(ckpt)]))
    assert code == 0, err[-3000:]
    assert "resuming with the setting in force at step 4" in out and "chosen  16 x 1 x 2" in out
    assert "out of memory" not in out  # the device model would refuse the first setting: it was not tried again
    full, resumed = logged(tmp / "full", "train/loss"), logged(tmp / "killed", "train/loss")
    assert sorted(resumed) == list(range(10))  # the killed run's rows are kept (the resumed run appends)
    for step, loss in resumed.items():
        assert abs(loss - full[step]) <= 1e-6, (step, resumed, full)
    backoffs = logged(tmp / "killed", "auto_fit/backoffs")
    assert {n for step, n in backoffs.items() if step >= 4} == {2.0}  # the count came with the checkpoint


def test_explicit_settings_are_kept_through_the_decision_and_the_back_off(tmp_path):
    args = fit_args(tmp_path, "kept", 3, [*BUDGET, *device(from_step=1), "--model.activation_checkpointing", "none"])
    code, out, err = run_main(args)
    assert code == 0, err[-3000:]
    assert "kept as given: trainer.precision=32-true, model.activation_checkpointing=none" in out
    assert "-> 16x2 recompute none" in out  # the back-off halves the micro-batch: the blocks were given
    assert set(logged(tmp_path / "kept", "auto_fit/checkpointed_blocks").values()) == {0.0}
    assert logged(tmp_path / "kept", "auto_fit/micro_batch") == {0: 32.0, 1: 16.0, 2: 16.0}
    # the precision is chosen only when unset (on CPU: fp32)
    code, out, _ = run_main(fit_args(tmp_path, "free", 1, [*BUDGET, "--trainer.precision", "null"]))
    assert code == 0 and "kept as given" not in out and "32-true" in out


def test_nothing_fits_stops_before_step_1_and_says_what_would(tmp_path):
    code, out, err = run_main(fit_args(tmp_path, "small", 3, ["--auto_fit.memory_gib", "0.0005"]))
    assert code == 1
    assert "nothing fits" in err and "needs at least 1.15 MiB per device" in err and "No step was run" in err
    assert "--model.ema false" in err and "Traceback" not in err
    assert not (tmp_path / "small" / "metrics.csv").exists() and not (tmp_path / "small" / "ckpt").exists()
    code, _, err = run_main(fit_args(tmp_path, "cpu", 3, ["--auto_fit", "true"]))
    assert code == 1 and "--auto_fit.memory_gib" in err  # on CPU there is no free memory to read


def test_giving_up_saves_the_last_completed_step(tmp_path):
    # with the split given (accumulate 1: micro-batch 32), recomputing blocks is the only lever; not enough
    args = fit_args(tmp_path, "stuck", 4, [*BUDGET, *device(from_step=2), "--trainer.accumulate_grad_batches", "1"])
    code, out, err = run_main(args)
    assert code == 1 and "back-off 1 of 4" in out
    assert "no safer setting is left with trainer.accumulate_grad_batches kept as given" in err
    assert "nothing is lost" in err and "Traceback" not in err
    ckpt = tmp_path / "stuck" / "ckpt" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)
    assert state["global_step"] == 2 and state["callbacks"]["AutoFit"]["backoffs"] == 1
    # resumed with the lever back (the accumulation left to auto-fit), it goes on from step 2
    code, out, err = run_main(fit_args(tmp_path, "stuck", 4, [*BUDGET, *device(from_step=2), "--ckpt_path", str(ckpt)]))
    assert code == 0, err[-3000:]
    assert sorted(logged(tmp_path / "stuck", "train/loss")) == [0, 1, 2, 3]  # steps 0-1 kept, 2-3 appended


def test_ddp_ranks_back_off_together_when_one_runs_out(reference, tmp_path):
    """Two CPU processes (gloo): only rank 1's device runs out, at step 2; both back off to the same
    setting, redo the step and finish, and the losses are the one-process run's."""
    proc = run_cli(
        fit_args(
            tmp_path,
            "ddp",
            6,
            [
                "--auto_fit.memory_gib",
                "0.003",  # 16 x 2 devices x 1 (2.53 MiB)
                *device(2.0, 2, "--trainer.callbacks.ranks", "[1]"),
                "--trainer.accelerator",
                "cpu",
                "--trainer.devices",
                "2",
                "--trainer.strategy",
                "ddp",
            ],
        ),
        tmp_path,
    )
    assert "chosen     16 x 2 x 1" in proc.stdout
    assert "(rank 1 ran out of memory); back-off 1 of 4" in proc.stdout and "redoing step 2" in proc.stdout
    losses = logged(tmp_path / "ddp", "train/loss")
    assert sorted(losses) == list(range(6))
    full = logged(reference / "full", "train/loss")
    for step, loss in losses.items():
        assert abs(loss - full[step]) <= 1e-6, (step, losses, full)
    assert logged(tmp_path / "ddp", "auto_fit/backoffs") == {0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}
