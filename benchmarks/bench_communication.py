"""Gradient communication on this machine (2 gloo processes): bytes measured vs planned, and what
compression costs the digits demo.

1. **Bytes.** ``tests/distributed/comm_runs.py`` trains a small DiT (depth 2, width 64, digits store)
   with every strategy and reduction in 2 gloo processes and counts, per optimiser step, the payload
   each rank hands to ``torch.distributed``'s all-reduce / all-gather / reduce-scatter
   (:func:`dit_lightning.distributed.communication.count_collectives`; DDP "none" through PyTorch's
   ``allreduce_hook``, what its C++ reducer does). The planner's count
   (:func:`dit_lightning.planner.communication.plan_communication`) stands beside it.
2. **Quality** (``--demo``): ``dit-lightning fit --config configs/demo.yaml`` on 2 gloo DDP processes
   with ``communication`` none, bf16 and powersgd (same seed, same data order), then ``dit-lightning test``
   of each run's last checkpoint: the loss curves and the digits metrics side by side.

    python benchmarks/bench_communication.py                       # bytes only (~1 minute)
    python benchmarks/bench_communication.py --demo --steps 1000   # + the three demo runs (CPU-heavy)

Writes ``communication_cpu.{md,csv}`` to ``--output`` (default docs/benchmarks).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dit_lightning.planner import PlanOptions  # noqa: E402
from dit_lightning.planner.communication import plan_communication  # noqa: E402
from tests.distributed import comm_runs  # noqa: E402

# run name -> (strategy, reduction, planner levers, micro-batches per optimiser step)
CASES: dict[str, tuple[str, str, dict[str, Any], int]] = {
    "ddp_none": ("DDP", "none (fp32)", {}, 1),
    "ddp_none_accum": ("DDP, accumulation 2", "none (fp32)", {"accumulate_grad_batches": 2}, 2),
    "ddp_bf16": ("DDP", "bf16 hook", {"communication": "bf16"}, 1),
    "ddp_fp16": ("DDP", "fp16 hook", {"communication": "fp16"}, 1),
    "powersgd": ("DDP", "PowerSGD rank 2 (after warm-up)", {"communication": "powersgd:2"}, 1),
    "fsdp2": ("FSDP2 reshard_after_forward", "reduce_dtype fp32", {"strategy": "fsdp", "sharding": "FULL_SHARD"}, 1),
    "fsdp2_accum": (
        "FSDP2, accumulation 2",
        "reduce_dtype fp32",
        {"strategy": "fsdp", "sharding": "FULL_SHARD", "accumulate_grad_batches": 2},
        2,
    ),
    "fsdp2_no_reshard": (
        "FSDP2 no reshard",
        "reduce_dtype fp32",
        {"strategy": "fsdp", "sharding": "SHARD_GRAD_OP"},
        1,
    ),
    "fsdp2_bf16_reduce": (
        "FSDP2 reshard_after_forward",
        "reduce_dtype bf16",
        {"strategy": "fsdp", "sharding": "FULL_SHARD", "communication": "bf16"},
        1,
    ),
}
DEMO = ("none", "bf16", "powersgd")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def measure_bytes(work: Path) -> list[dict[str, Any]]:
    from dit_lightning.data import LatentDataModule, prepare_digits

    store = prepare_digits(str(work / "digits"))
    subprocess.run(
        [sys.executable, str(ROOT / "tests/distributed/comm_runs.py"), "--data", store, "--out", str(work / "runs")]
        + ["--runs", ",".join(CASES)],
        env=_env(),
        cwd=work,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    dm = LatentDataModule(store, global_batch_size=comm_runs.GLOBAL_BATCH)
    channels, size, _ = dm.latent_shape
    base = PlanOptions(
        **comm_runs.NET,
        latent_size=size,
        in_channels=channels,
        num_classes=dm.num_classes,
        world_size=2,
        precision="32-true",
    )
    rows = []
    for name, (strategy, reduction, levers, micro) in CASES.items():
        result = torch.load(work / "runs" / f"{name}.pt", weights_only=False)
        steps = result["steps"]
        if name == "powersgd":
            steps = steps[comm_runs.WARMUP :]
        step: dict[str, int] = {}
        for m in steps[-micro:]:  # the last optimiser step
            for k, v in m.items():
                step[k] = step.get(k, 0) + v
        plan = plan_communication(base.replace(**levers)).payload
        for kind in sorted(set(step) | set(plan)):
            got, want = step.get(kind, 0), plan.get(kind, 0.0)
            rows.append(
                {
                    "strategy": strategy,
                    "reduction": reduction,
                    "collective": kind,
                    "measured_bytes": got,
                    "planned_bytes": int(want),
                    "planned_over_measured": round(want / got, 4) if got else None,
                }
            )
    return rows


def demo_run(work: Path, communication: str, steps: int, warmup: int) -> dict[str, Any]:
    """One demo fit on 2 gloo DDP processes and the test of its last checkpoint."""
    out = work / "demo" / communication
    out.mkdir(parents=True, exist_ok=True)
    override = out / "override.yaml"
    override.write_text(
        "trainer:\n  logger:\n    class_path: lightning.pytorch.loggers.CSVLogger\n"
        f"    init_args:\n      save_dir: {out}\n      name: ''\n"
    )
    last = out / "last_path"
    fit = [
        "fit",
        "--config",
        "configs/demo.yaml",
        "--config",
        "configs/hardware/cpu.yaml",
        "--config",
        str(override),
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "dit_lightning.distributed.DiTDDPStrategy",
        "--trainer.strategy.process_group_backend",
        "gloo",
        "--trainer.strategy.communication",
        communication,
        "--trainer.max_steps",
        str(steps),
        "--sample_grid.enabled",
        "false",
        "--checkpoint.last_path_file",
        str(last),
    ]
    if communication == "powersgd":
        fit += ["--trainer.strategy.powersgd_warmup_steps", str(warmup)]
    cli = [sys.executable, "-m", "dit_lightning.cli"]
    subprocess.run(cli + fit, env=_env(), cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    losses: dict[int, float] = {}  # read before `test`, which logs into the same run directory
    for path in out.rglob("metrics.csv"):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get("train/loss"):
                    losses[int(row["step"])] = float(row["train/loss"])
    ckpt = last.read_text().strip()
    test = ["test", "--config", "configs/demo.yaml", "--config", "configs/hardware/cpu.yaml"]
    test += ["--config", str(override), "--ckpt_path", ckpt]
    subprocess.run(cli + test, env=_env(), cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics: dict[str, Any] = {}
    for path in out.rglob("test_metrics.json"):
        metrics = json.loads(path.read_text())
    return {"communication": communication, "losses": losses, "metrics": metrics}


def _against_none(demo: list[dict[str, Any]], steps: list[int]) -> str:
    """Each compressed run's change against ``none`` (same seed): the late training loss, the digits
    accuracy and the two Frechet distances (lower is better for all but the accuracy)."""
    base = next((d for d in demo if d["communication"] == "none"), None)
    if base is None or len(demo) < 2:
        return ""
    late = steps[int(0.8 * len(steps)) :]

    def figures(d: dict[str, Any]) -> dict[str, float]:
        flat = _flat(d["metrics"])
        return {
            "mean train loss, last 20%": sum(d["losses"][s] for s in late) / len(late),
            "digits accuracy": flat.get("digits.accuracy", float("nan")),
            "fd pixels": flat.get("digits.frechet.fd_pixels", float("nan")),
            "fd svc": flat.get("digits.frechet.fd_svc", float("nan")),
        }

    ref = figures(base)
    out = "\nChange against `none` (same seed and data order):\n\n| communication | " + " | ".join(ref) + " |\n"
    out += "|---" * (1 + len(ref)) + "|\n"
    for d in demo:
        if d is not base:
            got = figures(d)
            cells = [f"{got[k] / ref[k] - 1:+.1%}" if ref[k] else "n/a" for k in ref]  # accuracy 0 when short
            out += f"| {d['communication']} | " + " | ".join(cells) + " |\n"
    return out


def _flat(metrics: dict[str, Any]) -> dict[str, float]:
    flat: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            flat.update({f"{k}.{kk}": vv for kk, vv in _flat(v).items()})
        elif isinstance(v, (int, float)):
            flat[k] = float(v)
    return flat


def write(rows: list[dict[str, Any]], demo: list[dict[str, Any]], args: argparse.Namespace, output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    with open(output / "communication_cpu.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    md = io.StringIO()
    md.write("# Gradient communication on CPU: bytes measured vs planned, and what compression costs\n\n")
    md.write(
        f"{dt.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, 2 gloo processes. Command: `python benchmarks/bench_communication.py"
        f"{' --demo --steps ' + str(args.steps) if args.demo else ''}`.\n\n"
    )
    md.write(
        "Payload bytes one rank hands to each collective in one optimiser step (DDP: the bucket all-reduces; "
        "FSDP2: the gathered parameters and the unreduced gradients), counted by wrapping torch.distributed, "
        "for a DiT of depth 2, width 64, patch 2 on the 8x8 digits (179,848 trainable parameters), vs the "
        "planner's count. A ring sends 2(W-1)/W of an all-reduce's payload and (W-1)/W of an all-gather's or "
        "reduce-scatter's from each device.\n\n"
    )
    md.write("| strategy | reduction | collective | measured bytes | planned bytes | planned / measured |\n")
    md.write("|---|---|---|---:|---:|---:|\n")
    for r in rows:
        md.write(
            f"| {r['strategy']} | {r['reduction']} | {r['collective']} | {r['measured_bytes']:,} | "
            f"{r['planned_bytes']:,} | {r['planned_over_measured']} |\n"
        )
    md.write(
        "\nFSDP2 pads every parameter's first dimension to a multiple of the world size: its collectives are "
        "a little larger than the tensors (0.3% here). With accumulation DDP sends once per optimiser step "
        "(no_sync), FSDP2 every micro-batch.\n"
    )
    if demo:
        md.write(
            f"\n## The digits demo with compressed gradients\n\n`dit-lightning fit --config configs/demo.yaml "
            f"--config configs/hardware/cpu.yaml --trainer.devices 2 --trainer.strategy "
            f"dit_lightning.distributed.DiTDDPStrategy --trainer.strategy.process_group_backend gloo "
            f"--trainer.strategy.communication C --trainer.max_steps {args.steps}` (PowerSGD: rank 4, "
            f"`powersgd_warmup_steps {args.warmup}`), same seed and data order, then `dit-lightning test` of "
            "the last checkpoint (500 generated digits, EMA weights).\n\n"
        )
        keys = sorted({k for d in demo for k in _flat(d["metrics"])})
        keys = [k for k in keys if any(s in k for s in ("accuracy", "loss", "fd"))] or keys
        steps = sorted(set.intersection(*(set(d["losses"]) for d in demo)))
        marks = [s for s in steps if s in (steps[0], steps[len(steps) // 4], steps[len(steps) // 2], steps[-1])]
        md.write(
            "| communication | " + " | ".join(f"train loss @{s}" for s in marks) + " | mean train loss, last 20% |"
        )
        md.write("".join(f" {k} |" for k in keys) + "\n")
        md.write("|---" * (2 + len(marks) + len(keys)) + "|\n")
        for d in demo:
            tail = [d["losses"][s] for s in steps[int(0.8 * len(steps)) :]]
            flat = _flat(d["metrics"])
            cells = [f"{d['losses'][s]:.4f}" for s in marks] + [f"{sum(tail) / len(tail):.4f}"]
            cells += [f"{flat.get(k, float('nan')):.4g}" for k in keys]
            md.write(f"| {d['communication']} | " + " | ".join(cells) + " |\n")
        md.write(_against_none(demo, steps))
        with open(output / "communication_demo_cpu.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["communication", "step", "train_loss"])
            for d in demo:
                for s in sorted(d["losses"]):
                    writer.writerow([d["communication"], s, d["losses"][s]])
    (output / "communication_cpu.md").write_text(md.getvalue())
    print(md.getvalue())


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks")
    parser.add_argument("--demo", action="store_true", help="also the three demo runs (CPU-heavy)")
    parser.add_argument("--steps", type=int, default=1000, help="demo optimiser steps")
    parser.add_argument("--warmup", type=int, default=100, help="PowerSGD's plain all-reduce steps in the demo")
    parser.add_argument("--work", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--skip-bytes", action="store_true", help="reuse --output's byte table (demo only)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) if args.work is None else args.work
        if args.skip_bytes:
            with open(args.output / "communication_cpu.csv") as f:
                rows: list[dict[str, Any]] = list(csv.DictReader(f))
            for r in rows:
                r["measured_bytes"], r["planned_bytes"] = int(r["measured_bytes"]), int(r["planned_bytes"])
        else:
            rows = measure_bytes(work)
        demo = [demo_run(work, c, args.steps, args.warmup) for c in DEMO] if args.demo else []
        write(rows, demo, args, args.output)


if __name__ == "__main__":
    main()
