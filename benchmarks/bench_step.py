"""Training-step overhead: dit-lightning's step (DiTModule + a Lightning Trainer) over a bare PyTorch loop.

Both sides train the same DiT (``build_dit`` with the module's arguments, same seed, so the same
initial weights) on the same pre-built batches of random latents ``{"x", "y", "index"}``, served by
the same kind of ``DataLoader`` (``batch_size=None`` over a list of whole batches: nothing is
collated during the measurement), in fp32 on the CPU with a fixed number of torch threads:

* **bare**: the loop a user would write: the diffusion loss with the timesteps, noise and label
  dropout keyed exactly as ``DiTModule.diffusion_loss`` keys them, ``zero_grad(set_to_none=True)``,
  ``backward``, ``AdamW(lr=1e-4, weight_decay=0, foreach=True)`` (what the module configures on a
  CPU), then the EMA with the module's op (``ema_update_``, one ``_foreach_lerp_``, decay 0.9999);
* **dit-lightning**: ``DiTModule`` trained by ``L.Trainer(accelerator="cpu", precision="32-true")``
  without logger, checkpoints, progress bar, model summary or validation, ``log_every_n_steps`` 50;
* **dit-lightning + auto-fit** (``--autofit GIB``): the same with ``AutoFit(memory_gib=GIB)``
  (step mode: manual optimisation, the step split by the setting in force); 'n/a' with the reason
  when the callback cannot be built or run.

A step is timed from its start (``on_train_batch_start``; the bare loop: once its batch is fetched)
to the start of the next, so everything the loop does between two steps counts; the last step of a
round only closes the clock. Wall time (``time.perf_counter``) and the process's CPU time
(``time.process_time``, steadier on a shared machine) are both recorded. The variants alternate in
one process, each round a fresh model, optimiser and Trainer with ``--warmup`` untimed steps; the
order is reversed every other round (A B, B A, ...) so a slow drift of the machine's load cancels.
Overhead = median step of dit-lightning / median step of bare - 1, over all timed steps, and per
round (each round's pair of medians) for the spread. As a check that both sides compute the same
step, the largest difference of their per-step losses is reported (identical computation: 0).

    python benchmarks/bench_step.py                                 # DiT-S/4, batch 16, 1 thread
    python benchmarks/bench_step.py --threads 2 --rounds 7 --autofit 64
    python benchmarks/bench_step.py --quick --output /tmp/bench     # tiny custom DiT: a smoke test

Writes ``step_overhead_cpu.{md,csv}`` to ``--output`` (default docs/benchmarks; ``--quick``:
outputs/bench-step-quick).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import datetime as dt
import gc
import io
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from dit_lightning.atomic import write_text
from dit_lightning.diffusion import create_diffusion
from dit_lightning.distributed.ops import ema_update_
from dit_lightning.keyed_random import keyed_normal, keyed_randint, keyed_uniform, sample_keys
from dit_lightning.models import build_dit
from dit_lightning.module import DiTModule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL_PCT = 3.0  # the goal: at most 3% over the bare loop (DiT-S/4, batch 16, fp32, CPU)
EMA_DECAY = 0.9999  # DiTModule's default
# DiTModule.diffusion_loss's random streams (timesteps, noise, label dropout), keyed on (seed, step, index)
STREAM_T, STREAM_NOISE, STREAM_DROP = 1, 2, 3
# --quick: a tiny custom DiT, a few steps (sizes given explicitly still win)
QUICK: dict[str, Any] = dict(
    model="custom", latent_shape="4,8,8", num_classes=10, depth=2, hidden_size=32, num_heads=2, patch_size=2, batch=4
)
QUICK_RUN = dict(steps=3, rounds=2, warmup=1)

BARE, LIGHTNING, AUTOFIT = "bare PyTorch loop", "dit-lightning", "dit-lightning + auto-fit"
HEADER = [
    "variant",
    "median_step_ms",
    "iqr_step_ms",
    "median_cpu_ms",
    "images_per_s",
    "overhead_pct",
    "overhead_ms",
    "overhead_cpu_pct",
    "round_overhead_min_pct",
    "round_overhead_median_pct",
    "round_overhead_max_pct",
    "round_cpu_overhead_min_pct",
    "round_cpu_overhead_median_pct",
    "round_cpu_overhead_max_pct",
    "round_medians_ms",
    "max_loss_diff",
    "steps_timed",
    "note",
]
META = ["model", "latent_shape", "num_classes", "batch", "threads", "rounds", "steps", "warmup", "date", "machine"]
META += ["torch", "lightning", "command"]


# ---- data -------------------------------------------------------------------------------------------
def make_batches(count: int, batch: int, latent_shape: Sequence[int], num_classes: int, seed: int) -> list[dict]:
    """``count`` whole batches of random latents with labels and distinct sample indices."""
    g = torch.Generator().manual_seed(seed + 1)
    return [
        {
            "x": torch.randn(batch, *latent_shape, generator=g),
            "y": torch.randint(0, num_classes, (batch,), generator=g),
            "index": torch.arange(k * batch, (k + 1) * batch),
        }
        for k in range(count)
    ]


class BatchList(Dataset):
    """``length`` items cycling over pre-built batches: a ``DataLoader(batch_size=None)`` only hands them out."""

    def __init__(self, batches: list[dict], length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return self.batches[i % len(self.batches)]


def loader(batches: list[dict], length: int) -> DataLoader:
    return DataLoader(BatchList(batches, length), batch_size=None, shuffle=False, num_workers=0)


class BatchesDataModule(L.LightningDataModule):
    """The same loader as a data module: auto-fit reads the global batch from ``global_batch_size``."""

    def __init__(self, batches: list[dict], length: int) -> None:
        super().__init__()
        self.batches, self.length = batches, length
        self.global_batch_size = int(batches[0]["x"].shape[0])

    def train_dataloader(self) -> DataLoader:
        return loader(self.batches, self.length)


# ---- timing -----------------------------------------------------------------------------------------
@dataclass
class Round:
    """One variant's timed steps in one round: per-step wall and CPU seconds, losses, threads seen."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    threads: set[int] = field(default_factory=set)
    note: str = ""


class StepClock:
    """Ticks at the start of every step; step ``i`` lasts from its tick to the next one.
    The first ``warmup`` steps are not kept."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.ticks: list[tuple[float, float]] = []
        self.round = Round()

    def tick(self) -> None:
        self.ticks.append((time.perf_counter(), time.process_time()))
        self.round.threads.add(torch.get_num_threads())

    def finish(self) -> Round:
        kept = self.ticks[self.warmup :]
        self.round.wall = [b[0] - a[0] for a, b in zip(kept, kept[1:])]
        self.round.cpu = [b[1] - a[1] for a, b in zip(kept, kept[1:])]
        return self.round


class ClockCallback(L.Callback):
    """The Lightning side of :class:`StepClock` (and the loss each step returned)."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.clock.tick()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if torch.is_tensor(loss):
            self.clock.round.losses.append(float(loss.detach()))


# ---- the two steps ----------------------------------------------------------------------------------
@dataclass
class Spec:
    """What both sides build: DiTModule's arguments and the matching ``build_dit`` call."""

    model: str
    latent_shape: list[int]
    num_classes: int
    sizes: dict[str, Optional[int]]
    batch: int
    seed: int = 0
    class_dropout_prob: float = 0.1  # DiTModule's default

    def module_kwargs(self) -> dict[str, Any]:
        return dict(model=self.model, latent_shape=self.latent_shape, num_classes=self.num_classes, **self.sizes)

    def build(self) -> nn.Module:
        """The network exactly as ``DiTModule.__init__`` builds it (same arguments, same RNG draws)."""
        c, h, _ = self.latent_shape
        return build_dit(
            self.model,
            input_size=h,
            in_channels=c,
            num_classes=self.num_classes,
            mlp_ratio=4.0,
            learn_sigma=True,
            class_dropout_prob=self.class_dropout_prob,
            **self.sizes,
        )


def bare_loss(model: nn.Module, diffusion: Any, batch: dict[str, Tensor], step: int, spec: Spec) -> Tensor:
    """The loss of ``DiTModule.diffusion_loss`` (train=True): keyed timesteps, noise and label dropout."""
    x, y, index = batch["x"], batch["y"], batch["index"]
    keys = sample_keys(index, spec.seed, step)
    t = keyed_randint(keys, diffusion.num_timesteps, stream=STREAM_T)
    noise = keyed_normal(keys, x.shape[1:], stream=STREAM_NOISE).to(x.dtype)
    drop = keyed_uniform(keys, (), stream=STREAM_DROP) < spec.class_dropout_prob
    terms = diffusion.training_losses(model, x, t, model_kwargs={"y": y, "force_drop_ids": drop}, noise=noise)
    return terms["loss"].mean()


def run_bare(spec: Spec, batches: list[dict], warmup: int, steps: int) -> Round:
    torch.manual_seed(spec.seed)
    model = spec.build().train()
    ema = copy.deepcopy(model).requires_grad_(False).eval()
    diffusion = create_diffusion("")
    params = [p for p in model.parameters() if p.requires_grad]
    # the module's CPU configuration (fused AdamW is CUDA-only; foreach elsewhere)
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0, foreach=True)
    clock = StepClock(warmup)
    total = warmup + steps + 1  # the last step's tick closes the clock
    for step, batch in enumerate(loader(batches, total)):
        clock.tick()
        if step == total - 1:
            break
        loss = bare_loss(model, diffusion, batch, step, spec)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ema_update_(ema, model, 1.0 - EMA_DECAY)
        clock.round.losses.append(float(loss.detach()))
    return clock.finish()


def run_lightning(
    spec: Spec, batches: list[dict], warmup: int, steps: int, autofit_gib: Optional[float], quiet: bool = False
) -> Round:
    torch.manual_seed(spec.seed)
    module = DiTModule(**spec.module_kwargs())
    clock = StepClock(warmup)
    callbacks: list[L.Callback] = [ClockCallback(clock)]
    total = warmup + steps + 1
    if autofit_gib is not None:
        from dit_lightning.callbacks.autofit import AutoFit

        callbacks.append(AutoFit(memory_gib=autofit_gib))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        log_every_n_steps=50,
        callbacks=callbacks,
    )
    data = BatchesDataModule(batches, total + 1)  # one batch spare: the epoch never ends inside a round
    if autofit_gib is None:
        trainer.fit(module, train_dataloaders=data.train_dataloader())
    else:
        # auto-fit prints its decision table: once is enough
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            trainer.fit(module, datamodule=data)
        fit = callbacks[-1]
        setting = getattr(fit, "setting", None)
        short = getattr(setting, "short", None)
        clock.round.note = (
            f"setting {short() if callable(short) else setting}; step mode {getattr(fit, 'step_mode', '?')}"
        )
    clock.round.losses = clock.round.losses[: warmup + steps]  # the closing step is not compared
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    expected = dict(lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0, foreach=True)
    if optimizer is not None:
        got = {k: optimizer.defaults.get(k) for k in expected}
        if got != expected or type(optimizer) is not torch.optim.AdamW:
            clock.round.note += f" optimiser differs from the bare loop's: {type(optimizer).__name__} {got}"
    return clock.finish()


# ---- the benchmark ----------------------------------------------------------------------------------
def quantile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarise(name: str, rounds: list[Round], base: Optional[list[Round]], batch: int) -> dict[str, Any]:
    wall = [w for r in rounds for w in r.wall]
    cpu = [c for r in rounds for c in r.cpu]
    row: dict[str, Any] = dict.fromkeys(HEADER, "")
    med = statistics.median(wall)
    row.update(
        variant=name,
        median_step_ms=round(1e3 * med, 2),
        iqr_step_ms=round(1e3 * (quantile(wall, 0.75) - quantile(wall, 0.25)), 2),
        median_cpu_ms=round(1e3 * statistics.median(cpu), 2),
        images_per_s=round(batch / med, 2),
        round_medians_ms=";".join(f"{1e3 * statistics.median(r.wall):.1f}" for r in rounds),
        steps_timed=len(wall),
        note="; ".join(sorted({r.note.strip() for r in rounds if r.note.strip()})),
    )
    if base is not None:
        base_wall = [w for r in base for w in r.wall]
        base_cpu = [c for r in base for c in r.cpu]
        diffs = [abs(a - b) for r, rb in zip(rounds, base) for a, b in zip(r.losses, rb.losses)]
        row.update(
            overhead_pct=round(100 * (med / statistics.median(base_wall) - 1), 2),
            overhead_ms=round(1e3 * (med - statistics.median(base_wall)), 2),
            overhead_cpu_pct=round(100 * (statistics.median(cpu) / statistics.median(base_cpu) - 1), 2),
            max_loss_diff=f"{max(diffs):.2g}" if diffs else "n/a",
        )
        for clock, prefix in (("wall", "round_overhead"), ("cpu", "round_cpu_overhead")):
            # each round's pair of medians (same round: the same stretch of the machine's load)
            per_round = [
                100 * (statistics.median(getattr(r, clock)) / statistics.median(getattr(b, clock)) - 1)
                for r, b in zip(rounds, base)
            ]
            for stat, fn in (("min", min), ("median", statistics.median), ("max", max)):
                row[f"{prefix}_{stat}_pct"] = round(fn(per_round), 2)
    return row


def unavailable(name: str, reason: str) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(HEADER, "n/a")
    row.update(variant=name, round_medians_ms="", note=reason)
    return row


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def quiet_lightning() -> None:
    """No Trainer banners per round; no warnings about the loader's workers or the tiny epoch."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*number of training batches.*")
    warnings.filterwarnings("ignore", message=".*validation_step.* but have no .val_dataloader.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def fmt(value: Any, signed: str = "") -> str:
    """A table cell: '-' for nothing, 'n/a' kept, ``signed`` numbers as ``+1.23<signed>``."""
    if value in ("", None):
        return "-"
    if value == "n/a" or not signed:
        return str(value)
    return f"{value:+.2f}{signed if signed != ' ' else ''}"


def spread(row: dict[str, Any], prefix: str) -> str:
    """The per-round overheads of a row as ``min / median / max%``."""
    lo = row[f"{prefix}_min_pct"]
    if lo in ("", "n/a"):
        return fmt(lo)
    return f"{lo:+.2f} / {row[f'{prefix}_median_pct']:+.2f} / {row[f'{prefix}_max_pct']:+.2f}%"


def judge(row: dict[str, Any], overall: str, prefix: str) -> str:
    """The overhead against the goal: met when every round is within it, not met when none is."""
    lo, hi = row[f"{prefix}_min_pct"], row[f"{prefix}_max_pct"]
    state = "met" if hi <= GOAL_PCT else "not met" if lo > GOAL_PCT else "inconclusive (the rounds straddle it)"
    return f"{row[overall]:+.2f}% (rounds {lo:+.2f}% to {hi:+.2f}%): {state}"


def markdown(rows: list[dict], meta: dict[str, Any], load: tuple[float, float], spec: Spec, args: Any) -> str:
    header = [
        "variant",
        "median step (ms)",
        "IQR (ms)",
        "images/s",
        "overhead (wall)",
        "overhead (ms/step)",
        "wall, per round min / median / max",
        "CPU ms/step",
        "overhead (CPU time)",
        "CPU, per round min / median / max",
        "max loss diff",
    ]
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        table.append(
            f"| {r['variant']} | {r['median_step_ms']} | {r['iqr_step_ms']} | {r['images_per_s']} | "
            f"{fmt(r['overhead_pct'], '%')} | {fmt(r['overhead_ms'], ' ')} | {spread(r, 'round_overhead')} | "
            f"{r['median_cpu_ms']} | {fmt(r['overhead_cpu_pct'], '%')} | {spread(r, 'round_cpu_overhead')} | "
            f"{fmt(r['max_loss_diff'])} |"
        )
    notes = [
        f"- {r['variant']}: {'n/a: ' if r['median_step_ms'] == 'n/a' else ''}{r['note']}" for r in rows if r["note"]
    ]
    lit = next(r for r in rows if r["variant"] == LIGHTNING)
    verdict = []
    if isinstance(lit["overhead_pct"], float):
        verdict = [
            f"Goal: dit-lightning at most {GOAL_PCT:g}% over the bare loop (the issue: DiT-S/4, batch 16, fp32, CPU). "
            f"This run ({spec.model}, batch {spec.batch}):",
            "",
            f"- wall time: {judge(lit, 'overhead_pct', 'round_overhead')}",
            f"- CPU time: {judge(lit, 'overhead_cpu_pct', 'round_cpu_overhead')}",
        ]
        if load[1] > 1.5 * (os.cpu_count() or 1) or load[0] > 1.5 * (os.cpu_count() or 1):
            verdict.append(
                f"- the machine was busy (load average {load[0]:.1f} / {load[1]:.1f} on {os.cpu_count()} cores): "
                "wall time measured the other jobs as much as the step; the CPU time is the figure to read"
            )
    log_steps = [s for s in range(args.warmup, args.warmup + args.steps) if (s + 1) % 50 == 0]
    c, h, w = spec.latent_shape
    return "\n".join(
        [
            "# Training-step overhead: dit-lightning vs a bare PyTorch loop (cpu)",
            "",
            f"- date: {meta['date']}",
            f"- command: `{meta['command']}`",
            f"- machine: {meta['machine']}; load average {load[0]:.1f} before, {load[1]:.1f} after (1 min)",
            f"- software: Python {platform.python_version()}, torch {meta['torch']}, lightning {meta['lightning']}",
            f"- model: {spec.model}"
            + (
                f" ({', '.join(f'{k}={v}' for k, v in spec.sizes.items() if v is not None)})"
                if any(spec.sizes.values())
                else ""
            )
            + f" on {c}x{h}x{w} latents, {spec.num_classes} classes, {meta['params'] / 1e6:.1f}M parameters; "
            f"batch {spec.batch}, fp32, {args.threads} torch thread(s), AdamW lr 1e-4 foreach, EMA 0.9999",
            f"- {args.rounds} rounds x {args.steps} timed steps per variant after {args.warmup} untimed warm-up "
            "step(s) per round; variants alternate in one process (order reversed every other round), each round a "
            "fresh model, optimiser and Trainer; pre-built batches for both sides",
            "- step time: from a step's start (on_train_batch_start; bare: its batch fetched) to the next step's, "
            "so the loop's work between steps counts; overhead = median / bare median - 1 over all timed steps, "
            "and per round from that round's pair of medians; CPU time: the process's (steadier than wall time on "
            "a shared machine)",
            "- Lightning logs every 50 steps (the gradient norm is computed on those steps): "
            + (
                f"timed steps {log_steps} of each round are logging steps"
                if log_steps
                else "no timed step is a logging step (rounds are shorter), so that cost is not in these numbers"
            ),
            "- max loss diff: largest |loss - bare loss| at the same step (0: the two sides compute the same step)",
            "",
            *table,
            "",
            *([*verdict, ""] if verdict else []),
            *([*notes, ""] if notes else []),
        ]
    )


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a registered DiT name or 'custom' (default DiT-S/4)")
    p.add_argument("--latent-shape", default=None, help="C,H,W of the latents (default 4,32,32)")
    p.add_argument("--num-classes", type=int, default=None, help="default 1000")
    p.add_argument("--depth", type=int, default=None, help="override the model's depth (custom: required)")
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--num-heads", type=int, default=None)
    p.add_argument("--patch-size", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="samples per step (default 16)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per round and variant (default 20)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps at the start of every round (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--autofit", type=float, default=None, metavar="GIB", help="add AutoFit(memory_gib=GIB) as a variant"
    )
    p.add_argument("--output", default=None, help="directory of step_overhead_cpu.{md,csv} (default docs/benchmarks)")
    p.add_argument("--quick", action="store_true", help="a tiny custom DiT and a few steps: a smoke test")
    args = p.parse_args(argv)
    defaults: dict[str, Any] = dict(model="DiT-S/4", latent_shape="4,32,32", num_classes=1000, batch=16)
    defaults.update(steps=20, rounds=5, warmup=3, output=os.path.join(REPO, "docs", "benchmarks"))
    if args.quick:
        defaults.update(QUICK, **QUICK_RUN)
        defaults["output"] = os.path.join(REPO, "outputs", "bench-step-quick")
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if min(args.steps, args.rounds, args.batch, args.threads) < 1 or args.warmup < 0:
        p.error("--steps, --rounds, --batch and --threads must be at least 1, --warmup at least 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_lightning()
    latent_shape = [int(v) for v in str(args.latent_shape).split(",")]
    sizes = dict(depth=args.depth, hidden_size=args.hidden_size, num_heads=args.num_heads, patch_size=args.patch_size)
    spec = Spec(args.model, latent_shape, args.num_classes, sizes, args.batch, seed=args.seed)
    batches = make_batches(8, args.batch, latent_shape, args.num_classes, args.seed)
    params = sum(p.numel() for p in spec.build().parameters())

    variants: list[tuple[str, Callable[[], Round]]] = [
        (BARE, lambda: run_bare(spec, batches, args.warmup, args.steps)),
        (LIGHTNING, lambda: run_lightning(spec, batches, args.warmup, args.steps, None)),
    ]
    if args.autofit is not None:
        variants.append(
            (
                AUTOFIT,
                lambda: run_lightning(
                    spec, batches, args.warmup, args.steps, args.autofit, quiet=bool(results[AUTOFIT])
                ),
            )
        )
    results: dict[str, list[Round]] = {name: [] for name, _ in variants}
    failed: dict[str, str] = {}
    load_before = os.getloadavg()
    start = time.perf_counter()
    for k in range(args.rounds):
        order: Iterable[tuple[str, Callable[[], Round]]] = variants if k % 2 == 0 else reversed(variants)
        for name, run in order:
            if name in failed:
                continue
            try:
                r = run()
            except Exception as error:  # only the optional auto-fit variant may fail (an API that moved)
                if name != AUTOFIT:
                    raise
                failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
                print(f"round {k + 1}: {name}: n/a ({failed[name]})", file=sys.stderr)
                continue
            finally:
                gc.collect()
            if r.threads != {args.threads}:
                raise RuntimeError(f"{name} ran with {sorted(r.threads)} torch threads, not {args.threads}")
            results[name].append(r)
            print(
                f"round {k + 1}/{args.rounds}: {name:26s} median {1e3 * statistics.median(r.wall):9.1f} ms/step "
                f"(CPU {1e3 * statistics.median(r.cpu):9.1f} ms)  [{time.perf_counter() - start:.0f}s]",
                file=sys.stderr,
            )
    elapsed = time.perf_counter() - start
    rows = []
    for name, _ in variants:
        if name in failed:
            rows.append(unavailable(name, failed[name]))
        else:
            rows.append(summarise(name, results[name], None if name == BARE else results[BARE], args.batch))

    meta: dict[str, Any] = dict(
        model=args.model,
        latent_shape="x".join(map(str, latent_shape)),
        num_classes=args.num_classes,
        batch=args.batch,
        threads=args.threads,
        rounds=args.rounds,
        steps=args.steps,
        warmup=args.warmup,
        date=dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        machine=f"{cpu_model()}, {os.cpu_count()} cores; {platform.platform()}",
        torch=torch.__version__,
        lightning=L.__version__,
        command=" ".join(["python benchmarks/bench_step.py", *(sys.argv[1:] if argv is None else argv)]),
        params=params,
    )
    md = markdown(rows, meta, (load_before[0], os.getloadavg()[0]), spec, args)
    md += f"\nThe rounds took {elapsed:.0f} s ({elapsed / 60:.1f} min), model and Trainer set-up included.\n"
    os.makedirs(args.output, exist_ok=True)
    stem = os.path.join(args.output, "step_overhead_cpu")
    write_text(stem + ".md", md)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=HEADER + META)
    w.writeheader()
    for row in rows:
        w.writerow({**row, **{k: meta[k] for k in META}})
    write_text(stem + ".csv", buf.getvalue())
    print(md)
    print(f"written to {stem}.md and {stem}.csv", file=sys.stderr)


if __name__ == "__main__":
    main()
