"""RunCSVLogger: a run continued in its directory appends to its metrics.csv, never loses a row."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dit_lightning.plugins import RunCSVLogger


def rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_rows_are_appended_under_the_files_columns_and_a_new_column_keeps_every_row(tmp_path):
    run = tmp_path / "version_0"
    run.mkdir()
    # a history whose columns are not in sorted order (written by another tool, or an older version)
    (run / "metrics.csv").write_text("train/loss,step,epoch\n0.5,0,0\n0.4,1,0\n")
    logger = RunCSVLogger(str(tmp_path), name="", version="version_0")
    logger.log_metrics({"train/loss": 0.3, "epoch": 0}, step=2)
    logger.save()
    header, got = rows(run / "metrics.csv")
    assert header == ["train/loss", "step", "epoch"]
    assert [(r["step"], r["train/loss"]) for r in got] == [("0", "0.5"), ("1", "0.4"), ("2", "0.3")]
    logger.log_metrics({"test/loss": 0.25}, step=2)  # a new column: the file is rewritten with it
    logger.save()
    header, got = rows(run / "metrics.csv")
    assert header == ["train/loss", "step", "epoch", "test/loss"]
    assert [(r["step"], r["train/loss"], r["test/loss"]) for r in got] == [
        ("0", "0.5", ""),
        ("1", "0.4", ""),
        ("2", "0.3", ""),
        ("2", "", "0.25"),
    ]
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]  # the rewrite left no temporary


def test_a_fresh_directory_is_written_as_lightning_writes_it(tmp_path):
    logger = RunCSVLogger(str(tmp_path), name="", version="version_0")
    logger.log_metrics({"b": 1.0, "a": 2.0}, step=0)
    logger.save()
    header, got = rows(tmp_path / "version_0" / "metrics.csv")
    assert header == ["a", "b", "step"] and got == [{"a": "2.0", "b": "1.0", "step": "0"}]


def test_a_new_run_starts_the_file_anew_as_lightnings_does(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("a,step\n1.0,0\n")
    logger = RunCSVLogger(str(tmp_path), name="", version="run", append=False)
    with pytest.warns(UserWarning, match="will be deleted"):  # Lightning's warning says so
        logger.log_metrics({"b": 2.0}, step=0)
    logger.save()
    assert rows(run / "metrics.csv") == (["b", "step"], [{"b": "2.0", "step": "0"}])


def test_the_temporary_of_a_killed_rewrite_is_removed_by_the_next_run(tmp_path):
    """A rewrite of metrics.csv (a new column) killed half-way leaves its temporary beside the file."""
    run = tmp_path / "version_0"
    run.mkdir()
    history = "train/loss,step\n0.5,0\n0.4,1\n"
    (run / "metrics.csv").write_text(history)
    stale = run / ".metrics.csv.k1lled_1.tmp"
    stale.write_text(history + "0.3,2\n")
    other = run / ".config.yaml.abcd1234.tmp"  # another writer's, maybe in flight: not the logger's to remove
    other.write_text("x")
    logger = RunCSVLogger(str(tmp_path), name="", version="version_0")
    with pytest.warns(UserWarning, match="left by a rewrite of metrics.csv that was interrupted"):
        logger.log_metrics({"train/loss": 0.3}, step=2)
    logger.save()
    assert not stale.exists() and other.exists()
    assert (run / "metrics.csv").read_text() == history + "0.3,2\n"  # every earlier byte kept, one row appended
