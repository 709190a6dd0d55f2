"""How fast each training recipe reaches a given quality on the digits demo.

Every recipe trains the demo network (configs/demo.yaml: the same model, batch, optimiser, EMA and
1000 steps) through ``dit-lightning fit``, changing only the objective:

    ddpm            the reference recipe (the demo's own)
    ddpm-minsnr     DDPM with Min-SNR-gamma loss weighting (gamma 5)
    flow-uniform    flow matching, SiT's linear path, velocity prediction, uniform times
    flow-lognorm    the same with logit-normal times (mean 0, std 1)
    flow-repa       flow-uniform + REPA: block 2 of 6 aligned (coefficient 0.5) with the patch
                    features of a small digits encoder trained once on the store's train split,
                    standing in for DINOv2 (which sees ImageNet, not 8x8 digits)
    flow-lognorm-lightningdit
                    flow-lognorm with LightningDiT's block at the same width: RMSNorm,
                    SwiGLU feed-forward, 2D rotary position embedding

Every ``--eval-every`` steps the run samples ``--num-samples`` digits (balanced over 0-9) from its
EMA weights with its own sampler (DDPM ancestral for DDPM, SiT's SDE Euler for flow), ``--sample-steps``
steps, cfg 2.0, and measures the test's digits metrics (``dit_lightning.evaluation.digits``: an
independent classifier's accuracy, Frechet distances in pixel and classifier space). Each recipe runs
``--seeds`` seeds (the seed sets the initial weights, the data order, timesteps and noise). The table
gives mean and spread over seeds at each evaluation, and the first step at which a recipe's mean
Frechet distance (classifier space) reaches the DDPM baseline's final one.

    python benchmarks/bench_recipes.py                    # all recipes, 3 seeds, 1000 steps
    python benchmarks/bench_recipes.py --recipes ddpm flow-uniform --seeds 0

``--keep-others`` adds the rows of the recipes not run now from the existing results csv (a new
recipe joins the table without rerunning the others).

Runs are resumable: each (recipe, seed) keeps its metrics under --workdir and is skipped when done;
several processes may share the workdir (``OMP_NUM_THREADS=1``, one per core: faster than one process
with two threads for this tiny network), each claiming the runs it makes; ``--report-only`` then
summarises them all.
Results: stdout and docs/benchmarks/recipes_digits.{md,csv,png}.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_STEM = os.path.join(REPO, "docs", "benchmarks", "recipes_digits")
REPA_ENCODER = "dit_lightning.models.repa.DigitsEncoder"

RECIPES: dict[str, list[str]] = {
    "ddpm": [],
    "ddpm-minsnr": ["--model.loss_weighting", "min_snr", "--model.min_snr_gamma", "5"],
    "flow-uniform": ["--model.objective", "flow"],
    "flow-lognorm": ["--model.objective", "flow", "--model.time_distribution", "logit_normal"],
    "flow-repa": [
        "--model.objective", "flow",
        "--model.repa.encoder", REPA_ENCODER, "--model.repa.depth", "2", "--model.repa.coeff", "0.5",
        "--model.repa.projector_dim", "256",
    ],
    "flow-lognorm-lightningdit": [
        "--model.objective", "flow", "--model.time_distribution", "logit_normal",
        "--model.norm", "rmsnorm", "--model.mlp", "swiglu", "--model.pos_embed", "rope",
    ],
}  # fmt: skip
METRICS = ("digits_accuracy", "digits_fd_pixels", "digits_fd_svc")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cli() -> list[str]:
    return [sys.executable, "-m", "dit_lightning.cli"]


def prepare(workdir: str) -> tuple[str, Optional[str]]:
    """The digits store, and the REPA stand-in encoder trained once on its train split."""
    from dit_lightning.data import prepare_digits

    store = prepare_digits(os.path.join(workdir, "digits"))
    return str(store), None


def train_encoder(workdir: str, store: str) -> str:
    """The REPA stand-in for DINOv2, made as the demo's documented command makes it
    (``dit-lightning prepare-digits --encoder``: trained once as a classifier on the store's train split;
    the held-out split and the evaluation's classifier never see it)."""
    from dit_lightning.commands.prepare_digits import write_digits_encoder

    return write_digits_encoder(store, os.path.join(workdir, "digits_encoder.pt"))


def cached_run(run_dir: str, make: Callable[[], list[dict]]) -> list[dict]:
    """A run's metrics: those ``make`` measured once (kept in ``run_dir/curve.json``), or none when
    another process sharing the workdir has claimed the run."""
    done = os.path.join(run_dir, "curve.json")
    if os.path.exists(done):
        with open(done) as f:
            return json.load(f)
    try:  # several benchmark processes may share a workdir (e.g. one per core): each run is made once
        os.makedirs(run_dir + ".claimed")
    except FileExistsError:
        log(f"{os.path.basename(run_dir)}: made by another process")
        return []
    curve = make()
    os.makedirs(run_dir, exist_ok=True)
    with open(done + ".tmp", "w") as f:
        json.dump(curve, f)
    os.replace(done + ".tmp", done)
    return curve


def finished_curves(workdir: str, recipes: list[str], seeds: list[int]) -> dict[str, list[dict]]:
    """The metrics of the runs already finished under ``workdir``, by recipe."""
    curves: dict[str, list[dict]] = {}
    for recipe in recipes:
        for seed in seeds:
            done = os.path.join(workdir, f"{recipe}-seed{seed}", "curve.json")
            if os.path.exists(done):
                with open(done) as f:
                    curves.setdefault(recipe, []).extend(json.load(f))
    return curves


def run_one(args: argparse.Namespace, recipe: str, seed: int, store: str, encoder: Optional[str]) -> list[dict]:
    """One training run; its metrics at every evaluation (cached in the run's directory)."""
    return cached_run(
        os.path.join(args.workdir, f"{recipe}-seed{seed}"), lambda: train(args, recipe, seed, store, encoder)
    )


def train(args: argparse.Namespace, recipe: str, seed: int, store: str, encoder: Optional[str]) -> list[dict]:
    run_dir = os.path.join(args.workdir, f"{recipe}-seed{seed}")
    extra = list(RECIPES[recipe])
    if recipe == "flow-repa":
        extra += ["--model.repa.weights", str(encoder)]
    cmd = cli() + [
        "fit", "--config", os.path.join(REPO, "configs", "demo.yaml"),
        "--seed_everything", str(seed), "--model.seed", str(seed), "--data.seed", str(seed),
        "--data.path", store, "--trainer.max_steps", str(args.steps),
        "--trainer.val_check_interval", str(args.eval_every),
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir", run_dir, "--trainer.logger.name", "", "--trainer.logger.version", "run",
        "--trainer.enable_progress_bar", "false",
        "--sample_grid.enabled", "false", "--checkpoint.every_n_train_steps", "0",
        "--evaluation.stages", "[validate]", "--evaluation.num_samples", str(args.num_samples),
        "--evaluation.num_steps", str(args.sample_steps), "--evaluation.output", "null",
        *extra,
    ]  # fmt: skip
    log(f"{recipe} seed {seed}: {shlex.join(cmd[2:])}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=args.workdir, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{recipe} seed {seed} failed (exit {proc.returncode})")
    curve = read_curve(os.path.join(run_dir, "run", "metrics.csv"))
    for row in curve:
        row.update(recipe=recipe, seed=seed)
    log(f"{recipe} seed {seed}: {time.perf_counter() - t0:.0f} s, final {curve[-1]}")
    return curve


def read_curve(path: str) -> list[dict]:
    """The validation-time digits metrics of a CSVLogger metrics.csv, by step."""
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            values = {m: row.get(f"val/{m}") for m in METRICS}
            if all(values.values()):
                # a validation after s optimiser steps is logged at step s - 1
                by_step[int(row["step"]) + 1] = {m: float(v) for m, v in values.items() if v is not None}
    return [{"step": s, **by_step[s]} for s in sorted(by_step)]


def summarise(
    curves: dict[str, list[dict]], metrics: Sequence[str] = METRICS, target: str = "digits_fd_svc"
) -> tuple[list[dict], dict[str, Any]]:
    """Mean and sd over seeds of each recipe's ``metrics`` at every step, and the first step at which
    each recipe's mean ``target`` (lower is better) reaches DDPM's final one."""
    rows = []
    for recipe, points in curves.items():
        for step in sorted({p["step"] for p in points}):
            at = [p for p in points if p["step"] == step]
            row: dict[str, Any] = {"recipe": recipe, "step": step, "seeds": len(at)}
            for m in metrics:
                vals = [p[m] for p in at]
                row[m] = statistics.fmean(vals)
                row[m + "_sd"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
            rows.append(row)
    return rows, reached(rows, target)


def reached(rows: list[dict], target: str = "digits_fd_svc", baseline: str = "ddpm") -> dict[str, Any]:
    """The first step at which each recipe's mean ``target`` (lower is better) reaches the ``baseline``
    recipe's final one (``reach["target"]``); None where it never does; empty without baseline rows."""
    reach: dict[str, Any] = {}
    base = [r for r in rows if r["recipe"] == baseline]
    if base:
        goal = max(base, key=lambda r: r["step"])[target]
        reach["target"] = goal
        for recipe in dict.fromkeys(r["recipe"] for r in rows):
            hit = [r["step"] for r in rows if r["recipe"] == recipe and r[target] <= goal]
            reach[recipe] = min(hit) if hit else None
    return reach


def kept_rows(path: str, replaced: Sequence[str]) -> list[dict]:
    """The summary rows of a results csv (``--output``'s) whose recipe is not in ``replaced``: the
    recipes measured earlier, merged with those run now instead of being rerun."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["recipe"] not in replaced]
    return [
        {k: v if k == "recipe" else int(v) if k in ("step", "seeds") else float(v) for k, v in r.items()} for r in rows
    ]


def plot(
    rows: list[dict],
    path: str,
    metrics: Sequence[str] = METRICS,
    title: str = "digits demo: quality vs training step (mean +- sd over seeds)",
    figsize: tuple[float, float] = (15, 4.4),
    dpi: int = 90,
) -> None:
    """Each metric vs step, mean +- sd over seeds, one line per recipe (distances on a log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=figsize)
    for ax, m in zip(axes, metrics):
        for recipe in dict.fromkeys(r["recipe"] for r in rows):
            pts = [r for r in rows if r["recipe"] == recipe]
            steps = [r["step"] for r in pts]
            mean = [r[m] for r in pts]
            sd = [r[m + "_sd"] for r in pts]
            ax.plot(steps, mean, marker="o", ms=3, label=recipe)
            ax.fill_between(steps, [a - b for a, b in zip(mean, sd)], [a + b for a, b in zip(mean, sd)], alpha=0.15)
        ax.set_xlabel("optimiser step")
        ax.set_title(m.replace("digits_", "").replace("_", " "))
        if "accuracy" not in m:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)  # the committed plot stays under the repository's 200 KB
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--num-samples", type=int, default=250, help="digits sampled per evaluation (balanced 0-9)")
    p.add_argument("--sample-steps", type=int, default=50)
    p.add_argument("--workdir", default=os.path.join(REPO, "outputs", "bench_recipes"))
    p.add_argument("--output", default=OUT_STEM, help="stem of the .md/.csv/.png results")
    p.add_argument(
        "--report-only", action="store_true", help="summarise the runs already finished under --workdir, run nothing"
    )
    p.add_argument(
        "--keep-others",
        action="store_true",
        help="keep the rows of the recipes not in --recipes from the existing --output csv (measured earlier) "
        "in the results, instead of dropping them",
    )
    args = p.parse_args()
    curves: dict[str, list[dict]] = {}
    if args.report_only:
        curves = finished_curves(args.workdir, args.recipes, args.seeds)
        args.seeds = sorted({p["seed"] for points in curves.values() for p in points})
        rows, reach = summarise(curves)
        report(args, rows, reach, 0.0)
        return
    os.makedirs(args.workdir, exist_ok=True)
    store, _ = prepare(args.workdir)
    encoder = train_encoder(args.workdir, store) if "flow-repa" in args.recipes else None
    t0 = time.perf_counter()
    for seed in args.seeds:  # seed by seed: an interrupted benchmark has every recipe for the first seeds
        for recipe in args.recipes:
            curves.setdefault(recipe, []).extend(run_one(args, recipe, seed, store, encoder))
    rows, reach = summarise(curves)
    report(args, rows, reach, time.perf_counter() - t0)


def seeds_text(rows: list[dict]) -> str:
    """ "3 seeds", or each recipe's count where they differ (a recipe added later with fewer runs)."""
    counts = {r["recipe"]: r["seeds"] for r in rows if r["step"] == max(x["step"] for x in rows)}
    if len(set(counts.values())) <= 1:
        return f"{next(iter(counts.values()), 0)} seeds per recipe"
    return "seeds per recipe: " + ", ".join(f"{n} for {recipe}" for recipe, n in counts.items())


def report(args: argparse.Namespace, rows: list[dict], reach: dict[str, Any], seconds: float) -> None:
    from dit_lightning.atomic import write_text

    kept: list[str] = []
    if args.keep_others:
        earlier = kept_rows(args.output + ".csv", args.recipes)
        kept = list(dict.fromkeys(r["recipe"] for r in earlier))
        rows = earlier + rows
        reach = reached(rows)

    cols = ["recipe", "step", "seeds"] + [c for m in METRICS for c in (m, m + "_sd")]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)
    write_text(args.output + ".csv", buf.getvalue())
    final = [r for r in rows if r["step"] == max(x["step"] for x in rows)]
    lines = [
        "# Training recipes on the digits demo: quality vs step",
        "",
        f"{dt.date.today().isoformat()}, {platform.processor() or platform.machine()} CPU, "
        f"torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}"
        + (f"; {seconds / 60:.0f} min for the runs made now." if seconds else "; summarised from the finished runs.")
        + (
            f" The rows of {', '.join(kept)} are kept from the earlier table (the same settings, not rerun)."
            if kept
            else ""
        ),
        "",
        f"    python benchmarks/bench_recipes.py --recipes {' '.join(args.recipes)} --seeds "
        f"{' '.join(map(str, args.seeds))} --steps {args.steps} --eval-every {args.eval_every} "
        f"--num-samples {args.num_samples} --sample-steps {args.sample_steps}",
        "",
        f"The demo network and recipe ({args.steps} steps, batch 128, AdamW 1e-3, EMA 0.999 with warm-up), "
        f"{seeds_text(rows)}; every {args.eval_every} steps {args.num_samples} digits from the "
        f"EMA weights ({args.sample_steps} sampling steps, cfg 2.0). Mean +- standard deviation over seeds. "
        "fd: Frechet distance (lower is better), in pixel space and in the independent classifier's space.",
        "",
        f"## At step {final[0]['step'] if final else '-'}",
        "",
        "| recipe | accuracy | fd pixels | fd classifier | steps to DDPM's final fd classifier |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in final:
        hit = reach.get(r["recipe"])
        lines.append(
            f"| {r['recipe']} | {r['digits_accuracy']:.3f} +- {r['digits_accuracy_sd']:.3f} "
            f"| {r['digits_fd_pixels']:.3f} +- {r['digits_fd_pixels_sd']:.3f} "
            f"| {r['digits_fd_svc']:.3f} +- {r['digits_fd_svc_sd']:.3f} | {hit if hit is not None else 'not reached'} |"
        )
    if "target" in reach:
        lines += ["", f"DDPM's final fd classifier (the target): {reach['target']:.3f}."]
    lines += [
        "",
        "## Every evaluation",
        "",
        "| recipe | step | accuracy | fd pixels | fd classifier |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {r['step']} | {r['digits_accuracy']:.3f} +- {r['digits_accuracy_sd']:.3f} "
            f"| {r['digits_fd_pixels']:.3f} +- {r['digits_fd_pixels_sd']:.3f} "
            f"| {r['digits_fd_svc']:.3f} +- {r['digits_fd_svc_sd']:.3f} |"
        )
    md = "\n".join(lines) + "\n"
    write_text(args.output + ".md", md)
    try:
        plot(rows, args.output + ".png")
    except ImportError:  # matplotlib: the notebooks / test extra
        log("matplotlib not installed: no plot")
    print(md)
    if any(math.isnan(r["digits_fd_svc"]) for r in rows):
        raise SystemExit("a metric is NaN")


if __name__ == "__main__":
    main()
