"""Loader throughput: LatentDataModule vs a plain per-sample Dataset + default collate.

Both read the same store (random 4x32x32 float16 moments with flips, i.e. 256px ImageNet
latents), with the same workers and batch size, from a warm page cache, and both do the full
training augmentation (random flip + fresh posterior sample). Results go to stdout as a
markdown table and to docs/benchmarks/loader_<host>.{md,csv}.

    python benchmarks/bench_loader.py                  # 20,000 samples, batch 256, 2 workers
    python benchmarks/bench_loader.py --num-workers 4 --samples 50000
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import platform
import socket
import sys
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the random-store fixture lives with the tests

from dit_lightning.data.datamodule import LatentDataModule  # noqa: E402
from dit_lightning.data.store import LatentStore  # noqa: E402
from tests.helpers.data import make_random_store  # noqa: E402


class PerSampleDataset(Dataset):
    """What a straightforward port does: one memory-mapped sample per __getitem__, torch RNG."""

    def __init__(self, path: str) -> None:
        self.store = LatentStore(path)  # for the shard list and labels only
        self.files = [os.path.join(path, s["file"]) for s in self.store.meta["shards"]]
        self.offsets = self.store.offsets
        self.maps: dict[int, np.ndarray] = {}
        self.scale = self.store.scale_factor

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i: int) -> dict[str, Any]:
        k = int(np.searchsorted(self.offsets, i, side="right") - 1)
        if k not in self.maps:
            self.maps[k] = np.load(self.files[k], mmap_mode="r")
        flip = int(torch.randint(0, 2, ()).item())
        mean, logvar = torch.from_numpy(np.array(self.maps[k][i - self.offsets[k], flip])).float()
        x = (mean + torch.exp(0.5 * logvar) * torch.randn_like(mean)) * self.scale
        return {"x": x, "y": int(self.store.labels[i]), "index": i}


def warm_cache(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                while chunk := fh.read(1 << 24):
                    total += len(chunk)
    return total


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    except OSError:
        return 0.0


def _cpu_seconds(it: Any) -> float:
    """CPU time so far of this process and of the iterator's worker processes."""
    workers = getattr(it, "_workers", None) or []
    return time.process_time() + sum(_proc_cpu(w.pid) for w in workers)


def measure(loader: DataLoader, max_batches: int, warm_epochs: int) -> tuple[float, int, float, float]:
    """(samples/s, samples, first-batch seconds, CPU microseconds per sample), steady state.

    ``warm_epochs`` untimed passes run first with the same persistent workers (their memory
    maps are then populated, as in any epoch after the first of a training run). The clock
    starts at the first batch, so worker start-up is excluded. CPU time (main + workers) is
    reported too: on a shared machine it is steadier than wall time.
    """
    for _ in range(warm_epochs):
        for b, _batch in enumerate(loader):
            if b + 1 >= max_batches:
                break
    it = iter(loader)
    t_first = time.perf_counter()
    first = next(it)
    startup = time.perf_counter() - t_first
    c0 = _cpu_seconds(it)
    t0 = time.perf_counter()
    n = 0
    for b, batch in enumerate(it, start=1):
        n += len(batch["index"])
        if b + 1 >= max_batches:
            break
    seconds = time.perf_counter() - t0
    cpu = _cpu_seconds(it) - c0
    del first
    return n / seconds, n, startup, cpu / n * 1e6


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default=os.path.join(REPO, "outputs", "bench_store_4x32x32"))
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--num-workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--batches", type=int, default=0, help="batches timed per loader (default: one epoch)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved runs per loader; medians are reported")
    p.add_argument("--warm-epochs", type=int, default=1, help="untimed passes before the timed one")
    p.add_argument("--out-dir", default=os.path.join(REPO, "docs", "benchmarks"))
    args = p.parse_args()

    t = time.perf_counter()
    store = make_random_store(args.store, n=args.samples, latent_shape=(4, 32, 32), num_classes=1000)
    print(f"store: {store} ({time.perf_counter() - t:.1f}s to build or validate)", file=sys.stderr)
    nbytes = warm_cache(args.store)
    batches = args.batches or args.samples // args.batch_size
    W, B = args.num_workers, args.batch_size
    loader_kw = dict(num_workers=W, persistent_workers=W > 0, pin_memory=False)

    rows = []

    def ours() -> DataLoader:
        dm = LatentDataModule(args.store, global_batch_size=B, **loader_kw)
        return dm.train_dataloader()

    def baseline() -> DataLoader:
        return DataLoader(PerSampleDataset(args.store), batch_size=B, shuffle=True, drop_last=True, **loader_kw)

    loaders = [
        ("per-sample Dataset + default collate (baseline)", baseline),
        ("LatentDataModule (batched, counter-based RNG)", ours),
    ]
    # Interleaved repeats, median reported: on a shared machine both loaders then see the
    # same mix of quiet and busy moments.
    runs: dict[str, list] = {name: [] for name, _ in loaders}
    for rep in range(args.repeats):
        for name, make in loaders:
            r = measure(make(), batches, args.warm_epochs)
            runs[name].append(r)
            print(f"run {rep + 1}: {name}: {r[0]:,.0f} samples/s, {r[3]:.1f} CPU-us/sample", file=sys.stderr)
    for name, _ in loaders:
        rs = runs[name]
        rows.append(
            {
                "loader": name,
                "num_workers": W,
                "batch_size": B,
                "samples_per_s": round(float(np.median([r[0] for r in rs]))),
                "best_samples_per_s": round(max(r[0] for r in rs)),
                "cpu_us_per_sample": round(float(np.median([r[3] for r in rs])), 1),
                "samples_timed": rs[0][1],
                "first_batch_s": round(float(np.median([r[2] for r in rs])), 3),
            }
        )
    base = rows[0]["samples_per_s"]
    base_cpu = rows[0]["cpu_us_per_sample"]
    for row in rows:
        row["speedup"] = f"{row['samples_per_s'] / base:.2f}x"
        row["cpu_speedup"] = f"{base_cpu / row['cpu_us_per_sample']:.2f}x"

    host = socket.gethostname().split(".")[0] or "host"
    cores = os.cpu_count()
    date = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    command = "python " + " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])
    header = [
        "loader",
        "num_workers",
        "batch_size",
        "samples_per_s",
        "speedup",
        "best_samples_per_s",
        "cpu_us_per_sample",
        "cpu_speedup",
        "first_batch_s",
        "samples_timed",
    ]
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    table += [
        "| " + " | ".join(f"{r[h]:,}" if isinstance(r[h], int) else str(r[h]) for h in header) + " |" for r in rows
    ]
    md = "\n".join(
        [
            f"# Loader benchmark on {host}",
            "",
            f"- date: {date}",
            f"- machine: {cpu_model()}, {cores} cores (os.cpu_count), {platform.platform()}",
            f"- load average at the end (1/5/15 min): {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
            " (other jobs on a shared machine lower the wall-clock numbers; CPU-us/sample is main + workers)",
            f"- software: Python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}",
            f"- command: `{command}`",
            f"- store: {args.samples:,} samples of 4x32x32 float16 moments with flips "
            f"({nbytes / 2**20:,.0f} MiB, page cache warm), random data",
            "- both loaders: shuffled, random flip + fresh posterior sample per access, same workers and batch;"
            f" persistent workers; {args.warm_epochs} untimed warm-up epoch(s), then samples/s of one"
            f" epoch in steady state (clock starts after its first batch); median (and best) of"
            f" {args.repeats} interleaved runs per loader. cpu_us_per_sample: CPU time of the main"
            " process and the workers per sample (median); cpu_speedup compares those",
            "",
            *table,
            "",
        ]
    )
    print(md)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"loader_{host}")
    with open(stem + ".md", "w") as f:
        f.write(md)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header + ["host", "cpu", "cores", "date", "command"])
        w.writeheader()
        for row in rows:
            w.writerow({**row, "host": host, "cpu": cpu_model(), "cores": cores, "date": date, "command": command})
    print(f"wrote {stem}.md and {stem}.csv", file=sys.stderr)


if __name__ == "__main__":
    main()
