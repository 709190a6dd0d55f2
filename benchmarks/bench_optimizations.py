"""Memory and speed of the training optimisations, measured against an fp32 baseline in one run.

The grid: fp32 baseline, TF32 (CUDA), 16-mixed, bf16-mixed, activation checkpointing (half /
all blocks), torch.compile (per block), fused AdamW (CUDA), flash versus math SDPA attention,
online VAE encoding of images versus pre-extracted latents, and a reference-style step (plain softmax attention, fp32,
``benchmarks/reference_step.py``) at the same model and batch. Each configuration is built
from scratch (in this process after releasing the previous one, or with ``--isolate
subprocess`` in a fresh process), warmed up, then timed over a few steps; its peak memory is
``torch.cuda.max_memory_allocated`` on GPU and, on CPU, the allocator-level peak that the
planner is validated with (``dit_lightning.planner.measure``: weights, EMA, optimiser
states and batch, plus the profiler-reported peak of one step). The planner's prediction is
printed next to each measured peak, and MFU (useful training FLOPs per second over the
device's dense peak for the row's compute dtype, ``dit_lightning.planner.hardware``) on GPUs
the table knows. The report is rewritten after every row, so a run cut short keeps its rows.

  python benchmarks/bench_optimizations.py                       # CPU, small model
  python benchmarks/bench_optimizations.py --device cuda --model DiT-XL/2 --batch 64

Writes ``optimizations_<device>_<name>.{md,csv,png}`` into ``--out`` (docs/benchmarks).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import gc
import io
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Protocol

import torch

if TYPE_CHECKING:
    from dit_lightning.models.dit import AttentionBackend
    from dit_lightning.precision import TrainingPrecision

sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 1024**2


@dataclass(frozen=True)
class Config:
    precision: TrainingPrecision = "32-true"
    checkpointing: Literal["none", "half", "all"] = "none"
    compile: bool = False
    fused: bool = False
    online_vae: bool = False
    tf32: bool = False
    reference: bool = False
    attention: AttentionBackend = "auto"  # SDPA kernel forced for the step (DiTModule.attention_backend)
    lightning: bool = False  # LightningDiT's block (RMSNorm, SwiGLU, rope) at the same width and depth
    cuda_only: bool = False
    note: str = ""


CONFIGS: dict[str, Config] = {
    "fp32": Config(note="baseline: eager, foreach AdamW, pre-extracted latents"),
    "tf32": Config(tf32=True, cuda_only=True, note="fp32 weights, TF32 matmuls (the module's default on GPU)"),
    "16-mixed": Config(precision="16-mixed", note="fp16 autocast (+GradScaler on GPU)"),
    "bf16-mixed": Config(precision="bf16-mixed"),
    "fp32+ckpt-half": Config(checkpointing="half"),
    "fp32+ckpt-all": Config(checkpointing="all"),
    "16-mixed+ckpt-all": Config(precision="16-mixed", checkpointing="all"),
    "bf16+ckpt-half": Config(precision="bf16-mixed", checkpointing="half"),
    "bf16+ckpt-all": Config(precision="bf16-mixed", checkpointing="all"),
    "bf16+flash": Config(precision="bf16-mixed", attention="flash", note="SDPA forced to flash attention"),
    "bf16+math": Config(precision="bf16-mixed", attention="math", note="SDPA forced to the math kernel (T x T scores)"),
    "fp32+math": Config(attention="math", note="SDPA forced to the math kernel (T x T scores)"),
    "fp32+lightning-block": Config(lightning=True, note="LightningDiT's block: RMSNorm, SwiGLU, rope"),
    "bf16+lightning-block": Config(
        precision="bf16-mixed", lightning=True, note="LightningDiT's block: RMSNorm, SwiGLU, rope"
    ),
    "fp32+compile": Config(compile=True, note="torch.compile of each block"),
    "bf16+compile": Config(precision="bf16-mixed", compile=True, note="torch.compile of each block"),
    "fp32+fused-adamw": Config(fused=True, cuda_only=True),
    "bf16+fused-adamw": Config(precision="bf16-mixed", fused=True, cuda_only=True),
    "fp32+online-vae": Config(online_vae=True, note="AutoencoderKL encode of images every step"),
    "bf16+online-vae": Config(
        precision="bf16-mixed", online_vae=True, note="AutoencoderKL encode of images every step"
    ),
    "reference": Config(reference=True, note="reference-style step: plain softmax attention, fp32, looped EMA"),
    "fp32-repeat": Config(note="the baseline again, last: the run-to-run noise of this machine"),
}
DEFAULT_GRID = {
    "cpu": [
        "fp32",
        "16-mixed",
        "bf16-mixed",
        "fp32+ckpt-half",
        "fp32+ckpt-all",
        "bf16+ckpt-half",
        "bf16+ckpt-all",
        "fp32+compile",
        "bf16+fused-adamw",
        "fp32+online-vae",
        "reference",
        "fp32+lightning-block",
        "bf16+lightning-block",
        "fp32-repeat",
    ],
    "cuda": [
        "fp32",
        "tf32",
        "16-mixed",
        "bf16-mixed",
        "bf16+ckpt-half",
        "bf16+ckpt-all",
        "16-mixed+ckpt-all",
        "bf16+compile",
        "bf16+lightning-block",
        "bf16+fused-adamw",
        "bf16+flash",
        "bf16+math",
        "bf16+online-vae",
        "reference",
    ],
}
# fp16 matmuls have no CPU kernel worth the name (~1 GFLOP/s): only when asked for by name.
CPU_SKIP_BY_DEFAULT = {
    "16-mixed": "skipped on CPU: fp16 matmuls are emulated (~1 GFLOP/s); ask with --configs 16-mixed"
}


# --------------------------------------------------------------------------------------
# One configuration
# --------------------------------------------------------------------------------------


def _shape_kwargs(args) -> dict[str, Any]:
    from dit_lightning.models import shape_of

    sizes = dict(depth=args.depth, hidden_size=args.hidden_size, num_heads=args.num_heads, patch_size=args.patch_size)
    shape = shape_of(args.model, input_size=args.latent_size, num_classes=args.num_classes, **sizes)
    return asdict(shape)


def _vae(device: torch.device, small: bool):
    """A randomly initialised AutoencoderKL: sd-vae-ft-ema's architecture on GPU, a narrow one on CPU."""
    from diffusers.models import AutoencoderKL

    channels, layers = ((32, 64, 128, 128), 1) if small else ((128, 256, 512, 512), 2)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=channels,
        layers_per_block=layers,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=256,
    )
    return vae.to(device).eval().requires_grad_(False)


def _planner_bytes(cfg: Config, shape: dict, args, device: str) -> Optional[int]:
    from dit_lightning.planner import plan_memory

    p = plan_memory(
        "custom",
        latent_size=args.latent_size,
        micro_batch=args.batch,
        precision=cfg.precision,
        activation_checkpointing=cfg.checkpointing,
        optimizer="adamw",
        fused_optimizer=cfg.fused,
        ema=True,
        attention="math" if cfg.reference or cfg.attention == "math" else "auto",
        device="cuda" if device == "cuda" else "cpu",
        **_block(cfg),
        depth=shape["depth"],
        hidden_size=shape["hidden_size"],
        num_heads=shape["num_heads"],
        patch_size=shape["patch_size"],
        in_channels=shape["in_channels"],
        num_classes=shape["num_classes"],
    )
    return p.peak_allocated


def _block(cfg: Config) -> dict[str, Any]:
    """The block options of a row: LightningDiT's (dit_lightning.models.dit.LIGHTNING_BLOCK) or DiT's (none)."""
    from dit_lightning.models.dit import LIGHTNING_BLOCK

    return dict(LIGHTNING_BLOCK) if cfg.lightning else {}


class Step(Protocol):
    """One training step to time: the project's ``TrainingStep`` or the reference's."""

    batch: dict[str, torch.Tensor]

    def __call__(self) -> float: ...

    def state_bytes(self) -> int: ...


class OnlineVAEStep:
    """``inner`` preceded by the VAE encoding of the batch's images into its latents (online VAE)."""

    def __init__(self, inner: Step, vae: Any, images: torch.Tensor, device: torch.device) -> None:
        self.inner, self.vae, self.images, self.device = inner, vae, images, device
        self.batch = inner.batch

    def __call__(self) -> float:
        inner = self.inner
        with (
            torch.no_grad(),
            inner.autocast() if hasattr(inner, "autocast") else torch.autocast(self.device.type, enabled=False),
        ):
            latents = self.vae.encode(self.images).latent_dist.sample() * 0.18215
        inner.batch["x"] = latents.float()
        return inner()

    def state_bytes(self) -> int:
        return self.inner.state_bytes()


def run_config(name: str, args) -> dict[str, Any]:
    """Build, warm up, time and measure one configuration; return its row."""
    cfg = CONFIGS[name]
    device = torch.device(args.device)
    row: dict[str, Any] = {"config": name, "status": "ok", "note": cfg.note}
    if cfg.cuda_only and device.type != "cuda":
        row.update(
            status="n/a on CPU", note=(cfg.note + "; " if cfg.note else "") + "the project enables it on CUDA only"
        )
        return row
    if device.type == "cpu" and name in CPU_SKIP_BY_DEFAULT and name not in (args.configs_explicit or []):
        row.update(status=CPU_SKIP_BY_DEFAULT[name])
        return row
    from dit_lightning.module import DiTModule
    from dit_lightning.planner.measure import TrainingStep, cpu_allocator_peak, tensor_bytes

    torch.manual_seed(0)
    shape = _shape_kwargs(args)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base_allocated = torch.cuda.memory_allocated()
    n, lat = args.batch, args.latent_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    batch = {
        "x": torch.randn(n, shape["in_channels"], lat, lat, generator=gen).to(device),
        "y": torch.randint(0, shape["num_classes"], (n,), generator=gen).to(device),
        "index": torch.arange(n, device=device),
    }
    extra_state: list[torch.Tensor] = []
    step: Step
    if cfg.reference:
        from reference_step import ReferenceTrainingStep, build_reference

        step = ReferenceTrainingStep(build_reference(shape, device), batch)
    else:
        with torch.device(device):  # initialise on the device: a 675M-parameter init on CPU takes long
            module = DiTModule(
                model="custom",
                latent_shape=(shape["in_channels"], lat, lat),
                num_classes=shape["num_classes"],
                depth=shape["depth"],
                hidden_size=shape["hidden_size"],
                num_heads=shape["num_heads"],
                patch_size=shape["patch_size"],
                activation_checkpointing=None if cfg.checkpointing == "none" else cfg.checkpointing,
                compile="blocks" if cfg.compile else "none",
                tf32=cfg.tf32,
                fused_optimizer=cfg.fused,
                attention_backend=cfg.attention,
                **_block(cfg),
            )
        module.to(device)
        module.configure_model()
        if device.type == "cuda":  # configure_model turns TF32 on when asked; keep it as configured
            torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        step = TrainingStep(module, batch, cfg.precision)
    if cfg.online_vae:
        vae = _vae(device, small=device.type == "cpu")
        images = torch.rand(n, 3, 8 * lat, 8 * lat, generator=gen).to(device) * 2 - 1
        extra_state += list(vae.parameters()) + [images]
        step = OnlineVAEStep(step, vae, images, device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    warmup = max(args.warmup, 2 if cfg.compile else 0)
    t0 = time.perf_counter()
    for _ in range(warmup):
        loss = step()
    sync()
    row["warmup_s"] = round(time.perf_counter() - t0, 2)
    steps, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while steps < args.steps and (steps == 0 or time.perf_counter() - start < args.max_seconds):
        loss = step()
        steps += 1
    sync()
    elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
    # On a shared CPU, wall time depends on the neighbours; the CPU time of this process (one
    # compute thread by default) does not, so CPU speed is images per CPU-second.
    timed = elapsed if device.type == "cuda" else cpu_elapsed
    row.update(
        steps=steps,
        step_s=timed / steps,
        images_per_s=n * steps / timed,
        wall_images_per_s=n * steps / elapsed,
        loss=loss,
    )
    if device.type == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated() - base_allocated
        row["reserved_bytes"] = torch.cuda.max_memory_reserved()
    else:
        _, dynamic = cpu_allocator_peak(step)
        row["peak_bytes"] = step.state_bytes() + tensor_bytes(extra_state) + dynamic
    if cfg.online_vae:
        # the VAE encoder's no-grad activations are not part of the planner's model
        row["note"] += "; planner: not modelled (VAE encoder activations)"
    else:
        row["planner_bytes"] = _planner_bytes(cfg, shape, args, device.type)
    if cfg.compile:
        row["note"] = (cfg.note + "; " if cfg.note else "") + "planner: eager prediction"
    if cfg.reference:
        row["note"] += "; planner: math attention"
    row.update(_utilisation(cfg, shape, args, device, row["images_per_s"]))
    return row


def _utilisation(cfg: Config, shape: dict, args, device: torch.device, images_per_s: float) -> dict[str, Any]:
    """MFU / HFU of a row: useful (executed) training FLOPs per second over the dense peak of the
    device for the row's compute dtype (TF32 for fp32 rows with TF32 on); empty where no peak is known."""
    from dit_lightning.models import resolve_checkpoint_blocks, shape_of, training_flops
    from dit_lightning.planner.hardware import peak_flops_for
    from dit_lightning.precision import to_dtype

    if device.type != "cuda":
        return {}
    peak = peak_flops_for(torch.cuda.get_device_name(device), to_dtype(cfg.precision), tf32=cfg.tf32)
    if not peak:
        return {}
    s = shape_of("custom", **{**shape, **_block(cfg)})
    recomputed = resolve_checkpoint_blocks(None if cfg.checkpointing == "none" else cfg.checkpointing, s.depth)
    useful, executed = training_flops(s, recomputed_blocks=len(recomputed))
    return {
        "peak_tflops": peak / 1e12,
        "mfu": images_per_s * useful / peak,
        "hfu": images_per_s * executed / peak,
    }


# --------------------------------------------------------------------------------------
# The grid, the report
# --------------------------------------------------------------------------------------


def _machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} logical cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _pct(r: Optional[float]) -> str:
    return "-" if r is None else f"{(r - 1) * 100:+.0f}%"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["config"] == "fp32" and r["status"] == "ok"), None)
    reserved = any("reserved_bytes" in r for r in rows)
    head = (
        "| config | images/s | speed vs fp32 | peak memory (MiB) | memory vs fp32 | planner (MiB) "
        "| planner / measured |"
    )
    head += (" reserved (MiB) |" if reserved else "") + " MFU | steps | notes |\n"
    head += "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if reserved else "") + "---:|---:|---|\n"
    lines = []
    for r in rows:
        if r["status"] != "ok":
            lines.append(
                f"| {r['config']} | - | - | - | - | - | - |"
                + (" - |" if reserved else "")
                + f" - | - | {r['status']}{'; ' + r['note'] if r.get('note') else ''} |"
            )
            continue
        speed = _ratio(r["images_per_s"], base["images_per_s"]) if base else None
        mem = _ratio(r["peak_bytes"], base["peak_bytes"]) if base else None
        pred = r.get("planner_bytes")
        lines.append(
            f"| {r['config']} | {r['images_per_s']:.2f} | {_fmt(speed, '.2f') + ('x' if speed else '')} | "
            f"{r['peak_bytes'] / MiB:,.1f} | {_pct(mem)} | "
            f"{_fmt(pred / MiB if pred else None, ',.1f')} | {_fmt(_ratio(pred, r['peak_bytes']), '.3f')} |"
            + (f" {r['reserved_bytes'] / MiB:,.0f} |" if reserved else "")
            + f" {_mfu(r)} | {r['steps']} | {r.get('note', '')} |"
        )
    return head + "\n".join(lines) + "\n"


def _mfu(row: dict[str, Any]) -> str:
    return "-" if row.get("mfu") is None else f"{row['mfu']:.1%}"


def _get(rows, name):
    return next((r for r in rows if r["config"] == name and r["status"] == "ok"), None)


def claims_section(rows: list[dict[str, Any]], device: str) -> str:
    """The seed's claims next to this run's numbers, and what this device can say about them."""

    def cmp(a: str, b: str) -> Optional[tuple[float, float]]:
        ra, rb = _get(rows, a), _get(rows, b)
        if not ra or not rb:
            return None
        return ra["peak_bytes"] / rb["peak_bytes"] - 1, ra["images_per_s"] / rb["images_per_s"] - 1

    def line(label: str, a: str, b: str, claim_mem: str, claim_speed: str) -> str:
        c = cmp(a, b)
        if c is None:
            return f"| {label} | `{a}` vs `{b}` | {claim_mem} | - | {claim_speed} | - |"
        return f"| {label} | `{a}` vs `{b}` | {claim_mem} | {c[0] * 100:+.0f}% | {claim_speed} | {c[1] * 100:+.0f}% |"

    mixed = "bf16-mixed"
    out = [
        "## The seed's claims against this run",
        "",
        "| claim | measured as | claimed memory | measured memory | claimed speed | measured speed |",
        "|---|---|---:|---:|---:|---:|",
        line("mixed precision", mixed, "fp32", "-35..45%", "+15..25%"),
        line("mixed precision (fp16 + GradScaler)", "16-mixed", "fp32", "-35..45%", "+15..25%"),
        line("mixed precision against TF32", mixed, "tf32", "-", "-"),
        line("+ activation checkpointing (all blocks)", "bf16+ckpt-all", mixed, "a further -50..60%", "-20..30%"),
        line("+ activation checkpointing (half)", "bf16+ckpt-half", mixed, "-", "-"),
        line("both together", "bf16+ckpt-all", "fp32", "-70..80%", "-"),
        line("checkpointing in fp32", "fp32+ckpt-all", "fp32", "-", "-"),
        line("pre-extracted latents (vs online VAE)", "fp32", "fp32+online-vae", "-", "-")
        if _get(rows, "fp32+online-vae")
        else line("pre-extracted latents (vs online VAE)", "bf16-mixed", "bf16+online-vae", "-", "-"),
        "",
    ]
    ref, base = _get(rows, "reference"), _get(rows, "fp32")
    if ref and base:
        out.append(
            f"Side by side at equal settings (fp32, same model and batch, same loss): this project's step runs "
            f"**{base['images_per_s'] / ref['images_per_s']:.2f}x** the speed of the reference-style step "
            "(plain softmax attention, per-parameter EMA loop) and needs "
            f"**{base['peak_bytes'] / ref['peak_bytes']:.2f}x** its memory"
            + (
                " (run-to-run noise of the baseline here: "
                f"{(_get(rows, 'fp32-repeat')['images_per_s'] / base['images_per_s'] - 1) * 100:+.0f}%)."
                if _get(rows, "fp32-repeat")
                else "."
            )
        )
        out.append("")
    if device == "cpu":
        out += [planner_projection(), ""]
        out += _cpu_verdict(rows)
        out += [
            "What these CPU numbers can and cannot say:",
            "",
            "- **Memory claims: yes, largely.** The peaks are allocator-level byte counts of the same tensors a GPU "
            "step allocates (the planner, validated against them, predicts the GPU figures from the same model). "
            "Two caveats: the model is small, so the fixed weights/optimiser/EMA state is a larger share of the peak "
            "than for DiT-XL/2 at batch 32+ (ratios are diluted; see the planner for XL/2), and on GPU the CUDA "
            "context and allocator fragmentation add to what the device must hold.",
            "- **Speed claims: no.** CPU speed says nothing about tensor-core speed-ups. On this CPU bf16 matmuls "
            "run natively (AVX512-BF16) and fp16 matmuls are emulated (~1 GFLOP/s), so the 16-mixed row is not "
            "measured by default; neither reflects a GPU. The relative cost of recomputation (checkpointing) is "
            "roughly transferable (it is extra FLOPs), the rest needs the GPU run "
            "(`--device cuda --model DiT-XL/2 --batch 64`).",
            "- **torch.compile and fused AdamW**: compile on CPU goes through Inductor's C++ backend, not Triton; "
            "fused AdamW is enabled by the project on CUDA only (n/a here).",
            "",
        ]
    else:
        out += [
            "Peak memory is `torch.cuda.max_memory_allocated` (`reserved` in the CSV); the planner column predicts it. "
            "Speed ratios are from the same run, same GPU.",
            "",
        ]
    return "\n".join(out)


def _cpu_verdict(rows: list[dict[str, Any]]) -> list[str]:
    """Plain statements on each claim, from this run and the planner's DiT-XL/2 projection."""
    from dit_lightning.planner import plan_memory

    def rel(a: str, b: str, key: str) -> Optional[float]:
        ra, rb = _get(rows, a), _get(rows, b)
        return None if not ra or not rb else ra[key] / rb[key] - 1

    def proj(prec_a, ck_a, prec_b, ck_b):
        vals = []
        for b in (32, 64, 128):
            kw: dict[str, Any] = dict(micro_batch=b, fused_optimizer=False, device="cuda")
            a = plan_memory("DiT-XL/2", precision=prec_a, activation_checkpointing=ck_a, **kw).peak_allocated
            c = plan_memory("DiT-XL/2", precision=prec_b, activation_checkpointing=ck_b, **kw).peak_allocated
            vals.append(f"{(a / c - 1) * 100:+.0f}%")
        return "/".join(vals)

    def pct(x: Optional[float]) -> str:
        return "n/a" if x is None else f"{x * 100:+.0f}%"

    mixed_mem = rel("bf16-mixed", "fp32", "peak_bytes")
    ckpt_mem = rel("bf16+ckpt-all", "bf16-mixed", "peak_bytes")
    both_mem = rel("bf16+ckpt-all", "fp32", "peak_bytes")
    ckpt_speed = rel("fp32+ckpt-all", "fp32", "images_per_s")
    ckpt_speed16 = rel("bf16+ckpt-all", "bf16-mixed", "images_per_s")
    noise = rel("fp32-repeat", "fp32", "images_per_s")
    return [
        "Verdict on each claim:",
        "",
        f"- **Mixed precision, memory (-35..45%)**: {pct(mixed_mem)} here; the planner gives "
        f"{proj('bf16-mixed', 'none', '32-true', 'none')} "
        "for DiT-XL/2 at batch 32/64/128. The claim holds only for large micro-batches: under autocast the "
        "residual stream "
        "and the LayerNorm inputs/outputs stay fp32 (48 instead of 80 bytes per token and channel, -40% on "
        "activations, "
        "not -50%), autocast adds a 16-bit copy of the weights, and the fp32 weights/gradients/AdamW/EMA do not "
        "shrink.",
        "- **Mixed precision, speed (+15..25%)**: not answerable on CPU "
        f"({pct(rel('bf16-mixed', 'fp32', 'images_per_s'))} here "
        "comes from AVX512-BF16 matmuls, not tensor cores).",
        f"- **Activation checkpointing, memory (a further -50..60%)**: {pct(ckpt_mem)} here (all blocks, diluted "
        "by the "
        f"small model's fixed state); the planner gives {proj('bf16-mixed', 'all', 'bf16-mixed', 'none')} at batch "
        "32/64/128: "
        "the claimed range is the batch-64 case; it depends on how much of the peak activations are.",
        f"- **Activation checkpointing, speed (-20..30%)**: {pct(ckpt_speed)} in fp32, {pct(ckpt_speed16)} in bf16 "
        "here "
        f"(run-to-run noise: {pct(noise)}). Recomputing every block adds a third of the forward+backward FLOPs "
        "(-25% on compute-bound hardware), so this one transfers roughly; the GPU run must still confirm it.",
        f"- **Both together (-70..80%)**: {pct(both_mem)} here; the planner gives "
        f"{proj('bf16-mixed', 'all', '32-true', 'none')} "
        "for DiT-XL/2 at batch 32/64/128: reached from batch ~64.",
        "",
    ]


def planner_projection(model: str = "DiT-XL/2", batches: tuple[int, ...] = (32, 64, 128)) -> str:
    """What the (CPU-validated) planner predicts for the claims at GPU scale."""
    from dit_lightning.planner import plan_memory

    rows = [
        "The same comparisons predicted by the planner for DiT-XL/2 at 256px on one GPU (max_memory_allocated, "
        "AdamW + EMA, foreach AdamW, flash attention):",
        "",
        "| batch | fp32 (GiB) | bf16-mixed | bf16 + ckpt half | bf16 + ckpt all | mixed vs fp32 | ckpt-all vs "
        "mixed | both vs fp32 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in batches:
        kw: dict[str, Any] = dict(micro_batch=b, fused_optimizer=False, device="cuda")
        fp32 = plan_memory(model, precision="32-true", **kw).peak_allocated
        mixed = plan_memory(model, precision="bf16-mixed", **kw).peak_allocated
        half = plan_memory(model, precision="bf16-mixed", activation_checkpointing="half", **kw).peak_allocated
        full = plan_memory(model, precision="bf16-mixed", activation_checkpointing="all", **kw).peak_allocated
        g = 1024**3
        rows.append(
            f"| {b} | {fp32 / g:.1f} | {mixed / g:.1f} | {half / g:.1f} | {full / g:.1f} | "
            f"{(mixed / fp32 - 1) * 100:+.0f}% | "
            f"{(full / mixed - 1) * 100:+.0f}% | {(full / fp32 - 1) * 100:+.0f}% |"
        )
    return "\n".join(rows)


def write_plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    names = [r["config"] for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(ok) + 1.8))
    mem = [r["peak_bytes"] / MiB for r in ok]
    pred = [r.get("planner_bytes", 0) / MiB for r in ok]
    ypos = range(len(ok))
    axes[0].barh([y + 0.2 for y in ypos], mem, height=0.4, label="measured peak", color="#4c72b0")
    axes[0].barh([y - 0.2 for y in ypos], pred, height=0.4, label="planner", color="#dd8452", alpha=0.8)
    axes[0].set_yticks(list(ypos), names)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("peak memory (MiB)")
    axes[0].legend(loc="lower right", fontsize=8)
    axes[1].barh(list(ypos), [r["images_per_s"] for r in ok], color="#55a868")
    axes[1].set_yticks(list(ypos), [""] * len(ok))
    axes[1].invert_yaxis()
    axes[1].set_xlabel("images / s")
    base = _get(rows, "fp32")
    if base:
        axes[0].axvline(base["peak_bytes"] / MiB, color="gray", ls="--", lw=0.8)
        axes[1].axvline(base["images_per_s"], color="gray", ls="--", lw=0.8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _child(name: str, args) -> dict[str, Any]:
    """Run one configuration in a fresh interpreter (``--isolate subprocess``)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, __file__, "--_child", name, "--_child-out", out] + sys.argv[1:]
    cmd = _strip_option(cmd, "--configs")
    cmd = _strip_option(cmd, "--isolate")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {
            "config": name,
            "status": f"failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}",
            "note": "",
        }
    row = json.loads(Path(out).read_text())
    os.unlink(out)
    return row


def _strip_option(cmd: list[str], opt: str) -> list[str]:
    out, skip = [], False
    for a in cmd:
        if skip:
            skip = False
            continue
        if a == opt:
            skip = True
            continue
        if a.startswith(opt + "="):
            continue
        out.append(a)
    return out


def _release() -> None:
    gc.collect()
    try:
        torch._dynamo.reset()
    except Exception:
        pass
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--model",
        default=None,
        help="DiT-XL/2 ... or custom (default: DiT-XL/2 on cuda; on cpu custom 6 blocks x 256, latent 16, batch 32)",
    )
    parser.add_argument("--depth", type=int)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-heads", type=int)
    parser.add_argument("--patch-size", type=int)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=None, help="micro-batch (default 64 on cuda, 32 on cpu)")
    parser.add_argument("--latent-size", type=int, default=None, help="latent side (32 = 256px images; cpu default 16)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 5)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (default 2 cuda, 1 cpu; compile >= 2)"
    )
    parser.add_argument(
        "--max-seconds", type=float, default=60.0, help="stop timing a configuration after this long (>= 1 step)"
    )
    parser.add_argument("--configs", default=None, help=f"comma-separated subset of: {', '.join(CONFIGS)}")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default 1 on cpu: stable on shared machines)"
    )
    parser.add_argument("--isolate", choices=["inprocess", "subprocess"], default="inprocess")
    parser.add_argument("--out", default="docs/benchmarks")
    parser.add_argument("--name", default=None, help="file name suffix (default: model_latent_batch)")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if args.model is None and not cuda:
        # activations outweigh the weights/optimizer/EMA state ~2.5:1, as for DiT-XL/2 at batch 32-64,
        # and a step takes about a second on one core
        args.model = "custom"
        args.depth, args.hidden_size, args.num_heads, args.patch_size = (
            args.depth or 6,
            args.hidden_size or 256,
            args.num_heads or 4,
            args.patch_size or 2,
        )
        args.latent_size = args.latent_size or 16
        args.batch = args.batch or 32
    args.model = args.model or "DiT-XL/2"
    args.latent_size = args.latent_size or 32
    args.batch = args.batch or (64 if cuda else 8)
    args.steps = args.steps or 5
    args.warmup = args.warmup if args.warmup is not None else (2 if cuda else 1)
    threads = args.threads or (None if cuda else 1)
    if threads:
        torch.set_num_threads(threads)
    names = args.configs.split(",") if args.configs else DEFAULT_GRID[args.device]
    args.configs_explicit = names if args.configs else []
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}: choose from {', '.join(CONFIGS)}")

    if args._child:
        row = run_config(args._child, args)
        Path(args._child_out).write_text(json.dumps(row))
        return [row]

    rows = []
    for name in names:
        t = time.perf_counter()
        if args.isolate == "subprocess" and not (CONFIGS[name].cuda_only and not cuda):
            row = _child(name, args)
        else:
            try:
                row = run_config(name, args)
            except Exception as e:  # keep the rest of the grid
                row = {
                    "config": name,
                    "status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}",
                    "note": "",
                }
            _release()
        print(
            f"[{time.perf_counter() - t:6.1f}s] {name}: {row['status']}"
            + (
                f", {row['images_per_s']:.2f} img/s, peak {row['peak_bytes'] / MiB:,.1f} MiB"
                if row["status"] == "ok"
                else ""
            ),
            flush=True,
        )
        rows.append(row)
        write_report(rows, args, argv, threads, final=False)

    stem = write_report(rows, args, argv, threads, final=True)
    print()
    print(markdown_table(rows))
    print(f"wrote {stem}.md, .csv, .png")
    return rows


def _cuda_environment() -> str:
    """Driver, CUDA runtime and cuDNN versions for the report header."""
    driver = "unknown"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else driver
    except (OSError, subprocess.SubprocessError):
        pass
    return f"driver {driver}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"


def write_report(
    rows: list[dict[str, Any]], args, argv: Optional[list[str]], threads: Optional[int], final: bool
) -> Path:
    """The markdown and CSV of the rows so far (rewritten atomically after every row); the plot at the end."""
    from dit_lightning.atomic import write_text
    from dit_lightning.models import dit_params, shape_of

    cuda = args.device == "cuda"
    shape = _shape_kwargs(args)
    nparams = dit_params(shape_of("custom", **dict(shape)))
    slug = args.name or f"{args.model.lower().replace('/', '-')}_l{args.latent_size}_b{args.batch}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"optimizations_{args.device}_{slug}"
    command = "python benchmarks/bench_optimizations.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    table = markdown_table(rows)
    date = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    md = [
        f"# Training optimisations on {args.device.upper()}: {args.model}, latent {args.latent_size}, batch "
        f"{args.batch}",
        "",
        f"- machine: {_machine(args.device)}" + (f", {threads} thread(s)" if threads else ""),
        f"- date: {date}; torch {torch.__version__}; python {platform.python_version()}"
        + (f"; {_cuda_environment()}" if cuda else ""),
        f"- model: {args.model} (depth {shape['depth']}, hidden {shape['hidden_size']}, heads "
        f"{shape['num_heads']}, patch {shape['patch_size']}, "
        f"{(args.latent_size // shape['patch_size']) ** 2} tokens, {nparams / 1e6:.1f}M parameters), AdamW + EMA, "
        "hybrid loss",
        f"- timing: {args.warmup} warm-up step(s), then up to {args.steps} timed steps (at most "
        f"{args.max_seconds:g} s) per configuration; "
        f"isolation: {args.isolate}"
        + (
            ""
            if cuda
            else "; speed = images per CPU-second of this process "
            "(wall time on a shared machine depends on the neighbours; "
            "wall-clock figures are in the CSV)"
        ),
        "- peak memory: "
        + (
            "`torch.cuda.max_memory_allocated` over the timed steps"
            if cuda
            else "weights + EMA + optimiser states + batch, plus the CPU allocator's peak during one step "
            "(profiler memory events)"
        ),
        "- MFU: useful training FLOPs (3 x forward, recomputation not counted) per second over the device's dense "
        "peak for the row's compute dtype (`dit_lightning.planner.hardware`; TF32 peak for fp32 rows with TF32 on)"
        if cuda
        else "- MFU: not measured on CPU (no meaningful peak)",
        f"- command: `{command}`",
        "",
        table,
        claims_section(rows, args.device),
    ]
    if not final:
        md.insert(2, f"**Partial: {len(rows)} row(s) so far; the run was cut or is still going.**\n")
    write_text(stem.with_suffix(".md"), "\n".join(md))
    fields = [
        "config",
        "status",
        "images_per_s",
        "wall_images_per_s",
        "step_s",
        "steps",
        "warmup_s",
        "peak_bytes",
        "reserved_bytes",
        "planner_bytes",
        "mfu",
        "hfu",
        "peak_tflops",
        "loss",
        "note",
    ]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    write_text(stem.with_suffix(".csv"), buf.getvalue())
    if final and any(r["status"] == "ok" for r in rows):
        write_plot(
            rows,
            stem.with_suffix(".png"),
            f"{args.model} latent {args.latent_size} batch {args.batch} on {_machine(args.device)}",
        )
    return stem


if __name__ == "__main__":
    main()
