"""Sampling throughput: DDPM-250 vs DDIM-50 with classifier-free guidance, on the same model;
with ``--quality``, quality per network evaluation of every sampler on the digits demo; with
``--diffusers``, what diffusers' DiTPipeline computes differently from dit-lightning.

Measures latent sampling (the DiT loop; VAE decoding excluded: it is identical for both
samplers and about one DiT step's worth of compute) with :func:`dit_lightning.sampling.sample_latents`
(generator-free, per-sample keyed noise), plus the reference-style loop (``p_sample_loop`` on
the doubled CFG batch with one ``torch.Generator``, as ``DiTModule.sample``) so the cost of
keyed noise shows. Weights are random (the cost does not depend on them). Markdown + CSV go
to docs/benchmarks/sampling_<device>.{md,csv}.

    python benchmarks/bench_sampling.py                                  # CPU: DiT-S/8, 8 samples
    python benchmarks/bench_sampling.py --device cuda --model DiT-XL/2 --batch-size 64 --num-samples 256 \
        --precision fp32,bf16 --name h200                               # -> sampling_h200.{md,csv}

Quality per step (``--quality``): the trained digits demo (``dit-lightning fit --config
configs/demo.yaml``) sampled by every sampler at 5, 10, 20, 50, 100 and 250 network evaluations,
500 digits (50 per class, the demo's ``test`` setting: CFG 2, x0 clamped), measured with the
demo test's own metrics (an SVC's accuracy, Fréchet distances to real digits in pixel and SVC
space); DDPM-250 also with two more seeds, for the spread a seed alone gives. Every row uses the
same keyed x_T per sample. Writes sampling_quality_digits.{md,csv,png}.

    python benchmarks/bench_sampling.py --quality --checkpoint outputs/demo/last.ckpt

diffusers (``--diffusers``): the demo exported with ``export --format diffusers``; the largest
output difference per timestep of diffusers' DiTTransformer2DModel as it builds it (timestep
frequencies with downscale_freq_shift=1) and with the reference's (0), on noised real digits;
and the digits metrics of DiTPipeline against dit-lightning with the same scheduler, steps and
x_T. Writes diffusers_digits.{md,csv}.

    python benchmarks/bench_sampling.py --diffusers --checkpoint outputs/demo/last.ckpt
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, Optional, cast

import numpy as np
import torch

from dit_lightning.atomic import write_text
from dit_lightning.diffusion import create_diffusion
from dit_lightning.models import DiTShape, build_dit, dit_macs
from dit_lightning.precision import SamplingPrecision
from dit_lightning.sampling import Sampler, guided_model_fn, sample_latents, step_noise

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {torch.get_num_threads()} torch threads"


def driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reference_loop(net, labels: torch.Tensor, steps: int, cfg: float, precision: str, seed: int) -> torch.Tensor:
    """What DiTModule.sample / the reference sample.py do: doubled batch through p_sample_loop."""
    device = labels.device
    n = len(labels)
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (n, net.in_channels, net.input_size, net.input_size)
    z = torch.randn(shape, generator=gen, device=device)
    z = torch.cat([z, z])
    y = torch.cat([labels, torch.full_like(labels, net.num_classes)])
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def fn(x, t, y):
        if dtype is None:
            return net.forward_with_cfg(x, t, y, cfg)
        with torch.autocast(device.type, dtype=dtype):
            return net.forward_with_cfg(x, t, y, cfg).float()

    diffusion = create_diffusion(str(steps))
    return diffusion.p_sample_loop(fn, z.shape, noise=z, model_kwargs={"y": y}, generator=gen)[:n]


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quality", action="store_true", help="quality per network evaluation on the digits demo")
    p.add_argument("--diffusers", action="store_true", help="DiTPipeline vs dit-lightning on the digits demo")
    p.add_argument("--checkpoint", default="outputs/demo/last.ckpt", help="the trained digits demo")
    p.add_argument("--samplers", default=",".join(QUALITY_SAMPLERS), help="--quality: comma-separated samplers")
    p.add_argument("--nfes", default="5,10,20,50,100,250", help="--quality: network evaluations per image")
    p.add_argument("--per-class", type=int, default=50, help="--quality/--diffusers: digits per class")
    p.add_argument("--resume", action="store_true", help="--quality: keep the rows already in the CSV")
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="DiT-S/8")
    p.add_argument("--latent-size", type=int, default=32, help="latent side (32 for 256px images)")
    p.add_argument("--num-samples", type=int, default=4, help="samples per configuration")
    p.add_argument("--batch-size", type=int, default=None, help="default 4; --quality: 250 (the demo test's)")
    p.add_argument("--cfg-scale", type=float, default=1.5)
    p.add_argument("--ddpm-steps", type=int, default=250)
    p.add_argument("--ddim-steps", type=int, default=50)
    p.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16, or several: fp32,bf16 (one row set each)")
    p.add_argument("--repeats", type=int, default=2, help="timed repeats per row, interleaved (the best is kept)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--no-reference-loop", action="store_true", help="skip the generator-based reference loop row")
    p.add_argument("--output-dir", default=os.path.join(REPO, "docs", "benchmarks"))
    p.add_argument("--name", default=None, help="file name: sampling_<name>.{md,csv} (default: the device type)")
    p.add_argument("--depth", type=int, help="override the named model's depth (tiny dry runs)")
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-heads", type=int)
    p.add_argument("--num-classes", type=int, default=1000)
    args = p.parse_args()
    precisions: list[SamplingPrecision] = [x.strip() for x in args.precision.split(",") if x.strip()]
    bad = [x for x in precisions if x not in ("fp32", "bf16", "fp16")]
    if bad or not precisions:
        p.error(f"--precision: unknown {bad}; use fp32, bf16 or fp16 (comma-separated for several)")

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quality:
        args.batch_size = args.batch_size or 250
        quality_per_step(args)
        return
    if args.diffusers:
        diffusers_comparison(args)
        return
    args.batch_size = args.batch_size or 4
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    sizes = dict(depth=args.depth, hidden_size=args.hidden_size, num_heads=args.num_heads)
    with torch.device(device):  # initialise on the device: DiT-XL/2's 675M parameters take long on a CPU
        net = build_dit(args.model, input_size=args.latent_size, num_classes=args.num_classes, **sizes)
    net = net.to(device).eval().requires_grad_(False)
    macs = dit_macs(DiTShape.of(net))
    n, b = args.num_samples, min(args.batch_size, args.num_samples)
    labels = torch.arange(n, device=device) % net.num_classes

    def ours(sampler: Sampler, steps: int, precision: SamplingPrecision) -> Callable[[], Any]:
        def run() -> None:
            for s in range(0, n, b):
                idx = torch.arange(s, min(n, s + b))
                sample_latents(
                    net,
                    labels[idx.to(device)],
                    idx,
                    sampler=sampler,
                    num_steps=steps,
                    cfg_scale=args.cfg_scale,
                    precision=precision,
                )

        return run

    def ref(steps: int, precision: SamplingPrecision) -> Callable[[], Any]:
        def run() -> None:
            for s in range(0, n, b):
                reference_loop(net, labels[s : s + b], steps, args.cfg_scale, precision, seed=s)

        return run

    configs = []
    for prec in precisions:
        configs += [
            (
                f"DDPM-{args.ddpm_steps}",
                "keyed (sample_latents)",
                args.ddpm_steps,
                prec,
                ours("ddpm", args.ddpm_steps, prec),
            ),
            (
                f"DDIM-{args.ddim_steps} (eta 0)",
                "keyed (sample_latents)",
                args.ddim_steps,
                prec,
                ours("ddim", args.ddim_steps, prec),
            ),
        ]
        if not args.no_reference_loop:
            configs.append(
                (
                    f"DDPM-{args.ddpm_steps}",
                    "torch.Generator (reference loop)",
                    args.ddpm_steps,
                    prec,
                    ref(args.ddpm_steps, prec),
                )
            )

    # Warm-up: one step of each path (allocator, kernels, lazy init).
    for prec in precisions:
        sample_latents(
            net,
            labels[:b],
            torch.arange(b),
            sampler="ddim",
            num_steps=2,
            cfg_scale=args.cfg_scale,
            precision=prec,
        )
        if not args.no_reference_loop:
            reference_loop(net, labels[:b], 2, args.cfg_scale, prec, seed=0)

    # Rows interleaved over the repeats (best kept), so a burst of load on a shared machine
    # does not land on one sampler only.
    load_before = os.getloadavg()
    best = [float("inf")] * len(configs)
    for _ in range(args.repeats):
        for k, (name, noise, _, prec, fn) in enumerate(configs):
            secs = timed(fn, device, 1)
            best[k] = min(best[k], secs)
            print(f"{name:20s} {prec:5s} {noise:34s} {n / secs:9.4f} images/s  ({secs:.1f}s)", file=sys.stderr)
    rows = []
    for (name, noise, steps, prec, _fn), secs in zip(configs, best):
        forwards = n * steps * (2 if args.cfg_scale != 1.0 else 1)  # CFG doubles the batch
        rows.append(
            {
                "sampler": name,
                "precision": prec,
                "noise": noise,
                "steps": steps,
                "cfg_scale": args.cfg_scale,
                "samples": n,
                "batch": b,
                "seconds": round(secs, 3),
                "images_per_s": round(n / secs, 4),
                "model_tflop_per_s": round(2 * macs * forwards / secs / 1e12, 4),
            }
        )
    # The overhead of keyed noise, measured apart from the (noisy, shared-machine) end-to-end rows.
    idx = torch.arange(b, device=device)
    shape = (net.in_channels, net.input_size, net.input_size)
    x, t, yb = torch.randn(b, *shape, device=device), torch.full((b,), 500, device=device), labels[:b]
    fn = guided_model_fn(net, args.cfg_scale, precision=precisions[0])
    with torch.no_grad():
        noise_ms = 1e3 * timed(lambda: [step_noise(idx, shape, 0, s) for s in range(10)], device, 3) / 10
        randn_ms = 1e3 * timed(lambda: [torch.randn(b, *shape, device=device) for _ in range(10)], device, 3) / 10
        step_ms = 1e3 * timed(lambda: fn(x, t, yb), device, 3)
    load = f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after (1 min)"
    base = {r["precision"]: r["images_per_s"] for r in reversed(rows) if r["sampler"].startswith("DDPM")}
    fp32_ddpm = base.get("fp32")
    for r in rows:
        r["speed_vs_ddpm"] = round(r["images_per_s"] / base[r["precision"]], 2)
        r["speed_vs_fp32_ddpm"] = round(r["images_per_s"] / fp32_ddpm, 2) if fp32_ddpm else None

    tag = "cuda" if device.type == "cuda" else "cpu"
    stem = os.path.join(args.output_dir, f"sampling_{args.name or tag}")
    os.makedirs(args.output_dir, exist_ok=True)
    cmd = "python benchmarks/bench_sampling.py " + " ".join(sys.argv[1:])
    header = [
        "sampler",
        "precision",
        "noise",
        "steps",
        "images/s",
        "vs DDPM",
        "vs fp32 DDPM",
        "seconds",
        "model TFLOP/s",
    ]
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        table.append(
            f"| {r['sampler']} | {r['precision']} | {r['noise']} | {r['steps']} | {r['images_per_s']:.4f} | "
            f"{r['speed_vs_ddpm']:.2f}x | "
            f"{'-' if r['speed_vs_fp32_ddpm'] is None else format(r['speed_vs_fp32_ddpm'], '.2f') + 'x'} | "
            f"{r['seconds']:.1f} | {r['model_tflop_per_s']:.3f} |"
        )
    md = "\n".join(
        [
            f"# Sampling throughput ({tag})",
            "",
            f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
            f"- command: `{cmd}`",
            f"- machine: {device_name(device)}; {os.cpu_count()} CPU cores; {platform.platform()}; {load}",
            f"- software: Python {platform.python_version()}, torch {torch.__version__}"
            + (f", CUDA {torch.version.cuda}, driver {driver_version()}" if device.type == "cuda" else ""),
            f"- model: {args.model} on {net.in_channels}x{args.latent_size}x{args.latent_size} latents "
            f"({sum(p.numel() for p in net.parameters()) / 1e6:.1f}M parameters, {macs / 1e9:.2f} GMACs per forward), "
            f"random weights, {', '.join(precisions)}"
            + (" (fp32 with TF32 matmuls)" if device.type == "cuda" and "fp32" in precisions else ""),
            f"- {n} samples per row, batch {b}, CFG scale {args.cfg_scale} (doubled batch), latents only (no VAE "
            f"decode); best of {args.repeats}",
            "",
            *table,
            "",
            f"Per step at batch {b}: keyed noise {noise_ms:.2f} ms (torch.randn {randn_ms:.2f} ms), "
            f"guided model call {step_ms:.1f} ms: keyed noise costs {100 * (noise_ms - randn_ms) / step_ms:.1f}% "
            "of a step, so end-to-end differences between the keyed and generator rows beyond that are machine noise.",
            "",
            "`keyed`: per-sample noise from (seed, index, step), independent of batch and ranks; "
            "`torch.Generator`: one stream per batch (DiTModule.sample, the reference scripts).",
            "",
        ]
    )
    write_text(stem + ".md", md)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    write_text(stem + ".csv", buf.getvalue())
    print(md)
    print(f"written to {stem}.md and {stem}.csv", file=sys.stderr)


# --------------------------------------------------------------------------------------
# Quality per network evaluation, on the digits demo
# --------------------------------------------------------------------------------------

QUALITY_SAMPLERS = [
    "ddpm", "ddim", "dpm++2m", "dpm++2m-karras", "dpm++2m-sde", "unipc", "deis", "euler", "euler-a",
    "diffusers-ddim", "diffusers-ddpm",
]  # fmt: skip
QUALITY_FIELDS = [
    "sampler", "nfe", "seed", "accuracy", "fd_svc", "fd_pixels", "s_per_image", "samples", "cfg_scale",
]  # fmt: skip


def _machine_lines(cmd: str, load_before: tuple[float, ...]) -> list[str]:
    return [
        f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- command: `{cmd}`",
        f"- machine: {cpu_model()}, {torch.get_num_threads()} torch threads; {os.cpu_count()} CPU cores "
        f"(a shared VM); {platform.platform()}; load average {load_before[0]:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after (1 min)",
        f"- software: Python {platform.python_version()}, torch {torch.__version__}, diffusers "
        f"{__import__('diffusers').__version__}",
    ]


def _digit_metrics(images: torch.Tensor, labels: torch.Tensor, clf: Any, real_acc: float) -> dict[str, Any]:
    """The demo test's metrics (GenerationMetrics): images in [0, 1] -> 8-bit -> SVC features."""
    from dit_lightning.evaluation.digits import digits_metrics, uint8_digit_features
    from dit_lightning.images import to_uint8

    u8 = torch.from_numpy(to_uint8(images)).permute(0, 3, 1, 2)
    return digits_metrics(uint8_digit_features(u8), labels.numpy(), clf, real_acc)


def _metric_columns(m: dict[str, Any]) -> dict[str, float]:
    """The three table columns of :func:`_digit_metrics`' result, rounded as the CSVs keep them."""
    return {
        "accuracy": round(m["accuracy"], 4),
        "fd_svc": round(m["frechet"]["fd_svc"], 4),
        "fd_pixels": round(m["frechet"]["fd_pixels"], 4),
    }


def _load_demo(path: str) -> Any:
    from dit_lightning.checkpoints import load_dit

    if not os.path.exists(path):
        raise SystemExit(
            f"{path} does not exist: train the demo first (dit-lightning fit --config configs/demo.yaml) "
            "or pass --checkpoint"
        )
    loaded = load_dit(path)
    if loaded.net.in_channels != 1 or loaded.net.num_classes != 10:
        raise SystemExit(f"{path} is not a digits demo model (1 channel, 10 classes)")
    return loaded


def quality_per_step(args: argparse.Namespace) -> None:
    from dit_lightning.evaluation.digits import train_digit_classifier

    loaded = _load_demo(args.checkpoint)
    net = loaded.net.requires_grad_(False)
    d = loaded.sampling_defaults
    cfg_scale = float(d.get("cfg_scale", 2.0))
    clf, real_acc = train_digit_classifier()
    labels = torch.arange(10).repeat_interleave(args.per_class)
    n = len(labels)
    samplers = [s.strip() for s in args.samplers.split(",") if s.strip()]
    nfes = [int(v) for v in args.nfes.split(",")]
    # Cheap rows first, then the reference (DDPM-250, three seeds: the spread a seed alone gives),
    # then the expensive rows: a run stopped early (and --resume'd) has the answers that matter.
    plan = [(s, k, 0) for k in nfes if k <= 50 for s in samplers]
    if "ddpm" in samplers and 250 in nfes:
        plan += [("ddpm", 250, seed) for seed in (0, 1, 2)]
    plan += [(s, k, 0) for k in nfes if k > 50 for s in samplers if (s, k, 0) not in plan]
    stem = os.path.join(args.output_dir, "sampling_quality_digits")
    os.makedirs(args.output_dir, exist_ok=True)
    rows: list[dict[str, Any]] = []
    if args.resume and os.path.exists(stem + ".csv"):
        with open(stem + ".csv") as f:
            rows = [dict(r) for r in csv.DictReader(f)]
    done = {(r["sampler"], int(r["nfe"]), int(r["seed"])) for r in rows}
    load_before = os.getloadavg()
    baseline: dict[str, Any] = {}
    for sampler, nfe, seed in plan:
        if (sampler, nfe, seed) in done:
            continue
        t0 = time.perf_counter()
        parts = []
        for start in range(0, n, args.batch_size):
            idx = torch.arange(start, min(n, start + args.batch_size))
            parts.append(
                sample_latents(
                    net,
                    labels[idx],
                    idx,
                    seed=seed,
                    sampler=cast(Sampler, sampler),
                    num_steps=nfe,
                    cfg_scale=cfg_scale,
                    objective=loaded.objective,
                    clip_denoised=True,
                )
            )
        secs = time.perf_counter() - t0
        m = _digit_metrics(((torch.cat(parts) + 1) / 2).clamp(0, 1), labels, clf, real_acc)
        baseline = m["frechet"]
        rows.append(
            {
                "sampler": sampler,
                "nfe": nfe,
                "seed": seed,
                **_metric_columns(m),
                "s_per_image": round(secs / n, 5),
                "samples": n,
                "cfg_scale": cfg_scale,
            }
        )
        print(f"{sampler:15s} {nfe:4d} seed {seed}: " + ", ".join(f"{k} {rows[-1][k]}" for k in QUALITY_FIELDS[3:7]),
              file=sys.stderr, flush=True)  # fmt: skip
        with open(stem + ".csv", "w", newline="") as f:  # after every row: a long run can --resume
            w = csv.DictWriter(f, fieldnames=QUALITY_FIELDS)
            w.writeheader()
            w.writerows(rows)
    if not baseline:
        from dit_lightning.evaluation.digits import digits_frechet

        baseline = digits_frechet(np.zeros((n, 64)), clf)
    cmd = "python benchmarks/bench_sampling.py " + " ".join(sys.argv[1:])
    md = _quality_markdown(rows, samplers, nfes, baseline, real_acc, cfg_scale, n, args, cmd, load_before)
    with open(stem + ".md", "w") as f:
        f.write(md)
    _quality_plot(rows, samplers, baseline, stem + ".png", f"digits demo, CFG {cfg_scale}, {n} samples per point")
    print(md)
    print(f"written to {stem}.md, .csv and .png", file=sys.stderr)


def _f(r: dict[str, Any], k: str) -> float:
    return float(r[k])


def _quality_markdown(
    rows: list[dict[str, Any]],
    samplers: list[str],
    nfes: list[int],
    baseline: dict[str, Any],
    real_acc: float,
    cfg_scale: float,
    n: int,
    args: argparse.Namespace,
    cmd: str,
    load_before: tuple[float, ...],
) -> str:
    by = {(r["sampler"], int(r["nfe"]), int(r["seed"])): r for r in rows}
    ref = [by[("ddpm", 250, s)] for s in range(3) if ("ddpm", 250, s) in by]
    lines = [
        "# Sampling quality per network evaluation (digits demo)",
        "",
        *_machine_lines(cmd, load_before),
        f"- model: `{args.checkpoint}` (EMA weights), {n} samples ({args.per_class} per digit), CFG scale {cfg_scale} "
        f"(one evaluation = one forward of the doubled batch), x0 clamped to [-1, 1], batch {args.batch_size}, fp32",
        "- metrics: the demo test's own (`GenerationMetrics`, `metrics: [digits]`): accuracy of an SVC trained on "
        f"real digits (held-out accuracy on real digits {real_acc:.3f}), Fréchet distances to real digits in the "
        f"SVC's decision space (real-vs-real floor {baseline['fd_svc_real_baseline']:.3f}) and in pixel space "
        f"(floor {baseline['fd_pixels_real_baseline']:.3f}); lower FD is better",
        "- every row starts from the same keyed x_T per sample (seed 0); wall time per image: sampling only, "
        f"{args.threads or torch.get_num_threads()} torch thread(s), as measured when the row ran (with --resume the "
        "rows may come from several runs, each under the machine's load then: on a shared machine these times are "
        "noisy); every network evaluation costs one forward of the doubled batch whatever the sampler, so the "
        "speed-up below counts evaluations",
        "",
    ]
    for metric, label in (("accuracy", "accuracy"), ("fd_svc", "FD (SVC)"), ("fd_pixels", "FD (pixels)")):
        lines += [f"### {label}", "", "| sampler | " + " | ".join(str(k) for k in nfes) + " |",
                  "|---|" + "---|" * len(nfes)]  # fmt: skip
        for s in samplers:
            cells = [f"{_f(by[(s, k, 0)], metric):.3f}" if (s, k, 0) in by else "" for k in nfes]
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["### wall time per image (ms)", "", "| sampler | " + " | ".join(str(k) for k in nfes) + " |",
              "|---|" + "---|" * len(nfes)]  # fmt: skip
    for s in samplers:
        cells = [f"{1e3 * _f(by[(s, k, 0)], 's_per_image'):.1f}" if (s, k, 0) in by else "" for k in nfes]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines.append("")
    if ref:
        worst = {
            "accuracy": min(_f(r, "accuracy") for r in ref),
            "fd_svc": max(_f(r, "fd_svc") for r in ref),
            "fd_pixels": max(_f(r, "fd_pixels") for r in ref),
        }
        spread = ", ".join(
            f"{k} {min(_f(r, k) for r in ref):.3f}..{max(_f(r, k) for r in ref):.3f}"
            for k in ("accuracy", "fd_svc", "fd_pixels")
        )
        lines += [
            "### The target: DDPM-250's quality at 25 evaluations or fewer",
            "",
            f"DDPM-250 over seeds 0, 1, 2: {spread}. A sampler reaches DDPM-250's Fréchet distances at N "
            "evaluations when both are at most DDPM-250's highest over the three seeds (what another seed alone "
            "can change); its accuracy too when that is at least DDPM-250's lowest. The table's points at or "
            "under 25 evaluations are 5, 10 and 20.",
            "",
            "| sampler | fewest evaluations (<= 25) with DDPM-250's FDs | ... and its accuracy "
            "| speed-up over DDPM-250 |",
            "|---|---|---|---|",
        ]

        def fewest(s: str, with_accuracy: bool) -> Optional[int]:
            ok = [
                k
                for k in nfes
                if k <= 25
                and (s, k, 0) in by
                and _f(by[(s, k, 0)], "fd_svc") <= worst["fd_svc"]
                and _f(by[(s, k, 0)], "fd_pixels") <= worst["fd_pixels"]
                and (not with_accuracy or _f(by[(s, k, 0)], "accuracy") >= worst["accuracy"])
            ]
            return min(ok) if ok else None

        for s in samplers:
            fd_only, both = fewest(s, False), fewest(s, True)
            best = both or fd_only
            lines.append(
                f"| {s} | {fd_only or 'not met'} | {both or 'not met'} | {f'{250 / best:.1f}x' if best else ''} |"
            )
        lines.append("")
    return "\n".join(lines)


def _quality_plot(
    rows: list[dict[str, Any]], samplers: list[str], baseline: dict[str, Any], path: str, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    ref = [r for r in rows if r["sampler"] == "ddpm" and int(r["nfe"]) == 250]
    styles = ["-o", "-s", "-^", "-v", "-D", "-P", "-X", "--o", "--s", "--^", "--v", "--D"]
    for k, (metric, label, floor) in enumerate(
        [
            ("accuracy", "classifier accuracy (higher is better)", None),
            ("fd_svc", "Fréchet distance, SVC space", baseline.get("fd_svc_real_baseline")),
            ("fd_pixels", "Fréchet distance, pixels", baseline.get("fd_pixels_real_baseline")),
        ]
    ):
        ax = axes[k]
        for j, s in enumerate(samplers):
            pts = sorted((int(r["nfe"]), _f(r, metric)) for r in rows if r["sampler"] == s and int(r["seed"]) == 0)
            if pts:
                ax.plot(*zip(*pts), styles[j % len(styles)], label=s, ms=4, lw=1.2)
        if ref:
            vals = [_f(r, metric) for r in ref]
            ax.axhspan(min(vals), max(vals), color="gray", alpha=0.25, label="DDPM-250, 3 seeds")
        if floor is not None:
            ax.axhline(floor, color="black", ls=":", lw=1, label="real vs real")
        ax.axvline(25, color="red", ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.set_xticks([5, 10, 20, 50, 100, 250], ["5", "10", "20", "50", "100", "250"])
        ax.set_xlabel("network evaluations per image")
        ax.set_title(label, fontsize=10)
        if metric != "accuracy":
            ax.set_yscale("log")
    axes[0].legend(fontsize=7, ncol=2, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# diffusers' DiTPipeline against dit-lightning, on the digits demo
# --------------------------------------------------------------------------------------

DEVIATION_TIMESTEPS = [0, 1, 10, 50, 100, 250, 500, 750, 999]


def diffusers_comparison(args: argparse.Namespace) -> None:
    import tempfile

    from diffusers import DiTPipeline, DiTTransformer2DModel
    from diffusers.utils import logging as diffusers_logging
    from sklearn.datasets import load_digits

    from dit_lightning.checkpoints import PixelDecoder, export_checkpoint, use_reference_timestep_embedding
    from dit_lightning.diffusion import DDPMObjective
    from dit_lightning.evaluation.digits import train_digit_classifier
    from dit_lightning.sampling import build_scheduler

    diffusers_logging.set_verbosity_error()
    loaded = _load_demo(args.checkpoint)
    net = loaded.net.requires_grad_(False)
    load_before = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="dit-diffusers-")
    export = export_checkpoint(args.checkpoint, os.path.join(tmp, "demo"), format="diffusers")["output"]
    as_built = DiTTransformer2DModel.from_pretrained(os.path.join(export, "transformer")).eval()
    exact = use_reference_timestep_embedding(DiTTransformer2DModel.from_pretrained(os.path.join(export, "transformer")))
    exact.eval()

    # 1. outputs on noised real digits, per timestep
    digits = load_digits()
    x0 = torch.from_numpy(digits.data[:500] / 16.0 * 2 - 1).float().reshape(-1, 1, 8, 8)
    y = torch.from_numpy(digits.target[:500]).long()
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    ddpm = loaded.objective or DDPMObjective()
    if not isinstance(ddpm, DDPMObjective):
        raise SystemExit(f"{args.checkpoint}: the diffusers comparison needs a DDPM model, not {ddpm.describe()}")
    acp = torch.from_numpy(ddpm.diffusion.alphas_cumprod).float()
    dev_rows = []
    with torch.no_grad():
        for t in DEVIATION_TIMESTEPS:
            tt = torch.full((len(y),), t)
            xt = acp[t].sqrt() * x0 + (1 - acp[t]).sqrt() * eps
            ours = net(xt, tt, y)
            a = as_built(xt, timestep=tt, class_labels=y).sample
            b = exact(xt, timestep=tt, class_labels=y).sample
            dev_rows.append(
                {
                    "t": t,
                    "as_built_max": (ours - a).abs().max().item(),
                    "as_built_eps_max": (ours - a)[:, :1].abs().max().item(),
                    "as_built_eps_rms": (ours - a)[:, :1].pow(2).mean().sqrt().item(),
                    "exact_max": (ours - b).abs().max().item(),
                    "eps_rms": ours[:, :1].pow(2).mean().sqrt().item(),
                }
            )
            print(dev_rows[-1], file=sys.stderr)

    # 2. sampling: DiTPipeline vs dit-lightning, same scheduler, steps and x_T (no guidance: the
    # pipeline's null class is hard-coded to 1000)
    clf, real_acc = train_digit_classifier()
    labels = torch.arange(10).repeat_interleave(args.per_class)
    n = len(labels)
    x_t = torch.randn((n, 1, 8, 8), generator=torch.Generator().manual_seed(0))  # what DiTPipeline draws
    sample_rows = []

    def add(name: str, sampler: str, steps: int, images: torch.Tensor, secs: float, ref: Any = None) -> torch.Tensor:
        m = _digit_metrics(images, labels, clf, real_acc)
        sample_rows.append(
            {
                "sampling": name,
                "scheduler": sampler,
                "steps": steps,
                **_metric_columns(m),
                "max_pixel_diff_vs_dit_lightning": "" if ref is None else f"{(images - ref).abs().max().item():.2g}",
                "s_per_image": round(secs / n, 5),
            }
        )
        print(sample_rows[-1], file=sys.stderr)
        return images

    runs: list[tuple[Sampler, int]] = [("dpm++2m", 10), ("dpm++2m", 25), ("unipc", 10), ("euler", 25)]
    for sampler, steps in runs:
        clip = sampler != "euler"
        t0 = time.perf_counter()
        keyed = sample_latents(net, labels, torch.arange(n), sampler=sampler, num_steps=steps, clip_denoised=clip)
        add("dit-lightning, keyed x_T", sampler, steps, ((keyed + 1) / 2).clamp(0, 1), time.perf_counter() - t0)
        t0 = time.perf_counter()
        same = sample_latents(net, labels, sampler=sampler, num_steps=steps, noise=x_t, clip_denoised=clip)
        ref = add("dit-lightning, DiTPipeline's x_T", sampler, steps, ((same + 1) / 2).clamp(0, 1),
                  time.perf_counter() - t0)  # fmt: skip
        for name, fixed in (("DiTPipeline, as diffusers builds it", False), ("DiTPipeline, reference timesteps", True)):
            pipe = DiTPipeline.from_pretrained(export, vae=PixelDecoder())
            pipe.scheduler = build_scheduler(sampler, ddpm.noise_schedule, ddpm.diffusion_steps, thresholding=clip)
            if fixed:
                use_reference_timestep_embedding(pipe)
            pipe.set_progress_bar_config(disable=True)
            t0 = time.perf_counter()
            images = pipe(
                class_labels=labels.tolist(), guidance_scale=1.0, num_inference_steps=steps,
                generator=torch.Generator().manual_seed(0), output_type="pt",
            ).images  # fmt: skip
            add(name, sampler, steps, images, time.perf_counter() - t0, ref)

    stem = os.path.join(args.output_dir, "diffusers_digits")
    os.makedirs(args.output_dir, exist_ok=True)
    with open(stem + "_deviation.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dev_rows[0]))
        w.writeheader()
        w.writerows(dev_rows)
    with open(stem + "_sampling.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(sample_rows[0]))
        w.writeheader()
        w.writerows(sample_rows)
    cmd = "python benchmarks/bench_sampling.py " + " ".join(sys.argv[1:])
    lines = [
        "# diffusers' DiTPipeline and dit-lightning on the digits demo",
        "",
        *_machine_lines(cmd, load_before),
        f"- model: `{args.checkpoint}` (EMA weights), exported with `dit-lightning export --format diffusers`",
        "",
        "## Network outputs per timestep",
        "",
        "500 real digits noised to x_t (fixed noise) with their labels; max |difference| over every output "
        "(epsilon and variance channels) between dit-lightning's DiT and the exported `DiTTransformer2DModel`, "
        "as diffusers builds it (timestep frequencies with `downscale_freq_shift=1`) and with "
        "`use_reference_timestep_embedding` (0, the reference DiT's). Epsilon RMS for scale.",
        "",
        "| t | as built: max | as built: epsilon max | as built: epsilon RMS | epsilon RMS "
        "| reference timesteps: max |",
        "|---|---|---|---|---|---|",
        *[
            f"| {r['t']} | {r['as_built_max']:.2e} | {r['as_built_eps_max']:.2e} | {r['as_built_eps_rms']:.2e} | "
            f"{r['eps_rms']:.3f} | {r['exact_max']:.1e} |"
            for r in dev_rows
        ],
        "",
        "## Sampling",
        "",
        f"{n} digits ({args.per_class} per class), no guidance (DiTPipeline's null class is hard-coded to 1000, "
        "this model has 10 classes), x0 clamped to [-1, 1] (the scheduler's `thresholding` in the pipeline, "
        "epsilon through the clamped x0 in dit-lightning; Euler has no thresholding: unclamped on both sides). "
        "DiTPipeline draws x_T with `torch.Generator().manual_seed(0)`; dit-lightning is run from that x_T too, and "
        "from its own keyed x_T. Metrics as in sampling_quality_digits.md.",
        "",
        "| sampling | scheduler | steps | accuracy | FD (SVC) | FD (pixels) | max pixel diff vs dit-lightning "
        "(same x_T) | s / image |",
        "|---|---|---|---|---|---|---|---|",
        *[
            f"| {r['sampling']} | {r['scheduler']} | {r['steps']} | {r['accuracy']:.3f} | {r['fd_svc']:.3f} | "
            f"{r['fd_pixels']:.3f} | {r['max_pixel_diff_vs_dit_lightning']} | {r['s_per_image']:.4f} |"
            for r in sample_rows
        ],
        "",
    ]
    md = "\n".join(lines)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)
    print(f"written to {stem}.md, {stem}_deviation.csv and {stem}_sampling.csv", file=sys.stderr)


if __name__ == "__main__":
    main()
