"""The user notebooks run top to bottom (FAST settings) and show what they promise.

Each notebook is copied to a temporary folder and executed there with nbclient in a fresh
kernel of this interpreter (``notebooks/execute.py`` puts a ``python3`` kernelspec pointing at
``sys.executable`` first on JUPYTER_PATH), with the ``notebooks/`` folder of a temporary
repository as the working directory, as Jupyter starts it: its package, configs and docs link to
this checkout's, and what the notebooks write relative to the repository root (``data/digits``,
``outputs/``: ``DIT_NOTEBOOK_OUTPUTS``) lands there, never in this checkout. The committed
notebooks are never written. 01 runs before 03, so 03 samples from the quickstart's checkpoint, as
it does for a user.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
# On an idle 2-core machine the quickstart runs in about a minute (most of it training) and the
# others in well under one; this bound (per notebook, with kernel start) only catches a FAST
# setting gone badly wrong on a loaded CI machine.
MAX_SECONDS = 300
# The quickstart's FAST model gets ~99% of its generated digits recognised (98.5-99.5% over
# three seeds; 300 steps of the former recipe gave ~35%, 400 steps ~65%): well below that, the
# training is broken, not unlucky.
MIN_QUICKSTART_ACCURACY = 0.80


def _runner():
    spec = importlib.util.spec_from_file_location("notebook_runner", NOTEBOOKS / "execute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runner = _runner()


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    """A temporary repository whose package, configs and docs are this checkout's (linked): the
    notebooks find it as their root and write their data/ and outputs/ into it."""
    repo = tmp_path_factory.mktemp("repository")
    for name in ("dit_lightning", "configs", "docs", "benchmarks"):
        (repo / name).symlink_to(ROOT / name, target_is_directory=True)
    shutil.copyfile(ROOT / "pyproject.toml", repo / "pyproject.toml")
    (repo / "notebooks").mkdir()
    return repo


@pytest.fixture(scope="module")
def outputs_dir(repository):
    return Path("outputs") / "test-notebooks"  # relative to the repository root, as a user's


def _execute(name: str, outputs_dir: Path, tmp_path: Path, monkeypatch, repository: Path):
    src = NOTEBOOKS / name
    committed = src.read_bytes()
    copy = tmp_path / name
    shutil.copyfile(src, copy)
    monkeypatch.setenv("DIT_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("DIT_NOTEBOOK_OUTPUTS", str(outputs_dir))
    start = time.perf_counter()
    # raises CellExecutionError on any error
    nb = runner.execute_notebook(copy, cwd=repository / "notebooks", output=copy)
    seconds = time.perf_counter() - start
    assert src.read_bytes() == committed, "the committed notebook was modified"
    assert seconds < MAX_SECONDS, f"{name} took {seconds:.0f} s with FAST"
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    # The notebooks print paths relative to the repository root, never this machine's (a
    # dependency's warning naming its own file in the environment, e.g. .venv/, is not ours).
    env = [sys.prefix, os.path.realpath(sys.prefix)]
    roots = [str(ROOT), os.path.realpath(ROOT), str(repository), os.path.realpath(repository)]
    leaks = runner.find_machine_paths(nb, prefixes=roots, allowed=env)
    assert not leaks, leaks
    return nb


def _tagged(nb, tag: str):
    cells = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    assert cells, f"no cell tagged {tag!r}"
    return cells[0]


def _text(cell) -> str:
    parts = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            parts.append(o["text"])
        parts.append(o.get("data", {}).get("text/plain", ""))
        parts.append(o.get("data", {}).get("text/markdown", ""))
    return "".join("".join(p) if isinstance(p, list) else p for p in parts)


def _images(cells) -> int:
    return sum("image/png" in o.get("data", {}) for c in cells for o in c.get("outputs", []))


def test_committed_notebooks_are_executed_and_clean():
    import nbformat

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and 'os.environ.get("DIT_NOTEBOOK_FAST", "1") == "1"' in code[0].source, (
            f"{path.name}: FAST must be the first code cell"
        )
        assert all(c.execution_count for c in code), f"{path.name}: run notebooks/execute.py before committing"
        assert _images(nb.cells) > 0, f"{path.name}: committed without its plots"
        assert not runner.find_machine_paths(nb), f"{path.name}: machine paths in the committed outputs"


def test_quickstart(outputs_dir, tmp_path, monkeypatch, repository):
    nb = _execute("01_quickstart.ipynb", outputs_dir, tmp_path, monkeypatch, repository)
    assert _images(nb.cells) >= 3  # real digits, loss curve, sample grid
    assert _images([_tagged(nb, "sample-grid")]) == 1
    accuracy = _text(_tagged(nb, "accuracy"))
    found = re.search(r"generated digits recognised as the requested class: ([\d.]+)% of (\d+)", accuracy)
    assert found, accuracy
    assert int(found[2]) >= 200, "too few samples for a meaningful accuracy"
    assert float(found[1]) / 100 >= MIN_QUICKSTART_ACCURACY, f"the FAST quickstart model is not trained: {accuracy}"
    run = repository / outputs_dir / "quickstart"
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / "samples.png").is_file()
    assert list(run.glob("version_*/events.out.tfevents.*")), "no TensorBoard event file"


def _recipe_lines(path: Path) -> list[str]:
    """The lines that set the model size and the optimisation (the first ones: the FAST branch)."""
    import nbformat

    code = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    lines = [line.strip() for source in code for line in source.splitlines()]
    starts = ("SIZES = dict(", "BATCH, STEPS, LR, WARMUP =")
    return [next((line for line in lines if line.startswith(start)), f"{start} missing") for start in starts]


def test_sampling_fallback_trains_the_quickstart_recipe():
    # 03 trains a model itself when the quickstart's checkpoint is missing: the same one.
    assert _recipe_lines(NOTEBOOKS / "03_sampling.ipynb") == _recipe_lines(NOTEBOOKS / "01_quickstart.ipynb")


def test_memory_and_throughput(outputs_dir, tmp_path, monkeypatch, repository):
    nb = _execute("02_memory_and_throughput.ipynb", outputs_dir, tmp_path, monkeypatch, repository)
    text = "".join(_text(c) for c in nb.cells)
    assert "| DiT-XL/2 |" in text and "| DiT-S/8 |" in text  # the tables cover every size
    assert "sampling_cpu.csv" in text  # the committed benchmark results are read
    assert _images(nb.cells) >= 6


def test_sampling(outputs_dir, tmp_path, monkeypatch, repository):
    nb = _execute("03_sampling.ipynb", outputs_dir, tmp_path, monkeypatch, repository)
    assert _images([_tagged(nb, "grids")]) == 1
    speed = _text(_tagged(nb, "speed"))
    assert "ms / image" in speed and "DDPM-" in speed and "DDIM-" in speed
    assert _images([_tagged(nb, "speed")]) == 1
