"""Shrinking a DiT on the digits demo: what pruning and distillation cost and what they recover.

For the demo model (the teacher) and its shrunk versions it reports parameters, GMACs per
image (``flops.py``), training throughput (images/s of one optimiser step, all models timed
side by side in interleaved rounds in this one process so they share the machine's load),
peak memory (peak RSS of a fresh subprocess per configuration that runs a few training steps,
minus that of the same subprocess without a model), and the quality before and after a
short fine-tune: the diffusion loss on the held-out digits at fixed timesteps and noise, and
the digits accuracy (an SVC trained on real digits classifies generated ones,
``dit_lightning.evaluation.digits``).

    python benchmarks/bench_shrink.py                         # uses outputs/demo/last.ckpt
    python benchmarks/bench_shrink.py --teacher path/to.ckpt --finetune-steps 300

Without the demo checkpoint it trains a teacher itself (the demo's configuration,
``--teacher-steps`` steps). Results go to stdout and docs/benchmarks/shrink_cpu.{md,csv}.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_CKPT = os.path.join(REPO, "outputs", "demo", "last.ckpt")
# The demo's model (configs/demo.yaml) and recipe.
DEMO: dict[str, Any] = dict(
    model="custom", depth=6, hidden_size=128, num_heads=4, patch_size=2, ema_decay=0.999, ema_warmup=True, cfg_scale=2.0
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------
# Data, teacher and training
# --------------------------------------------------------------------------------------


def digits_data(workdir: str, batch_size: int):
    from dit_lightning.data import LatentDataModule, prepare_digits

    path = prepare_digits(os.path.join(workdir, "digits"))
    dm = LatentDataModule(path, global_batch_size=batch_size, val_size=197, num_workers=0, random_flip=False)
    dm.setup("fit")
    return path, dm


def fit(module, dm, steps: int) -> float:
    """``steps`` optimiser steps with Lightning on the digits store; returns seconds."""
    import lightning as L

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    return time.perf_counter() - t0


def train_teacher(workdir: str, dm, steps: int) -> str:
    import lightning as L

    from dit_lightning.module import DiTModule

    L.seed_everything(0, verbose=False)
    opt = lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.0)  # noqa: E731 (the demo's)
    module = DiTModule(
        **DEMO,
        latent_shape=dm.latent_shape,
        num_classes=dm.num_classes,
        vae=dm.spec.vae,
        optimizer=opt,
        sample_steps=100,
    )
    log(f"no demo checkpoint: training the demo model for {steps} steps")
    seconds = fit(module, dm, steps)
    path = os.path.join(workdir, "teacher.ckpt")
    module.trainer.save_checkpoint(path)
    log(f"teacher trained in {seconds:.0f} s -> {path}")
    return path


def make_module(
    cfg: dict[str, Any], dm, init_from: Optional[str] = None, teacher: Optional[str] = None, lr: float = 3e-4, **kw
):
    """A (Distillation)Module of architecture ``cfg`` (a ``model_config``) for the digits."""
    from dit_lightning.distill import DistillationModule

    arch = {
        k: cfg[k]
        for k in ("depth", "hidden_size", "num_heads", "patch_size", "mlp_ratio", "attn_dim")
        if cfg.get(k) is not None
    }
    opt = lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.0)  # noqa: E731
    module = DistillationModule(
        teacher=teacher,
        model="custom",
        latent_shape=dm.latent_shape,
        num_classes=dm.num_classes,
        vae=dm.spec.vae,
        init_from=init_from,
        optimizer=opt,
        cfg_scale=2.0,
        sample_steps=100,
        **arch,
        **kw,
    )
    return module


# --------------------------------------------------------------------------------------
# Quality
# --------------------------------------------------------------------------------------


def quality(net, val_batch, diffusion, module=None, per_class: int = 0, sample_steps: int = 50) -> dict[str, Any]:
    from dit_lightning.models.pruning import calibration_inputs, calibration_loss

    out: dict[str, Any] = {
        "val_loss": calibration_loss(
            net, diffusion, calibration_inputs(val_batch, diffusion.num_timesteps, draws=4, seed=123)
        )
    }
    if per_class and module is not None:
        from dit_lightning.evaluation.digits import digits_accuracy

        out["accuracy"] = digits_accuracy(module, per_class=per_class, num_steps=sample_steps, cfg_scale=2.0)[
            "accuracy"
        ]
    return out


def module_for(net, dm, path: str):
    """A DiTModule holding ``net`` (saved at ``path``) as raw and EMA weights, for sampling."""
    from dit_lightning.models import model_config

    return make_module(model_config(net), dm, init_from=path).eval()


# --------------------------------------------------------------------------------------
# Speed and memory
# --------------------------------------------------------------------------------------


def step_fn(module, batch):
    """One full training step of ``module`` (loss, backward, AdamW, EMA) as a closure."""
    module.train()
    params = [p for p in module.model.parameters() if p.requires_grad] + list(module.feature_proj.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    counter = [0]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = module.distillation_loss(module.model, batch, counter[0], train=True)["loss"]
        loss.backward()
        opt.step()
        module.update_ema()
        counter[0] += 1

    return step


def throughput(steppers: dict[str, Any], batch_size: int, steps: int, rounds: int) -> dict[str, float]:
    """Median images/s per configuration over ``rounds`` interleaved rounds of ``steps`` steps."""
    for step in steppers.values():  # warm-up: allocator, kernels, lazy teacher move
        step()
        step()
    times: dict[str, list[float]] = {k: [] for k in steppers}
    for _ in range(rounds):
        for name, step in steppers.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times[name].append((time.perf_counter() - t0) / steps)
    return {k: batch_size / statistics.median(v) for k, v in times.items()}


def child_peak_rss(spec: dict[str, Any]) -> dict[str, Any]:
    """Peak RSS (MiB) of a fresh interpreter that builds the configuration and trains a few
    steps, counted from after its imports (``peak_MiB``), and its RSS then (``start_MiB``)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory child failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_main(spec: dict[str, Any]) -> None:
    torch.set_num_threads(spec["threads"])
    import numpy as np

    from dit_lightning.checkpoints import load_dit

    # The same imports with or without a model, so the baseline subtracts them.
    from dit_lightning.data import LatentDataModule
    from dit_lightning.data.datamodule import LatentBatchDataset
    from dit_lightning.distill import DistillationModule  # noqa: F401
    from dit_lightning.models import model_config

    ds = LatentBatchDataset(spec["store"], train=False)
    batch = ds.get_batch(np.arange(spec["batch_size"]))
    # Importing torch and Lightning peaks above what a tiny model then uses, so reset the
    # kernel's high-water mark (Linux: clear_refs 5) after the imports and read it at the end.
    before = _status_kib("VmRSS")
    reset = _reset_peak_rss()
    if spec.get("file"):
        dm = LatentDataModule(spec["store"], global_batch_size=spec["batch_size"], num_workers=0)
        net = load_dit(spec["file"]).net
        kw = {"alpha_diffusion": 1.0} if spec.get("teacher") else {}
        module = make_module(model_config(net), dm, init_from=spec["file"], teacher=spec.get("teacher"), **kw)
        step = step_fn(module, batch)
        for _ in range(spec["steps"]):
            step()
    peak = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    print(json.dumps({"peak_MiB": peak / 1024.0, "start_MiB": before / 1024.0, "reset": reset}))


def _status_kib(field: str) -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        pass
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--teacher", default=None, help=f"teacher checkpoint (default {os.path.relpath(DEMO_CKPT, REPO)} if it exists)"
    )
    ap.add_argument("--teacher-steps", type=int, default=600, help="steps of the teacher trained when there is none")
    ap.add_argument("--workdir", default=os.path.join(REPO, "outputs", "bench_shrink"))
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--finetune-steps", type=int, default=150)
    ap.add_argument(
        "--student-steps",
        type=int,
        default=None,
        help="steps of the students trained from scratch (default 2x finetune)",
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mem-steps", type=int, default=3)
    ap.add_argument("--per-class", type=int, default=20, help="generated digits per class for the accuracy (0: skip)")
    ap.add_argument("--sample-steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks", "shrink_cpu"))
    ap.add_argument("--note", default="", help="a line for the report (e.g. where the teacher came from)")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        child_main(json.loads(args._child))
        return
    args.student_steps = args.student_steps or 2 * args.finetune_steps
    torch.set_num_threads(args.threads)
    import lightning as L

    from dit_lightning.checkpoints import load_dit
    from dit_lightning.checkpoints import save_dit as save_pruned
    from dit_lightning.commands.prune import prune
    from dit_lightning.diffusion import create_diffusion
    from dit_lightning.models import DiTShape, dit_macs, model_config

    os.makedirs(args.workdir, exist_ok=True)
    store, dm = digits_data(args.workdir, args.batch_size)
    teacher = args.teacher or (DEMO_CKPT if os.path.exists(DEMO_CKPT) else None)
    if teacher is None:
        teacher = os.path.join(args.workdir, "teacher.ckpt")
        if not os.path.exists(teacher):
            train_teacher(args.workdir, dm, args.teacher_steps)
    log(f"teacher: {teacher}")
    diffusion = create_diffusion("")
    import numpy as np

    from dit_lightning.data.datamodule import LatentBatchDataset

    plain_ds = LatentBatchDataset(store, train=False)
    val_batch = plain_ds.get_batch(np.sort(dm.val_indices))
    calib = store
    W = args.workdir

    # ---- the shrunk models ------------------------------------------------------------------
    files: dict[str, str] = {}
    base_net = load_dit(teacher).net
    files["teacher (demo)"] = save_pruned(
        base_net, os.path.join(W, "teacher.pt"), ema=base_net, extra_args={"num_heads": base_net.num_heads}
    )
    files["depth 6->3"] = prune(teacher, os.path.join(W, "depth3.pt"), depth=3, calibration=calib, calibration_draws=2)
    files["mlp 4.0->2.0"] = prune(teacher, os.path.join(W, "mlp2.pt"), mlp_ratio=2.0)
    files["depth 3 + mlp 2.0"] = prune(
        teacher, os.path.join(W, "depth3-mlp2.pt"), depth=3, mlp_ratio=2.0, calibration=calib, calibration_draws=2
    )
    files["heads 4->2"] = prune(teacher, os.path.join(W, "heads2.pt"), heads=2)

    rows: dict[str, dict[str, Any]] = {}
    for name, f in files.items():
        net = load_dit(f).net
        cfg = model_config(net)
        rows[name] = {
            "config": name,
            "depth": cfg["depth"],
            "hidden": cfg["hidden_size"],
            "heads": cfg["num_heads"],
            "mlp_ratio": round(cfg["mlp_ratio"], 3),
            "params_M": sum(p.numel() for p in net.parameters()) / 1e6,
            "GMACs": dit_macs(DiTShape.of(net)) / 1e9,
        }
        q = quality(net, val_batch, diffusion, module_for(net, dm, f), args.per_class, args.sample_steps)
        rows[name].update(val_loss_pruned=q["val_loss"], acc_pruned=q.get("accuracy"))
        log(f"{name}: {rows[name]}")

    # ---- fine-tune the pruned models, with distillation from the teacher ---------------------------
    for name in ("depth 6->3", "mlp 4.0->2.0", "depth 3 + mlp 2.0", "heads 4->2"):
        net = load_dit(files[name]).net
        L.seed_everything(0, verbose=False)
        m = make_module(model_config(net), dm, init_from=files[name], teacher=teacher, ema_decay=0.99)
        secs = fit(m, dm, args.finetune_steps)
        q = quality(m.ema, val_batch, diffusion, m.eval(), args.per_class, args.sample_steps)
        rows[name].update(val_loss_finetuned=q["val_loss"], acc_finetuned=q.get("accuracy"), finetune_s=secs)
        log(f"{name} fine-tuned with distillation ({args.finetune_steps} steps, {secs:.0f} s): {q}")
    # The same repair without the teacher, for the most pruned model.
    name = "depth 3 + mlp 2.0"
    net = load_dit(files[name]).net
    L.seed_everything(0, verbose=False)
    m = make_module(model_config(net), dm, init_from=files[name], ema_decay=0.99)
    secs = fit(m, dm, args.finetune_steps)
    q = quality(m.ema, val_batch, diffusion, m.eval(), args.per_class, args.sample_steps)
    plain = dict(
        rows[name],
        config=name + ", plain fine-tune",
        val_loss_finetuned=q["val_loss"],
        acc_finetuned=q.get("accuracy"),
        finetune_s=secs,
    )
    rows[plain["config"]] = plain
    log(f"{name} fine-tuned without teacher: {q}")

    # ---- a small student distilled from scratch vs trained alone -------------------------------------
    student_cfg = dict(model_config(base_net), depth=3, hidden_size=96, num_heads=4, mlp_ratio=4.0)
    student_cfg.pop("attn_dim", None)
    kw: dict[str, Any]
    for label, kw in (
        ("student d3/h96, distilled", dict(teacher=teacher, feature_pairs=[(0, 1), (1, 3), (2, 5)], alpha_feature=0.1)),
        ("student d3/h96, alone", {}),
    ):
        L.seed_everything(0, verbose=False)
        m = make_module(student_cfg, dm, lr=1e-3, ema_decay=0.99, **kw)
        secs = fit(m, dm, args.student_steps)
        q = quality(m.ema, val_batch, diffusion, m.eval(), args.per_class, args.sample_steps)
        path = save_pruned(
            m.ema,
            os.path.join(
                W, label.split(",")[0].replace(" ", "_").replace("/", "") + ("-kd" if kw else "-alone") + ".pt"
            ),
            ema=m.ema,
        )
        files[label] = path
        rows[label] = {
            "config": label,
            "depth": 3,
            "hidden": 96,
            "heads": 4,
            "mlp_ratio": 4.0,
            "params_M": sum(p.numel() for p in m.model.parameters()) / 1e6,
            "GMACs": dit_macs(DiTShape.of(m.model)) / 1e9,
            "val_loss_finetuned": q["val_loss"],
            "acc_finetuned": q.get("accuracy"),
            "finetune_s": secs,
        }
        log(f"{label} ({args.student_steps} steps from scratch, {secs:.0f} s): {q}")

    # ---- speed, side by side -------------------------------------------------------------------
    speed_files = {k: v for k, v in files.items() if k != "student d3/h96, alone"}
    batch = plain_ds.get_batch(np.sort(dm.train_indices[: args.batch_size]))
    steppers = {}
    for name, f in speed_files.items():
        net = load_dit(f).net
        L.seed_everything(0, verbose=False)
        steppers[name] = step_fn(make_module(model_config(net), dm, init_from=f), batch)
    # The distillation step of the student: its own step plus the teacher's forward.
    net = load_dit(files["student d3/h96, distilled"]).net
    steppers["student d3/h96 + teacher fwd"] = step_fn(
        make_module(model_config(net), dm, init_from=files["student d3/h96, distilled"], teacher=teacher), batch
    )
    log("timing training steps side by side")
    ips = throughput(steppers, args.batch_size, args.steps, args.rounds)
    for name, v in ips.items():
        if name in rows:
            rows[name]["train_img_s"] = v
    rows["student d3/h96 + teacher fwd"] = {
        "config": "student d3/h96 + teacher fwd (distillation step)",
        "train_img_s": ips["student d3/h96 + teacher fwd"],
    }

    # ---- peak memory, one fresh process per configuration -----------------------------------------
    log("peak RSS per configuration")
    common = dict(store=store, batch_size=args.batch_size, steps=args.mem_steps, threads=args.threads)
    base = child_peak_rss(common)
    base_rss = base["peak_MiB"]
    for name, f in speed_files.items():
        rows[name]["peak_rss_MiB"] = child_peak_rss(dict(common, file=f))["peak_MiB"] - base_rss
    rows["student d3/h96 + teacher fwd"]["peak_rss_MiB"] = (
        child_peak_rss(dict(common, file=files["student d3/h96, distilled"], teacher=teacher))["peak_MiB"] - base_rss
    )
    base_rss = base["start_MiB"] if base["reset"] else base_rss

    write_report(list(rows.values()), args, teacher, base_rss)


COLUMNS = [
    ("config", "configuration", "{}"),
    ("depth", "depth", "{}"),
    ("hidden", "hidden", "{}"),
    ("heads", "heads", "{}"),
    ("mlp_ratio", "mlp ratio", "{}"),
    ("params_M", "params (M)", "{:.3f}"),
    ("GMACs", "MMACs/img", "{:.2f}"),
    ("train_img_s", "train img/s", "{:.0f}"),
    ("peak_rss_MiB", "peak RSS over base (MiB)", "{:.1f}"),
    ("val_loss_pruned", "val loss, pruned", "{:.4f}"),
    ("val_loss_finetuned", "val loss, fine-tuned", "{:.4f}"),
    ("acc_pruned", "digits acc, pruned", "{:.1%}"),
    ("acc_finetuned", "digits acc, fine-tuned", "{:.1%}"),
]


def write_report(rows: list[dict[str, Any]], args, teacher: str, base_rss: float) -> None:
    def fmt(row: dict[str, Any], key: str, f: str) -> str:
        v = row.get(key)
        if v is None:
            return ""
        if key == "GMACs":
            v = v * 1e3  # tiny models: MMACs read better
        return f.format(v)

    header = "| " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines = [header, "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(r, k, f) for k, _, f in COLUMNS) + " |" for r in rows]
    table = "\n".join(lines)
    cmd = "python " + shlex.join([os.path.relpath(os.path.abspath(sys.argv[0]), REPO), *sys.argv[1:]])
    shown = os.path.relpath(teacher, REPO) if os.path.abspath(teacher).startswith(REPO + os.sep) else teacher
    cpu = platform.processor() or platform.machine()
    machine = f"{socket.gethostname()}, {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads"
    md = f"""# Shrinking the digits DiT on CPU

- date: {dt.datetime.now().isoformat(timespec="seconds")}
- machine: {machine}
- command: `{cmd}`
- teacher: `{shown}` (EMA weights); batch {args.batch_size}; fine-tunes of {args.finetune_steps} steps
  (students from scratch: {args.student_steps}) with the digits store, AdamW, EMA 0.99
- train img/s: one full optimiser step (loss, backward, AdamW, EMA), median of {args.rounds} interleaved
  rounds of {args.steps} steps, all models in one process; the CPU is shared, so compare rows, not runs.
- peak RSS: high-water mark of a fresh process that builds the model and trains {args.mem_steps} steps,
  reset after its imports (Linux `clear_refs`), minus that of the same process without a model
  (which sits at {base_rss:.0f} MiB after the imports).
- val loss: hybrid diffusion loss on the 197 held-out digits x 4 fixed (t, noise) draws; EMA weights.
- digits acc: {args.per_class} samples per class, {args.sample_steps} DDPM steps, cfg 2.0, classified by an SVC
  trained on real digits. Pruned rows are fine-tuned with distillation from the teacher (alpha 1/1/1)
  unless marked "plain".
{("- " + args.note) if args.note else ""}

{table}
"""
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["# " + md.split("\n")[2][2:], md.split("\n")[3][2:], md.split("\n")[4][2:]])
        w.writerow([k for k, _, _ in COLUMNS] + ["finetune_s"])
        for r in rows:
            w.writerow(
                [r.get(k, "") if r.get(k) is not None else "" for k, _, _ in COLUMNS] + [r.get("finetune_s", "")]
            )
    print(md)


if __name__ == "__main__":
    main()
