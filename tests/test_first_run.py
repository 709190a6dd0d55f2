"""A new user's first hour, run through the real `dit-lightning` command in subprocesses (and `make
demo` as the Makefile runs it): runs keep their own records, standard Lightning knobs work, any
logger gets the images and text, batch logs show progress, errors carry no traceback, and a short
demo run prints no avoidable warning."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dit_lightning.data import prepare_digits
from tests.helpers.cli import DEMO, ROOT, run_cli

# The demo shrunk to seconds, keeping its logger, monitors, sample grid and evaluation sections.
SMALL = [
    "--config", DEMO,
    "--model.depth", "1", "--model.hidden_size", "32", "--model.num_heads", "4", "--model.sample_steps", "3",
    "--data.global_batch_size", "32", "--data.val_size", "64",
    "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "2",
    "--sample_grid.every_n_steps", "2", "--sample_grid.num_steps", "3", "--sample_grid.per_class", "2",
    "--evaluation.num_samples", "20", "--evaluation.num_steps", "3", "--evaluation.batch_size", "20",
]  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A directory with the digits store where the demo config finds it (data/digits)."""
    d = tmp_path_factory.mktemp("first_run")
    prepare_digits(str(d / "data" / "digits"))
    return d


def make_demo(workdir: Path, args: str = "") -> subprocess.CompletedProcess:
    """`make demo ARGS=args` as the Makefile writes it (its install step skipped), with `dit-lightning`
    this checkout's CLI on the demo shrunk to seconds."""
    if shutil.which("make") is None:
        pytest.skip("needs make")
    bin_dir = workdir / "bin"
    bin_dir.mkdir(exist_ok=True)
    cli = bin_dir / "dit-lightning"
    cli.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m dit_lightning.cli "$@" {shlex.join(SMALL[2:])}\n')
    cli.chmod(0o755)
    if not (workdir / "configs").exists():
        (workdir / "configs").symlink_to(ROOT / "configs")  # the recipe names configs/demo.yaml
    # --no-print-directory: under `make test` a nested make would print "Entering directory" first
    proc = subprocess.run(
        ["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), "-o", ".venv/.installed-demo",
         f"BIN={bin_dir}", f"ARGS={args}", "demo"],
        cwd=workdir, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def two_runs(workdir) -> dict:
    """Two runs in one tree: a fit, then `make demo` (a fit, then `test` of the run it trained)."""
    first = run_cli(["fit", *SMALL], workdir)
    second = make_demo(workdir, "--seed_everything 7")  # an override for the fit (and its test)
    return {"first": first, "second": second, "root": workdir / "outputs" / "demo"}


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for f in sorted(run_dir.glob("events.out.tfevents.*")):
        ea = EventAccumulator(str(f))
        ea.Reload()
        for tag in ea.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in ea.Scalars(tag)})
    return out


def test_each_run_keeps_its_own_record_and_last_is_the_newest(two_runs):
    root = two_runs["root"]
    for version in ("version_0", "version_1"):
        run = root / version
        assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "samples.png").is_file()
        assert (run / "config.yaml").is_file() and (run / "hparams.yaml").is_file()
        assert not list(run.glob("checkpoints/*-v1.ckpt"))
    assert (root / "last.ckpt").resolve() == (root / "version_1" / "checkpoints" / "last.ckpt").resolve()
    # each fit names its run; the second says it took the shared link over from the first
    for n, proc in enumerate((two_runs["first"], two_runs["second"])):
        run = f"outputs/demo/version_{n}"
        assert proc.stdout.splitlines()[0] == f"fit: run {run}"  # where to look, before anything else
        assert f"fit: run {run} ended at step 4; last checkpoint {run}/checkpoints/last.ckpt" in proc.stdout
    # `make demo ARGS=...` passed its overrides to the fit and to the test of the run it trained
    for record in ("config.yaml", "test-config.yaml"):
        assert yaml.safe_load((root / "version_1" / record).read_text())["seed_everything"] == 7
    assert yaml.safe_load((root / "version_0" / "config.yaml").read_text())["seed_everything"] == 0
    taken = "outputs/demo/last.ckpt now points at this run's last checkpoint (version_1, step 4), not version_0's"
    assert taken in two_runs["second"].stderr and "now points" not in two_runs["first"].stderr
    # `make demo` tested the run it trained, by the path its fit recorded (not the shared link), and
    # recorded the test in that run's directory at its last step
    own = (root / "version_1" / "checkpoints" / "last.ckpt").resolve()
    assert f"--ckpt_path {own}" in two_runs["second"].stderr  # the recipe's trace (set -x)
    metrics = json.loads((root / "version_1" / "test_metrics.json").read_text())
    assert Path(metrics["checkpoint"]).resolve() == own
    assert metrics["global_step"] == 4 and not (root / "version_0" / "test_metrics.json").exists()
    assert (root / "version_1" / "test-config.yaml").is_file() and (root / "version_1" / "config.yaml").is_file()
    test_scalars = scalars(root / "version_1")
    assert set(test_scalars["test/loss"]) == {4} and set(test_scalars["test/digits_accuracy"]) == {4}
    assert not list(root.glob("version_2"))  # evaluating a run adds no run


def test_a_read_only_command_never_moves_the_last_link(two_runs, workdir, monkeypatch, capsys, one_thread):
    """`validate` of the first run's checkpoint re-pointed the shared link at it (the checkpoint's
    restored state looked like a save); only a run that writes a checkpoint moves it."""
    from dit_lightning.cli import main

    link = two_runs["root"] / "last.ckpt"
    before = os.readlink(link)
    monkeypatch.chdir(workdir)
    main(["validate", *SMALL, "--ckpt_path", "outputs/demo/version_0/checkpoints/last.ckpt"])
    assert "val/loss" in capsys.readouterr().out and os.readlink(link) == before == "version_1/checkpoints/last.ckpt"


def test_hparams_yaml_reads_with_safe_load_and_records_the_store(two_runs):
    hparams = yaml.safe_load((two_runs["root"] / "version_0" / "hparams.yaml").read_text())
    assert hparams["latent_shape"] == [1, 8, 8] and hparams["scale_factor"] == 1.0
    ckpt = torch.load(two_runs["root"] / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["hyper_parameters"]["scale_factor"] == 1.0 and ckpt["hyper_parameters"]["vae"] == "none/pixels"


def test_grad_norm_and_lr_are_logged_at_every_log_point(two_runs):
    logged = scalars(two_runs["root"] / "version_0")
    assert set(logged["train/grad_norm"]) == set(logged["train/loss"]) and len(logged["train/loss"]) == 2
    lr = [k for k in logged if k.startswith("lr-")]
    assert lr and set(logged[lr[0]]) >= set(logged["train/loss"])
    assert "hp_metric" not in logged  # not the meaningless -1


def test_batch_logs_show_run_progress_and_no_avoidable_warning(two_runs):
    out, err = two_runs["first"].stdout, two_runs["first"].stderr
    lines = [line for line in out.splitlines() if line.startswith("fit: step")]
    assert lines and lines[-1].startswith("fit: step 4/4 | 100.0%") and "ETA" in lines[0] and "train/loss" in lines[0]
    assert "Epoch" not in out and "/-" not in out
    assert "Total Flops" in err and re.search(r"^0\s+Total Flops", err, re.M) is None
    noisy = [line for line in (out + err).splitlines() if re.search(r"warn|deprecat|Tip:", line, re.I)]
    assert not noisy, noisy


def test_evaluation_subcommands_need_a_checkpoint(workdir):
    proc = run_cli(["test", *SMALL], workdir, check=False)
    assert proc.returncode == 1 and "needs --ckpt_path" in proc.stderr and "Traceback" not in proc.stderr
    empty = workdir / "empty"
    empty.mkdir()
    proc = run_cli(["validate", *SMALL, "--ckpt_path", "last", "--trainer.logger.save_dir", str(empty)], workdir, False)
    assert proc.returncode == 1 and "no checkpoint of this config yet" in proc.stderr


def test_errors_are_one_message_and_the_traceback_is_on_request(workdir):
    missing = ["fit", *SMALL, "--data.path", "nowhere", "--data.prepare", "null"]
    proc = run_cli(missing, workdir, check=False)
    assert proc.returncode == 1 and "no latent store at" in proc.stderr and "Traceback" not in proc.stderr
    assert "--debug" in proc.stderr
    proc = run_cli([*missing, "--debug"], workdir, check=False)
    assert proc.returncode != 0 and "Traceback" in proc.stderr
    proc = run_cli(["smaple", "--checkpoint", "x"], workdir, check=False)
    assert proc.returncode != 0 and "Did you mean 'sample'" in proc.stderr and "evaluate" in proc.stderr
    proc = run_cli(["plan", "--gpu", "foo"], workdir, check=False)
    assert proc.returncode == 1 and "unknown GPU 'foo'" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli(["fit", *SMALL, "--optimizer", "torch.optim.SGD"], workdir, check=False)
    assert proc.returncode == 2 and "optimizer" in proc.stderr and "Traceback" not in proc.stderr


def test_a_checkpoint_that_is_not_a_training_checkpoint_points_to_the_right_flag(two_runs, workdir):
    from dit_lightning.checkpoints import export_checkpoint

    exported = workdir / "exported.pt"
    export_checkpoint(str(two_runs["root"] / "version_0" / "checkpoints" / "last.ckpt"), str(exported))
    proc = run_cli(["test", *SMALL, "--ckpt_path", str(exported)], workdir, check=False)
    assert (
        proc.returncode == 1 and "--model.init_from" in proc.stderr and "pytorch-lightning_version" not in proc.stderr
    )


def test_a_checkpoint_naming_a_foreign_class_is_refused(two_runs, workdir):
    ckpt = torch.load(two_runs["root"] / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    ckpt["hyper_parameters"]["_class_path"] = "antigravity.Fly"
    bad = workdir / "foreign.ckpt"
    torch.save(ckpt, bad)
    proc = run_cli(["test", *SMALL, "--ckpt_path", str(bad)], workdir, check=False)
    assert proc.returncode == 1 and "antigravity.Fly" in proc.stderr and "DIT_LIGHTNING_TRUSTED_CLASSES" in proc.stderr


def test_settings_given_explicitly_win_over_the_checkpoint(two_runs, workdir):
    """`--ckpt_path` fills what is unset from the checkpoint, but an explicit setting wins (here it
    conflicts with the weights, and says so) instead of being silently replaced."""
    ckpt = str(two_runs["root"] / "version_0" / "checkpoints" / "last.ckpt")
    proc = run_cli(["validate", *SMALL, "--model.depth", "2", "--ckpt_path", ckpt], workdir, check=False)
    assert proc.returncode == 1 and "another architecture" in proc.stderr and "depth=2" in proc.stderr
    ok = run_cli(["validate", *SMALL, "--model.ema_decay", "0.5", "--ckpt_path", ckpt, "--print_config"], workdir)
    assert "ema_decay: 0.5" in ok.stdout


@pytest.mark.parametrize(
    "knob",
    [
        ["--trainer.enable_checkpointing", "false"],
        ["--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"],
        ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"],
    ],
    ids=["no-checkpointing", "tqdm-bar", "no-bar-no-summary"],
)
def test_standard_lightning_knobs_work(workdir, tmp_path, knob):
    proc = run_cli(
        ["fit", *SMALL, "--trainer.max_steps", "2", "--trainer.logger.save_dir", str(tmp_path), *knob], workdir
    )
    assert "max_steps=2` reached" in proc.stderr
    ckpts = list(tmp_path.glob("version_0/checkpoints/*.ckpt"))
    assert (not ckpts) if "--trainer.enable_checkpointing" in knob else ckpts


def test_optimizer_and_schedule_are_model_arguments_with_visible_defaults(workdir):
    proc = run_cli(["fit", *SMALL, "--print_config"], workdir)
    config = yaml.safe_load(proc.stdout)
    model = config["model"]["init_args"]
    assert model["optimizer"]["class_path"] == "torch.optim.AdamW" and model["optimizer"]["init_args"]["lr"] == 1e-3
    assert model["lr_scheduler"]["class_path"] == "dit_lightning.schedules.WarmupDecayLR"
    assert "optimizer" not in config and "lr_scheduler" not in config  # no top-level knob that does nothing
    sgd = run_cli(
        ["fit", *SMALL, "--model.optimizer", "torch.optim.SGD", "--model.optimizer.lr", "0.05",
         "--model.lr_scheduler.warmup_steps", "3", "--print_config"],
        workdir,
    )  # fmt: skip
    model = yaml.safe_load(sgd.stdout)["model"]["init_args"]
    assert (
        model["optimizer"]["class_path"] == "torch.optim.SGD"
        and model["lr_scheduler"]["init_args"]["warmup_steps"] == 3
    )


@pytest.mark.parametrize("logger", ["csv", "mlflow"])
def test_other_loggers_get_scalars_images_and_text(workdir, tmp_path, logger, monkeypatch):
    if logger == "csv":
        args = ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(tmp_path)]
    else:
        # mlflow-skinny (the test extra) stores runs in files; mlflow 3 asks for an explicit opt-in
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        args = [
            "--trainer.logger", "lightning.pytorch.loggers.MLFlowLogger",
            "--trainer.logger.tracking_uri", f"file:{tmp_path / 'mlruns'}", "--trainer.logger.save_dir", str(tmp_path),
        ]  # fmt: skip
    run_cli(["fit", *SMALL, *args], workdir)
    if logger == "csv":
        run = tmp_path / "version_0"  # the demo's logger name "" carries over to the CSVLogger
        with open(run / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        assert any(r.get("train/loss") for r in rows) and any(r.get("throughput/images_per_sec") for r in rows)
        assert sorted(p.name for p in (run / "images" / "samples_grid").glob("*.png")) == [
            "step_00000002.png", "step_00000004.png"
        ]  # fmt: skip
        assert "img/s" in (run / "summary.txt").read_text() and (run / "config.yaml").is_file()
    else:
        files = {str(p.relative_to(tmp_path)) for p in (tmp_path / "mlruns").rglob("*") if p.is_file()}
        assert any(f.endswith("metrics/train/loss") for f in files), sorted(files)[:20]
        assert any("samples/grid/step_00000004.png" in f for f in files)
        assert any(f.endswith("summary.txt") for f in files) and any(f.endswith("config.txt") for f in files)


def test_predict_keeps_its_images_and_says_where(two_runs, workdir):
    proc = run_cli(
        ["predict", *SMALL, "--ckpt_path", "last", "--data.predict_labels", "3,7", "--data.predict_num_samples", "4"],
        workdir,
    )
    out = two_runs["root"] / "version_1" / "predictions"
    assert sorted(p.name for p in out.glob("*.png")) == [
        "000000-c3.png",
        "000001-c7.png",
        "000002-c3.png",
        "000003-c7.png",
    ]
    assert f"predict: 4 images written to {out.resolve()}" in proc.stdout
    # the link is shared by every run of the config: `last` says which run and step it read
    assert "--ckpt_path last: run version_1, step 4 (outputs/demo/version_1/checkpoints/last.ckpt)" in proc.stderr
    # a batch log shows predict's progress as it does fit's: plain lines with an ETA
    lines = [line for line in proc.stdout.splitlines() if line.startswith("predict: batch")]
    assert lines and "100.0%" in lines[-1] and "ETA" in lines[-1], proc.stdout


def test_tools_print_where_they_wrote_and_evaluate_takes_one_metric_name(two_runs, workdir):
    proc = run_cli(["prepare-digits", "--output", "data/digits"], workdir)
    assert "digits store ready at" in proc.stdout
    proc = run_cli(
        ["evaluate", "--checkpoint", "outputs/demo/last.ckpt", "--output", "eval", "--metrics", "digits",
         "--labels", "0-9", "--num_samples", "10", "--num_steps", "3", "--device", "cpu", "--progress", "true"],
        workdir,
    )  # fmt: skip
    assert '"digits_accuracy"' in proc.stdout and "metrics.json" in proc.stdout
    assert json.loads((workdir / "eval" / "metrics.json").read_text())["digits"]["samples"] == 10


def test_help_is_short_and_complete(workdir):
    assert len(run_cli(["evaluate", "--help"], workdir).stdout.splitlines()) < 250
    # Lightning's Trainer alone is ~370 lines; the sample grid section and the flow samplers' options
    # (issues 25, 26) brought the whole to ~1050; LightningDiT's block and objective options, the latent
    # transform, the image-folder preparation and the flow sampling extras (issue 36) to ~1110
    assert len(run_cli(["fit", "--help"], workdir).stdout.splitlines()) < 1150
    top = run_cli(["--help"], workdir).stdout
    assert all(name in top for name in ("fit", "test", "sample", "evaluate", "prepare-digits", "plan", "--debug"))
    export = next(line for line in top.splitlines() if line.strip().startswith("export "))
    assert "safetensors" in export and "diffusers" in export  # every format export writes
    for tool in ("sample", "evaluate", "export", "consolidate", "prune", "plan", "prepare-digits", "extract"):
        text = run_cli([tool, "--help"], workdir).stdout
        undocumented = re.findall(r"^  --(\w+) \S+\s*\n\s+\(type:", text, re.M)
        assert not undocumented, (tool, undocumented)


def test_readme_notebook_snippet_trains_a_useful_model(tmp_path, monkeypatch, one_thread):
    """The README's Python example, run as written, makes digits an independent classifier recognises."""
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "README.md").read_text()
    code = re.search(r"In a notebook the same pieces.*?```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    from dit_lightning.evaluation.digits import digits_accuracy

    result = digits_accuracy(scope["model"], per_class=10, num_steps=50, cfg_scale=2.0)
    assert scope["images"].shape == (10, 1, 8, 8) and result["accuracy"] >= 0.8, result["accuracy"]
    assert os.path.isdir(tmp_path / "data" / "digits")


def test_last_checkpoint_holds_the_final_step_between_periodic_saves(workdir, tmp_path):
    run_cli(
        ["fit", *SMALL, "--trainer.max_steps", "5", "--checkpoint.every_n_train_steps", "3",
         "--trainer.logger.save_dir", str(tmp_path)],
        workdir,
    )  # fmt: skip
    ckpts = tmp_path / "version_0" / "checkpoints"
    assert torch.load(ckpts / "last.ckpt", weights_only=True)["global_step"] == 5
    assert torch.load(ckpts / "epoch=0-step=3.ckpt", weights_only=True)["global_step"] == 3


def test_the_demo_as_typed_writes_in_the_working_directory_and_names_its_run_first(capsys, recwarn, one_thread):
    """The demo as a new user types it, no paths: its data/digits and outputs/demo are relative to the
    working directory, which every test gets as a temporary one (the suite's autouse fixture: running
    the suite after `make demo` left a run, version_2, in the user's outputs/demo). The run directory
    is the fit's first line, and resuming into it is no cause for Lightning's "exists and is not empty"."""
    from dit_lightning.cli import main

    assert Path.cwd() != ROOT
    tiny = [
        *SMALL, "--model.sample_steps", "2", "--sample_grid.enabled", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.callbacks=[]", "--trainer.max_steps",
    ]  # fmt: skip
    main(["fit", *tiny, "2"])
    assert capsys.readouterr().out.splitlines()[0] == "fit: run outputs/demo/version_0"
    assert Path("data/digits/meta.json").is_file() and Path("outputs/demo/version_0/checkpoints/last.ckpt").is_file()
    main(["fit", *tiny, "3", "--ckpt_path", "last"])
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "fit: run outputs/demo/version_0; resuming step 2 of outputs/demo/version_0/checkpoints/last.ckpt"
    )
    assert "ended at step 3" in out and not [w for w in recwarn if "exists and is not empty" in str(w.message)]


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_the_suite_writes_nothing_into_the_repository(tmp_path):
    """The proof of the fixture above: the representative test run by pytest from a copy of the
    repository, as `make test` runs the suite, leaves the copy as it was (no data/, no outputs/)."""
    copy = tmp_path / "repository"
    copy.mkdir()
    for name in ("dit_lightning", "tests", "configs"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", copy / "pyproject.toml")
    before = _listing(copy)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "pytest"),
         "tests/test_first_run.py::test_the_demo_as_typed_writes_in_the_working_directory_and_names_its_run_first"],
        cwd=copy, env={**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _listing(copy) - before == set()
