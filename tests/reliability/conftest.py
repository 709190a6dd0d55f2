"""Fixtures of the reliability suite: the digits store (read only: tests that damage a store copy it
first), one short training run whose checkpoint the tests read, and the ``dit-lightning`` command
run in this process (tools, argument and checkpoint checks that fail before any training) or in a
subprocess (everything that trains, signals, full disks)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dit_lightning.cli import main
from tests.helpers.cli import fit_args, run_cli


def fit(tmp_path: Path, name: str, steps: int, data: Path, extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """``fit`` of the shrunk demo on ``data`` (CSV logs and checkpoints every 4 steps under ``tmp_path/name``)."""
    return fit_args(tmp_path, name, steps, ["--data.path", str(data), *extra])


def call(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``dit-lightning ARGS`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out = capsys.readouterr()
    return code, out.out, out.err


def one_message(err: str) -> None:
    """An error of the CLI: its message and the pointer to --debug, no traceback, and not wrapped in
    jsonargparse's listing of a union's subtypes and the whole configuration."""
    assert "Traceback" not in err and "error:" in err and "--debug" in err, err
    assert "Union subtypes" not in err and "Given value" not in err, err


@pytest.fixture(scope="session")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dit_lightning.data import prepare_digits

    return Path(prepare_digits(str(tmp_path_factory.mktemp("reliability") / "digits")))


@pytest.fixture
def digits_copy(digits: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(digits, tmp_path / "digits-copy"))


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory, digits: Path) -> Path:
    """``last.ckpt`` of a 4-step run (the tiny demo DiT: depth 2, 4 heads of width 8)."""
    tmp = tmp_path_factory.mktemp("trained")
    run_cli(fit(tmp, "run", 4, digits), tmp)
    return tmp / "run" / "ckpt" / "last.ckpt"
