"""Sampling throughput: DDPM-250 vs DDIM-50 with classifier-free guidance, on the same model.

Measures latent sampling (the DiT loop; VAE decoding excluded: it is identical for both
samplers and about one DiT step's worth of compute) with :func:`dit_lightning.sampling.sample_latents`
(generator-free, per-sample keyed noise), plus the reference-style loop (``p_sample_loop`` on
the doubled CFG batch with one ``torch.Generator``, as ``DiTModule.sample``) so the cost of
keyed noise shows. Weights are random (the cost does not depend on them). Markdown + CSV go
to docs/benchmarks/sampling_<device>.{md,csv}.

    python benchmarks/bench_sampling.py                                  # CPU: DiT-S/8, 8 samples
    python benchmarks/bench_sampling.py --device cuda --model DiT-XL/2 --batch-size 64 --num-samples 256 \
        --precision fp32,bf16 --name h200                               # -> sampling_h200.{md,csv}
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
from typing import Any

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
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="DiT-S/8")
    p.add_argument("--latent-size", type=int, default=32, help="latent side (32 for 256px images)")
    p.add_argument("--num-samples", type=int, default=4, help="samples per configuration")
    p.add_argument("--batch-size", type=int, default=4)
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


if __name__ == "__main__":
    main()
