"""The run-directory checkpoint callback's file handling (callbacks/checkpoint.py): the
``last.ckpt`` link and what a killed save leaves, both through atomic.py."""

from __future__ import annotations

import os

import pytest

from dit_lightning.atomic import replace_directory
from dit_lightning.callbacks.checkpoint import _clean_up_interrupted_saves, _update_link, newest_run_checkpoint


def test_the_latest_link_is_relative_and_re_pointed(tmp_path):
    for version in (0, 1):
        (tmp_path / f"version_{version}" / "checkpoints").mkdir(parents=True)
        (tmp_path / f"version_{version}" / "checkpoints" / "last.ckpt").write_text(str(version))
    link = tmp_path / "last.ckpt"
    for version in (0, 1):
        _update_link(link, tmp_path / f"version_{version}" / "checkpoints" / "last.ckpt")
        assert os.readlink(link) == os.path.join(f"version_{version}", "checkpoints", "last.ckpt")
        assert newest_run_checkpoint(tmp_path).read_text() == str(version)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "version_0", "version_1"]


def test_a_link_that_cannot_be_made_is_a_warning(tmp_path):
    (tmp_path / "last.ckpt").mkdir()  # a directory in the way
    (tmp_path / "last.ckpt" / "keep").write_text("x")
    with pytest.warns(UserWarning, match="could not link"):
        _update_link(tmp_path / "last.ckpt", tmp_path / "version_0" / "checkpoints" / "last.ckpt")
    assert (tmp_path / "last.ckpt" / "keep").read_text() == "x"


def test_a_killed_sharded_save_is_recovered_when_a_run_starts(tmp_path):
    # between its two renames: the previous checkpoint moved aside, its successor not in place
    with replace_directory(tmp_path / "last.ckpt") as staging:
        (staging / "__0_0.distcp").write_text("step 4")
    os.rename(tmp_path / "last.ckpt", tmp_path / ".last.ckpt.k1lled_1.old")
    # a save killed while the ranks wrote their shards, and a killed single-file save
    (tmp_path / ".epoch=0-step=8.ckpt.k1lled_2.tmp").mkdir()
    (tmp_path / ".epoch=0-step=8.ckpt.k1lled_2.tmp" / "__1_0.distcp").write_text("half")
    (tmp_path / ".epoch=0-step=6.ckpt.k1lled_3.tmp").write_text("half")
    with pytest.warns(UserWarning) as warned:
        _clean_up_interrupted_saves(tmp_path)
    messages = sorted(str(w.message) for w in warned)
    assert len(messages) == 3 and "restored" in messages[2] and "last.ckpt" in messages[2]
    assert all("left by a checkpoint save that was interrupted" in m for m in messages[:2])
    assert os.listdir(tmp_path) == ["last.ckpt"] and (tmp_path / "last.ckpt" / "__0_0.distcp").read_text() == "step 4"
