"""The `dit-lightning` CLI: config merging and validation, every shipped config, a killed run
resuming bit for bit, predict / test from a checkpoint, and the tools' help."""

import csv
import json
from pathlib import Path

import pytest

from dit_lightning.cli import main
from tests.helpers.cli import DEMO, ROOT, TINY, fit_args, run_cli


def losses(run_dir: Path) -> dict[int, str]:
    with open(run_dir / "metrics.csv") as f:
        return {int(r["step"]): r["train/loss"] for r in csv.DictReader(f) if r.get("train/loss")}


def test_print_config_merges_configs_and_overrides(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(
            [
                "fit",
                "--config",
                DEMO,
                "--config",
                str(ROOT / "configs/hardware/cpu.yaml"),
                "--model.depth",
                "3",
                "--print_config",
            ]
        )
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "depth: 3" in out and "precision: 32-true" in out and "accelerator: cpu" in out
    assert "latent_shape" not in out.split("data:")[0].split("model:")[1]  # linked, not configurable


def test_batch_that_does_not_divide_fails_before_training(tmp_path):
    proc = run_cli(
        fit_args(tmp_path, "bad", 2, ["--data.global_batch_size", "30", "--trainer.accumulate_grad_batches", "4"]),
        tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    assert "global_batch_size 30" in proc.stderr and "accumulat" in proc.stderr


# (a patch size that does not divide the latent, an unknown model name...: tests/reliability/test_bad_inputs.py)


ABBREVIATED = {
    "fit": (["--config", DEMO, "--trainer.max_step", "10"], "--trainer.max_steps"),
    "validate": (["--config", DEMO, "--ckpt_pat", "last"], "--ckpt_path"),
    "sample": (["--checkpoint", "x.pt", "--output", "out", "--num_step", "3"], "--num_steps"),
    "evaluate": (["--checkpoint", "x.pt", "--output", "out", "--num_sample", "10"], "--num_samples"),
    "extract": (["--image_ro", "images", "--output", "out"], "--image_root"),
    "export": (["--checkpoint", "x.pt", "--output", "out", "--form", "raw"], "--format"),
    "consolidate": (["--check", "x", "--output", "out"], "--checkpoint"),
    "prune": (["--checkpoint", "x.pt", "--output", "out", "--dept", "3"], "--depth"),
    "plan": (["--gpu", "rtx4090", "--micro", "8"], "--micro_batch"),
    "verify": (["--pat", "x"], "--path"),
    "prepare-digits": (["--outpu", "out"], "--output"),
}


@pytest.mark.parametrize("command", list(ABBREVIATED))
def test_an_abbreviated_option_is_refused_with_the_full_one(command, capsys, tmp_path, monkeypatch):
    """`fit --trainer.max_step 10` silently became max_steps 10 (argparse's allow_abbrev)."""
    monkeypatch.chdir(tmp_path)  # were an abbreviation taken, the command would run here
    args, full = ABBREVIATED[command]
    given = next(a for a in args if a.startswith("--") and full.startswith(a) and a != full)
    with pytest.raises(SystemExit) as e:
        main([command, *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"unknown option {given}; did you mean {full}" in err, err
    assert "Traceback" not in err


def test_killed_run_resumes_bit_for_bit(tmp_path):
    """A run SIGKILLed mid-epoch and resumed from last.ckpt logs exactly the losses of an
    uninterrupted run (12 steps, checkpoints every 4, killed after step 10)."""
    run_cli(fit_args(tmp_path, "full", 12), tmp_path)
    killed = run_cli(
        fit_args(
            tmp_path,
            "killed",
            12,
            ["--trainer.callbacks+=tests.helpers.cli.KillAtStep", "--trainer.callbacks.step", "10"],
        ),
        tmp_path,
        check=False,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    ckpt = tmp_path / "killed" / "ckpt" / "last.ckpt"
    assert ckpt.exists()
    run_cli(fit_args(tmp_path, "killed", 12, ["--ckpt_path", str(ckpt)]), tmp_path)
    full, resumed = losses(tmp_path / "full"), losses(tmp_path / "killed")
    assert len(full) >= 12
    resumed_steps = [s for s in resumed if s >= 8]
    assert resumed_steps and all(resumed[s] == full[s] for s in resumed_steps), (full, resumed)


def test_a_resumed_run_continues_in_its_directory_and_records_its_config_at_the_checkpoints_step(tmp_path):
    """With run directories (no logger version, no checkpoint dirpath), `--ckpt_path last` resumes
    version_0 in place; the resumed config is named after the step read from the checkpoint."""
    args = fit_args(tmp_path, "runs", 2)
    for option in ("--trainer.logger.version", "--checkpoint.dirpath"):
        i = args.index(option)
        del args[i : i + 2]
    run_cli(args, tmp_path)
    run = tmp_path / "runs" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "config.yaml").is_file()
    args[args.index("--trainer.max_steps") + 1] = "3"
    run_cli([*args, "--ckpt_path", "last"], tmp_path)
    assert (run / "config-resumed-from-step-2.yaml").is_file() and not (tmp_path / "runs" / "version_1").exists()
    # the run's CSV log keeps the first fit's rows (Lightning's CSVLogger deletes the file it finds)
    assert set(losses(tmp_path / "runs" / "version_0")) == {0, 1, 2}
    run_cli(["test", *args[1:], "--ckpt_path", "last"], tmp_path)
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert {int(r["step"]) for r in rows if r.get("train/loss")} == {0, 1, 2}
    assert [int(r["step"]) for r in rows if r.get("test/loss")] == [3]  # the last checkpoint's step


def test_continued_runs_keep_every_metrics_row_whatever_the_loggers_layout(tmp_path):
    """A named logger version with checkpoints elsewhere (not <root>/version_K/checkpoints): `validate`
    and a resumed `fit` deleted the run's metrics.csv (Lightning's CSVLogger), and `--ckpt_path last`
    looked for the link under the logger's root, not in --checkpoint.dirpath where the fit wrote it."""
    args = fit_args(tmp_path, "runs", 2)
    args[args.index("--trainer.logger.version") + 1] = "first"
    args[args.index("--checkpoint.dirpath") + 1] = str(tmp_path / "elsewhere")
    run_cli(args, tmp_path)
    metrics = tmp_path / "runs" / "first" / "metrics.csv"
    history = metrics.read_bytes()
    assert set(losses(metrics.parent)) == {0, 1} and history.count(b"\n") == 3  # the header and two rows
    run_cli(["validate", *args[1:], "--ckpt_path", "last"], tmp_path)
    after = metrics.read_bytes()
    rows = list(csv.DictReader(open(metrics)))
    assert len(after) > len(history) and len(rows) == 3 and set(losses(metrics.parent)) == {0, 1}
    assert [int(r["step"]) for r in rows if r.get("val/loss")] == [2]  # the checkpoint's step
    args[args.index("--trainer.max_steps") + 1] = "3"
    resumed = run_cli([*args, "--ckpt_path", "last"], tmp_path)
    rows = list(csv.DictReader(open(metrics)))
    assert set(losses(metrics.parent)) == {0, 1, 2} and len(rows) == 4 and metrics.stat().st_size > len(after)
    # the fit names its run first; resuming into its own checkpoint directory is no cause for a warning
    first_line = "fit: run runs/first; checkpoints in elsewhere; resuming step 2 of elsewhere/last.ckpt"
    assert resumed.stdout.splitlines()[0] == first_line  # (paths shown relative to the working directory)
    assert "exists and is not empty" not in resumed.stderr


CONFIGS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml") if p.name != "demo.yaml")


@pytest.mark.parametrize("config", CONFIGS)
def test_every_config_parses_on_top_of_the_demo(config, capsys):
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", DEMO, "--config", str(ROOT / config), "--print_config"])
    assert e.value.code == 0, capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["ddpm", "flow-repa"])
def test_predict_and_test_from_a_checkpoint(tmp_path, recipe):
    objective = []
    if recipe == "flow-repa":  # flow matching with REPA, its encoder made as docs/recipes.md says (a few steps)
        encoder = ["--encoder", str(tmp_path / "encoder.pt"), "--encoder_steps", "3"]
        run_cli(["prepare-digits", "--output", str(tmp_path / "digits"), *encoder], tmp_path)
        objective = [
            "--model.objective", "flow", "--model.repa.encoder", "dit_lightning.models.repa.DigitsEncoder",
            "--model.repa.weights", str(tmp_path / "encoder.pt"), "--model.repa.depth", "1",
            "--model.repa.projector_dim", "16",
        ]  # fmt: skip
    run_cli(fit_args(tmp_path, "run", 2, objective), tmp_path)
    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    out = tmp_path / "pred"
    run_cli(
        [
            "predict",
            "--config",
            DEMO,
            *TINY,
            *objective,
            "--data.path",
            str(tmp_path / "digits"),
            "--data.predict_labels",
            "3,7",
            "--data.predict_num_samples",
            "4",
            "--model.sample_steps",
            "5",
            "--trainer.logger",
            "false",
            "--trainer.callbacks+=dit_lightning.callbacks.PredictionWriter",
            "--trainer.callbacks.output_dir",
            str(out),
            "--ckpt_path",
            str(ckpt),
        ],
        tmp_path,
    )
    assert sorted(p.name for p in out.glob("*.png")) == [
        "000000-c3.png",
        "000001-c7.png",
        "000002-c3.png",
        "000003-c7.png",
    ]
    # `test`: the held-out loss and the demo config's `evaluation` section (digits metrics)
    metrics = tmp_path / "test_metrics.json"
    proc = run_cli(
        [
            "test",
            "--config",
            DEMO,
            *TINY,
            *objective,
            "--data.path",
            str(tmp_path / "digits"),
            "--trainer.logger",
            "false",
            "--evaluation.num_samples",
            "20",
            "--evaluation.num_steps",
            "3",
            "--evaluation.output",
            str(metrics),
            "--ckpt_path",
            str(ckpt),
        ],
        tmp_path,
    )
    assert "test/loss" in proc.stdout and "test/digits_accuracy" in proc.stdout and "test/digits_fd_svc" in proc.stdout
    saved = json.loads(metrics.read_text())
    assert (
        saved["digits"]["samples"] == 20 and saved["checkpoint"] == str(ckpt) and saved["sampling"]["cfg_scale"] == 2.0
    )
    assert saved["sampling"]["sampler"] == ("sde-euler" if recipe == "flow-repa" else "ddpm")


def test_tool_commands_have_help():
    for tool in ("extract", "prepare-digits", "export", "plan", "sample", "evaluate"):
        with pytest.raises(SystemExit) as e:
            main([tool, "--help"])
        assert e.value.code == 0
