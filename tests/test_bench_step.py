"""benchmarks/bench_step.py cannot rot: its ``--quick`` run (a tiny custom DiT, bare loop vs
dit-lightning vs auto-fit, alternating) runs end to end and writes both tables with their columns."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_writes_the_tables(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--quick", "--autofit", "1"]
    proc = subprocess.run(
        cmd + ["--output", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (tmp_path / "step_overhead_cpu.md").read_text()
    for line in (
        "- date:",
        "- machine:",
        "- software:",
        "torch ",
        "lightning ",
        "- command: `python benchmarks/bench_step.py --quick",
    ):
        assert line in md, line
    assert "| variant | median step (ms) |" in md and "Goal: dit-lightning at most 3%" in md

    rows = list(csv.DictReader(open(tmp_path / "step_overhead_cpu.csv")))
    assert [r["variant"] for r in rows] == ["bare PyTorch loop", "dit-lightning", "dit-lightning + auto-fit"]
    for column in ("median_step_ms", "median_cpu_ms", "overhead_pct", "round_overhead_min_pct", "max_loss_diff"):
        assert column in rows[0], column
    for column in ("date", "machine", "threads", "torch", "lightning", "command"):
        assert rows[0][column], column
    bare, lit, autofit = rows
    assert float(bare["median_step_ms"]) > 0 and float(lit["median_step_ms"]) > 0
    assert lit["steps_timed"] == "6"  # --quick: 2 rounds x 3 timed steps
    float(lit["overhead_pct"])
    # the same seed, batches and keyed draws: both sides compute the same step
    assert float(lit["max_loss_diff"]) < 1e-6, lit["max_loss_diff"]
    # auto-fit: measured, or 'n/a' with the reason (an API that moved must not break the benchmark)
    assert autofit["median_step_ms"] != "n/a" or autofit["note"], autofit
