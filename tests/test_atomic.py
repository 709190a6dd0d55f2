"""Atomic writes (atomic.py): the old file or the whole new one, never a prefix and no debris;
the permissions of a plain ``open``; deterministic JSON; removal of a killed writer's
temporary files."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from dit_lightning.atomic import atomic_open, atomic_write, remove_stale_temporaries, write_bytes, write_json


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _temporaries(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(".") and n.endswith(".tmp"))


def test_the_target_changes_only_when_the_write_completes(tmp_path):
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")
    with atomic_open(target) as f:
        f.write(b"new, ")
        # while the write is in flight, readers see the old file; the bytes go to a temporary
        # file named after the target in the same directory
        assert target.read_bytes() == b"old"
        (tmp,) = _temporaries(tmp_path)
        assert tmp.startswith(".state.bin.")
        f.write(b"complete")
    assert target.read_bytes() == b"new, complete"
    assert sorted(os.listdir(tmp_path)) == ["state.bin"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_writer_that_raises_leaves_the_old_file_and_no_temporary(tmp_path, error):
    target = tmp_path / "state.json"
    target.write_bytes(b'{"step": 1}\n')
    with pytest.raises(error):
        with atomic_open(target) as f:
            f.write(b'{"step": 2, "trunc')
            raise error("killed mid-write")
    assert target.read_bytes() == b'{"step": 1}\n'
    assert sorted(os.listdir(tmp_path)) == ["state.json"]

    def half_then_fail(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, half_then_fail)
    assert target.read_bytes() == b'{"step": 1}\n'
    # a new file is not created at all
    with pytest.raises(OSError, match="disk full"):
        atomic_write(tmp_path / "new.bin", half_then_fail)
    assert sorted(os.listdir(tmp_path)) == ["state.json"]


def test_only_whole_file_modes_are_accepted(tmp_path):
    for mode in ("ab", "r+b", "a"):
        with pytest.raises(ValueError, match="whole files"):
            with atomic_open(tmp_path / "x", mode):
                pass
    assert os.listdir(tmp_path) == []
    with atomic_open(tmp_path / "sub" / "t.txt", "w") as f:  # text mode, missing directory created
        f.write("text")
    assert (tmp_path / "sub" / "t.txt").read_text() == "text"


def test_written_files_get_the_mode_of_a_plain_open_not_0600(tmp_path):
    plain = tmp_path / "plain"
    with open(plain, "wb") as f:
        f.write(b"x")
    written = write_bytes(tmp_path / "atomic", b"x")
    umask = os.umask(0)
    os.umask(umask)
    assert _mode(written) == _mode(plain) == 0o666 & ~umask


@pytest.mark.parametrize("umask, expected", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_the_mode_follows_the_umask(tmp_path, umask, expected):
    """In a fresh interpreter with the given umask (mkstemp alone would give 0o600 every time)."""
    code = (
        "import os, sys; os.umask(int(sys.argv[2], 8)); "
        "from dit_lightning.atomic import write_bytes; write_bytes(sys.argv[1], b'x')"
    )
    path = tmp_path / "f.bin"
    subprocess.run([sys.executable, "-c", code, str(path), oct(umask)], check=True, timeout=60)
    assert _mode(path) == expected


def test_write_json_is_deterministic_and_key_sorted(tmp_path):
    a = write_json(tmp_path / "a.json", {"b": 1, "a": {"d": [2, 3], "c": "x"}})
    b = write_json(tmp_path / "b.json", {"a": {"c": "x", "d": [2, 3]}, "b": 1})
    assert a.read_bytes() == b.read_bytes()
    assert a.read_text() == '{\n  "a": {\n    "c": "x",\n    "d": [\n      2,\n      3\n    ]\n  },\n  "b": 1\n}\n'
    assert json.loads(a.read_text()) == {"a": {"c": "x", "d": [2, 3]}, "b": 1}
    write_json(tmp_path / "a.json", {"z": 0, "y": 1}, indent=None)  # rewritten whole
    assert (tmp_path / "a.json").read_text() == '{"y": 1, "z": 0}\n'


def _age(path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_remove_stale_temporaries_removes_only_old_temporary_files(tmp_path):
    names = {
        ".last.ckpt.k3j2x9_a.tmp": 3600,  # a killed writer's temporary file, an hour old
        ".shard_00001.npy.a8f0b1c2.tmp": 3600,
        ".metrics.json.qq1zqq1z.tmp": 5,  # a write in flight right now (within the grace period)
        "last.ckpt": 3600,  # the files themselves
        "notes.tmp": 3600,  # not hidden: not ours
        ".hidden": 3600,  # no .tmp suffix: not ours
        ".cache.tmp": 3600,  # hidden .tmp, but not a temporary name of ours (no 8-character random part)
    }
    for name, age in names.items():
        (tmp_path / name).write_bytes(b"x")
        _age(tmp_path / name, age)
    (tmp_path / ".dir.tmp").mkdir()  # a directory is never removed
    (tmp_path / "sub").mkdir()
    nested = tmp_path / "sub" / ".sample.png.z1z1z1z1.tmp"
    nested.write_bytes(b"x")
    _age(nested, 3600)

    removed = remove_stale_temporaries(tmp_path, older_than_s=60)
    assert sorted(os.path.basename(p) for p in removed) == [".last.ckpt.k3j2x9_a.tmp", ".shard_00001.npy.a8f0b1c2.tmp"]
    left = set(names) - {os.path.basename(p) for p in removed} | {".dir.tmp", "sub"}
    assert sorted(os.listdir(tmp_path)) == sorted(left)
    assert nested.exists()  # not recursive by default

    assert remove_stale_temporaries(tmp_path, older_than_s=60, recursive=True) == [str(nested)]
    assert not nested.exists() and (tmp_path / ".metrics.json.qq1zqq1z.tmp").exists()
    # without a grace period, the young one goes too
    assert [os.path.basename(p) for p in remove_stale_temporaries(tmp_path)] == [".metrics.json.qq1zqq1z.tmp"]
    assert remove_stale_temporaries(tmp_path / "missing") == []


def test_a_write_in_flight_survives_a_cleanup_with_a_grace_period(tmp_path):
    target = tmp_path / "grid.png"
    with atomic_open(target) as f:
        f.write(b"png")
        assert len(_temporaries(tmp_path)) == 1
        assert remove_stale_temporaries(tmp_path, older_than_s=60) == []
    assert target.read_bytes() == b"png" and _temporaries(tmp_path) == []
