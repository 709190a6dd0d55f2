"""Atomic writes (atomic.py): the old file or the whole new one, never a prefix and no debris;
the permissions of a plain ``open``; deterministic JSON; removal of a killed writer's
temporary files; whole directories replaced and recovered after a kill between the two renames;
symbolic links re-pointed."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from dit_lightning.atomic import (
    OutOfSpaceError,
    atomic_open,
    atomic_write,
    commit_directory,
    recover_directories,
    recover_directory,
    remove_stale_temporaries,
    replace_directory,
    replace_symlink,
    staging_directory,
    write_bytes,
    write_json,
    write_text,
)


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
    (tmp_path / ".dir.tmp").mkdir()  # a directory without the random part is not ours either
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


def test_remove_stale_temporaries_removes_staging_directories_and_links_but_no_old_copy(tmp_path):
    stale = tmp_path / ".export.k3j2x9_a.tmp"  # a killed replace_directory's staging directory
    (stale / "transformer").mkdir(parents=True)
    (stale / "transformer" / "weights.bin").write_bytes(b"x")
    for path in (stale / "transformer" / "weights.bin", stale / "transformer", stale):
        _age(path, 3600)
    busy = tmp_path / ".store.a8f0b1c2.tmp"  # its top level is old, but a file deep inside is being written
    (busy / "shards").mkdir(parents=True)
    (busy / "shards" / "x.npy").write_bytes(b"x")
    _age(busy / "shards", 3600)
    _age(busy, 3600)
    aside = tmp_path / ".ckpt.qq1zqq1z.old"  # a copy moved aside: maybe the only complete one
    aside.mkdir()
    _age(aside, 3600)
    os.symlink("version_0/last.ckpt", tmp_path / ".last.ckpt.z1z1z1z1.tmp")  # replace_symlink's, dangling
    _age_link(tmp_path / ".last.ckpt.z1z1z1z1.tmp", 3600)
    removed = remove_stale_temporaries(tmp_path, older_than_s=60)
    assert sorted(os.path.basename(p) for p in removed) == [".export.k3j2x9_a.tmp", ".last.ckpt.z1z1z1z1.tmp"]
    assert sorted(os.listdir(tmp_path)) == [".ckpt.qq1zqq1z.old", ".store.a8f0b1c2.tmp"]
    # recursive: a staging directory is removed whole (not searched), and only past the grace period
    (tmp_path / "run").mkdir()
    nested = tmp_path / "run" / ".grid.png.b0b0b0b0.tmp"
    (nested / "deep").mkdir(parents=True)
    assert remove_stale_temporaries(tmp_path, older_than_s=60, recursive=True) == []
    assert sorted(remove_stale_temporaries(tmp_path, recursive=True)) == [str(busy), str(nested)]
    assert aside.is_dir()


def _age_link(path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past), follow_symlinks=False)


def _entries(directory) -> list[str]:
    return sorted(os.listdir(directory))


def _tree(root) -> dict[str, str]:
    return {
        os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f)).read()
        for d, _, files in os.walk(root)
        for f in files
    }


def _old_export(parent):
    target = parent / "export"
    (target / "sub").mkdir(parents=True)
    (target / "version.txt").write_text("old")
    (target / "sub" / "only-old.txt").write_text("old")
    return target


def test_replace_directory_creates_a_missing_target(tmp_path):
    target = tmp_path / "out" / "export"  # its parent is created too
    with replace_directory(target) as staging:
        # built beside the target under a temporary name; the target does not exist meanwhile
        assert staging.parent == target.parent and staging.is_dir() and _entries(staging) == []
        assert staging.name.startswith(".export.") and staging.name.endswith(".tmp") and len(staging.name) == 20
        assert not target.exists()
        write_text(staging / "version.txt", "new")
    assert _entries(target.parent) == ["export"] and _tree(target) == {"version.txt": "new"}


def test_replace_directory_replaces_an_existing_target_whole(tmp_path):
    target = _old_export(tmp_path)
    with replace_directory(target) as staging:
        (staging / "sub").mkdir()
        write_text(staging / "sub" / "only-new.txt", "new")
        assert _tree(target) == {"version.txt": "old", "sub/only-old.txt": "old"}  # readers see the old one
    # the new tree only (nothing of the old one merged in), and no old copy or staging left beside
    assert _tree(target) == {"sub/only-new.txt": "new"}
    assert _entries(tmp_path) == ["export"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_exception_in_the_block_leaves_the_old_target_and_no_staging(tmp_path, error):
    target = _old_export(tmp_path)
    with pytest.raises(error, match="killed while writing"):
        with replace_directory(target) as staging:
            write_text(staging / "version.txt", "half")
            raise error("killed while writing")
    assert _tree(target) == {"version.txt": "old", "sub/only-old.txt": "old"}
    assert _entries(tmp_path) == ["export"]
    with pytest.raises(error):
        with replace_directory(tmp_path / "fresh"):
            raise error("killed while writing")
    assert _entries(tmp_path) == ["export"]  # no target created


def test_a_full_disk_in_the_block_reads_as_out_of_space(tmp_path):
    import errno

    target = _old_export(tmp_path)
    with pytest.raises(OutOfSpaceError, match="no space left on .* while writing export"):
        with replace_directory(target):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert _tree(target)["version.txt"] == "old" and _entries(tmp_path) == ["export"]


def test_exist_ok_false_never_replaces_what_another_writer_put_there(tmp_path):
    target = tmp_path / "store"
    with pytest.raises(FileExistsError):
        with replace_directory(target, exist_ok=False) as staging:
            write_text(staging / "mine.txt", "mine")
            target.mkdir()  # another process won the race meanwhile
            write_text(target / "theirs.txt", "theirs")
    assert _tree(target) == {"theirs.txt": "theirs"} and _entries(tmp_path) == ["store"]


def test_commit_fsyncs_every_file_and_directory_before_the_rename(tmp_path, monkeypatch):
    """What the sharded save uses: one process makes the staging directory, others may fill it, one commits."""
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"a single-file checkpoint")  # replaced by a directory
    staging = staging_directory(target)
    (staging / "shards").mkdir()
    for name in ("__0_0.distcp", "shards/__1_0.distcp"):
        write_text(staging / name, name)
    synced: set[int] = set()
    real_fsync = os.fsync

    def fsync(fd):
        synced.add(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    expected = {os.stat(staging / p).st_ino for p in ("__0_0.distcp", "shards/__1_0.distcp", "shards", ".")}
    synced.clear()  # the atomic writes above fsync'ed their files already: count the commit's own
    with pytest.raises(ValueError, match="beside"):
        commit_directory(staging, tmp_path / "elsewhere" / "last.ckpt")
    assert commit_directory(staging, target) == target
    assert expected <= synced and os.stat(tmp_path).st_ino in synced  # the tree, then the rename in its parent
    assert _tree(target) == {"__0_0.distcp": "__0_0.distcp", "shards/__1_0.distcp": "shards/__1_0.distcp"}
    assert _entries(tmp_path) == ["last.ckpt"]


_KILLED_REPLACE = """
import os, shutil, sys
from dit_lightning.atomic import replace_directory, write_text

target, kill_at = sys.argv[1], sys.argv[2]
real_rename, renames = os.rename, []

def rename(src, dst):
    renames.append(dst)
    if kill_at == f"rename {len(renames)}":
        os._exit(9)  # killed (no exception handler runs) just before this rename
    real_rename(src, dst)

def rmtree(path, *args, **kwargs):
    if kill_at == "deletion":
        os.unlink(os.path.join(path, "version.txt"))
        os._exit(9)  # killed half-way through deleting the old copy
    shutil_rmtree(path, *args, **kwargs)

os.rename, shutil_rmtree, shutil.rmtree = rename, shutil.rmtree, rmtree
with replace_directory(target) as staging:
    write_text(os.path.join(staging, "version.txt"), "new")
"""


def _kill_a_replacement(tmp_path, kill_at: str):
    """Replace ``export`` (old) in a process killed at ``kill_at``: before ``rename 1`` (the old
    copy moved aside), ``rename 2`` (the new one put in place), ``rename 3`` (the old copy renamed
    for deletion), or during the ``deletion``."""
    target = _old_export(tmp_path)
    code = subprocess.run([sys.executable, "-c", _KILLED_REPLACE, str(target), kill_at], timeout=60).returncode
    assert code == 9
    asides = [n for n in _entries(tmp_path) if n.endswith(".old")]
    temporaries = [n for n in _entries(tmp_path) if n.endswith(".tmp")]
    return target, asides, temporaries


@pytest.mark.parametrize("recover", ["recover_directory", "recover_directories", "the next writer"])
def test_a_kill_between_the_two_renames_leaves_the_old_copy_which_is_put_back(tmp_path, recover):
    target, asides, staging = _kill_a_replacement(tmp_path, "rename 2")
    # old aside, new not in place: the old copy is the only complete one
    assert not target.exists() and len(asides) == 1 and len(staging) == 1
    assert asides[0].startswith(".export.") and _tree(tmp_path / asides[0])["version.txt"] == "old"
    if recover == "recover_directory":
        assert recover_directory(target) is True
    elif recover == "recover_directories":
        assert recover_directories(tmp_path) == [target]
    else:
        with replace_directory(target) as new:
            # recovered before the new copy is built: readers meanwhile see the old one
            assert _tree(target)["version.txt"] == "old"
            write_text(new / "version.txt", "newer")
        assert _tree(target) == {"version.txt": "newer"}
        assert _entries(tmp_path) == sorted(["export", *staging])
        return
    assert _tree(target) == {"version.txt": "old", "sub/only-old.txt": "old"}
    assert _entries(tmp_path) == sorted(["export", *staging])  # the staging directory: a temporary
    assert recover_directory(target) is False  # nothing left to do
    assert remove_stale_temporaries(tmp_path) == [str(tmp_path / staging[0])]
    assert _entries(tmp_path) == ["export"]


@pytest.mark.parametrize("kill_at", ["rename 3", "deletion"])
def test_a_kill_after_the_new_copy_is_in_place_keeps_it_and_drops_the_old(tmp_path, kill_at):
    target, asides, temporaries = _kill_a_replacement(tmp_path, kill_at)
    assert _tree(target) == {"version.txt": "new"}
    if kill_at == "rename 3":  # new in place, old aside (complete)
        assert len(asides) == 1 and _tree(tmp_path / asides[0])["version.txt"] == "old"
    else:  # the old copy, half deleted, is a temporary: never taken for a complete old copy
        assert asides == [] and len(temporaries) == 1
        assert _tree(tmp_path / temporaries[0]) == {"sub/only-old.txt": "old"}
    assert recover_directory(target) is False and _tree(target) == {"version.txt": "new"}
    assert [n for n in _entries(tmp_path) if n.endswith(".old")] == []
    remove_stale_temporaries(tmp_path)
    assert _entries(tmp_path) == ["export"]


def test_a_kill_before_anything_moved_leaves_the_old_target(tmp_path):
    target, asides, temporaries = _kill_a_replacement(tmp_path, "rename 1")
    assert _tree(target)["version.txt"] == "old" and asides == [] and len(temporaries) == 1
    assert recover_directory(target) is False and remove_stale_temporaries(tmp_path) == [str(tmp_path / temporaries[0])]


def test_recovery_is_per_target(tmp_path):
    (tmp_path / ".a.b.abcdefgh.old").mkdir()  # the old copy of "a.b", not of "a"
    assert recover_directory(tmp_path / "a") is False and not (tmp_path / "a").exists()
    assert recover_directory(tmp_path / "missing-parent" / "a") is False
    assert recover_directories(tmp_path) == [tmp_path / "a.b"] and _entries(tmp_path) == ["a.b"]


@pytest.mark.parametrize("umask, expected", [(0o022, 0o755), (0o002, 0o775), (0o077, 0o700)])
def test_replaced_directories_get_the_mode_of_a_plain_mkdir(tmp_path, umask, expected):
    """In a fresh interpreter with the given umask (mkdtemp alone would give 0o700 every time)."""
    code = (
        "import os, sys; os.umask(int(sys.argv[2], 8)); from dit_lightning.atomic import replace_directory\n"
        "with replace_directory(sys.argv[1]) as d: (d / 'sub').mkdir(); (d / 'sub' / 'f').write_bytes(b'x')"
    )
    target = tmp_path / "export"
    for _ in range(2):  # created, then replaced
        subprocess.run([sys.executable, "-c", code, str(target), oct(umask)], check=True, timeout=60)
        assert _mode(target) == _mode(target / "sub") == expected


def test_replace_symlink_points_the_link_atomically(tmp_path):
    for run in ("version_0", "version_1"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "last.ckpt").write_text(run)
    link = tmp_path / "last.ckpt"
    assert replace_symlink(link, "version_0/last.ckpt") == link  # created
    assert os.readlink(link) == "version_0/last.ckpt" and link.read_text() == "version_0"
    replace_symlink(link, os.path.join("version_1", "last.ckpt"))  # re-pointed; stored as given (relative)
    assert os.readlink(link) == "version_1/last.ckpt" and link.read_text() == "version_1"
    assert _entries(tmp_path) == ["last.ckpt", "version_0", "version_1"]  # no temporary link left
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-dir" / "keep").write_text("x")
    with pytest.raises(OSError):  # a real directory is not a link to re-point
        replace_symlink(tmp_path / "a-dir", "version_0")
    assert (tmp_path / "a-dir" / "keep").read_text() == "x"
    assert _entries(tmp_path) == ["a-dir", "last.ckpt", "version_0", "version_1"]
