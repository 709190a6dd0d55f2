#!/usr/bin/env python3
"""GPU acceptance in one command (``make gpu-check``): every CUDA path, then the real-size benchmarks.

On a fresh machine with one CUDA GPU it installs what it needs from the project's own files,
then, within 8 minutes (``--budget``), runs these stages, each under its own time budget:

1. ``gpu-tests``: the ``gpu``-marked tests with ``DIT_REQUIRE_GPU=1`` (a skip is a failure);
2. ``fit``: a small DiT trained through ``dit-lightning fit`` in 16-mixed (GradScaler), bf16-mixed
   and 32-true, with and without activation checkpointing, fused AdamW, compile in one run; each
   resumed once from a mid-epoch checkpoint and compared with the uninterrupted run;
3. ``distributed``: FSDP1 and FSDP2 at world size 1, DDP and FSDP2 with two processes sharing the
   device (gloo), against the same training in one process;
4. ``bench``: the optimisation grid for DiT-XL/2 256px at micro-batch 64
   (``benchmarks/bench_optimizations.py``: memory against the planner, images/s, MFU);
5. ``sampling``: DDPM-250 vs DDIM-50 images/s for DiT-XL/2 with CFG, fp32 and bf16
   (``benchmarks/bench_sampling.py``);

and writes ``gpu_check_<gpu>.{md,csv}`` (next to the benchmarks' own ``*_<gpu>`` tables) into
``docs/benchmarks/`` with the date, device, driver, versions and the exact command, then prints
one summary table with the seed's claims beside the measured figures. A stage that reaches its
budget is cut (its processes are killed); the script goes on, and every table is rewritten after
each stage, so partial results are kept.

``--dry-run`` runs the same stages end to end at tiny sizes on the CPU in under 3 minutes
(CUDA-only paths are reported as "skipped: needs CUDA") and writes to ``outputs/gpu-check-dry``.

    make gpu-check                                  # = python3 benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --dry-run        # CPU, tiny sizes, < 3 minutes

Only the standard library is imported at module level: the install stage runs before the
project's dependencies exist.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import functools
import io
import json
import math
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

# Modules the check imports, and the distributions that provide them (pyproject's dependencies
# and the test extras the gpu tests need).
REQUIRED = {
    "torch": "torch",
    "lightning": "lightning",
    "jsonargparse": "jsonargparse",
    "docstring_parser": "docstring-parser",
    "typeshed_client": "typeshed-client",
    "yaml": "pyyaml",
    "tensorboard": "tensorboard",
    "rich": "rich",
    "numpy": "numpy",
    "PIL": "pillow",
    "sklearn": "scikit-learn",
    "matplotlib": "matplotlib",
    "torchmetrics": "torchmetrics",
    "pytest": "pytest",
}
WHEELS = ROOT / ".whl"  # wheels carried to a machine without a package index (make gpu-wheels)
SITE = ROOT / ".gpu-check-site"  # where those wheels are installed (added to PYTHONPATH)

# Seconds per stage: (GPU, dry run). The whole run is also bounded by --budget.
BUDGETS = {
    "install": (90, 10),
    "gpu-tests": (110, 30),
    "fit": (105, 75),
    "distributed": (60, 50),
    "bench": (100, 30),
    "sampling": (45, 20),
}
SUMMARY_RESERVE_S = 8.0
TOTAL_BUDGET = {"gpu": 480.0, "dry": 175.0}  # 8 minutes on the GPU; under 3 minutes for the dry run

# The seed's claims (README of the seed), checked against the benchmark grid.
CLAIMS = [
    # (claim, measured as, baseline, metric, low, high)  metric: "memory" (peak change) / "time" (step time change)
    ("AMP saves 35-45% memory", "bf16-mixed", "fp32", "memory", -0.45, -0.35),
    ("AMP saves 35-45% memory (fp16 + GradScaler)", "16-mixed", "fp32", "memory", -0.45, -0.35),
    ("AMP is 15-25% faster", "bf16-mixed", "fp32", "speed", 0.15, 0.25),
    ("AMP is 15-25% faster (fp16 + GradScaler)", "16-mixed", "fp32", "speed", 0.15, 0.25),
    ("AMP is 15-25% faster (against TF32 fp32)", "bf16-mixed", "tf32", "speed", 0.15, 0.25),
    ("checkpointing saves a further 50-60%", "bf16+ckpt-all", "bf16-mixed", "memory", -0.60, -0.50),
    ("checkpointing is 20-30% slower", "bf16+ckpt-all", "bf16-mixed", "time", 0.20, 0.30),
    ("AMP + checkpointing save 70-80%", "bf16+ckpt-all", "fp32", "memory", -0.80, -0.70),
]


# ---- results ----------------------------------------------------------------------------------
@dataclass
class Check:
    stage: str
    name: str
    status: str  # "pass", "fail", "skipped: <why>", "cut: <why>"
    measured: str = ""
    expected: str = ""
    detail: str = ""


@dataclass
class Stage:
    name: str
    title: str
    budget_s: float
    status: str = "not run"  # ok / failed / cut / error / skipped / not run
    seconds: float = 0.0
    note: str = ""


@dataclass
class Context:
    args: argparse.Namespace
    dry: bool
    start: float
    deadline: float
    out: Path
    work: Path
    python: str
    env: dict[str, str]
    slug: str = "unknown"
    device_name: str = "unknown"
    environment: dict[str, str] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    stages: list[Stage] = field(default_factory=list)
    claims: list[dict[str, str]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    store: Optional[Path] = None
    stage_deadline: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def time_left(self) -> float:
        return min(self.stage_deadline, self.deadline - SUMMARY_RESERVE_S) - time.monotonic()

    def add(
        self, stage: str, name: str, status: str, measured: Any = "", expected: Any = "", detail: Any = ""
    ) -> Check:
        check = Check(stage, name, status, str(measured), str(expected), str(detail))
        with self.lock:
            self.checks.append(check)
        mark = {"pass": "ok  ", "fail": "FAIL"}.get(status, status.split(":")[0][:4].ljust(4))
        print(f"  [{mark}] {name}" + (f": {measured}" if measured != "" else ""), flush=True)
        return check


# ---- processes --------------------------------------------------------------------------------
@dataclass
class Proc:
    rc: Optional[int]
    seconds: float
    log: Path
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def error_line(self) -> str:
        """The last line that names an error, for the one-line report."""
        if self.timed_out:
            return f"cut after {self.seconds:.0f} s (budget)"
        lines = [ln.strip() for ln in self.tail(20000).splitlines() if ln.strip()]
        for ln in reversed(lines):
            if re.search(r"(Error|Exception|error:|Traceback|FAILED|refused|not supported)", ln):
                return ln[:300]
        return (lines[-1][:300] if lines else "") + f" (exit {self.rc})"


def run(ctx: Context, cmd: list[str], log: Path, timeout: Optional[float] = None, env: Optional[dict] = None) -> Proc:
    """Run ``cmd`` in its own process group (killed whole at the timeout), output to ``log``."""
    timeout = ctx.time_left() if timeout is None else min(timeout, ctx.time_left())
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if timeout <= 1:
        log.write_text("not started: no time left in the stage budget\n")
        return Proc(None, 0.0, log, timed_out=True)
    with open(log, "w") as f:
        f.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env or ctx.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
            return Proc(rc, time.monotonic() - start, log)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return Proc(None, time.monotonic() - start, log, timed_out=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this script started for the command
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def parallel(jobs: Iterable[Callable[[], Any]], workers: int) -> list[Any]:
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(job) for job in jobs]
        return [f.result() for f in futures]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- install (stdlib only) ---------------------------------------------------------------------
def missing_modules(python: str, env: Optional[dict] = None) -> list[str]:
    code = (
        "import importlib.util, json, sys\n"
        "print(json.dumps([m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]))"
    )
    try:
        out = subprocess.run(
            [python, "-c", code, *REQUIRED], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
        )
        return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else list(REQUIRED)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return list(REQUIRED)


def install(args: argparse.Namespace, started: float) -> tuple[str, dict[str, str], str]:
    """An interpreter that imports everything the check needs: (python, env, how).

    1. ``--python``, or this interpreter, when nothing is missing (a machine image with PyTorch);
    2. the project's ``.venv`` (``make install``) when it exists and is complete;
    3. wheels carried in ``.whl/`` (machines without a package index: ``make gpu-wheels`` on a
       machine with one) installed with ``pip --no-index`` into ``.gpu-check-site`` on top of this
       interpreter's packages;
    4. else ``python -m venv .venv`` and ``pip install -e ".[test]"`` (the Makefile's install).
    """
    env = base_env()
    candidates = [args.python] if args.python else [sys.executable]
    venv_python = ROOT / ".venv" / "bin" / "python"
    if not args.python and venv_python.exists():
        candidates.append(str(venv_python))
    for python in candidates:
        missing = missing_modules(python, env)
        if not missing:
            return python, env, f"{python}: every dependency present"
    if args.python:
        raise SystemExit(f"--python {args.python} lacks {', '.join(REQUIRED[m] for m in missing)}")
    budget = BUDGETS["install"][1 if args.dry_run else 0]
    if WHEELS.is_dir() and any(WHEELS.glob("*.whl")):
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        cmd += ["--upgrade", "--target", str(SITE), *map(str, sorted(WHEELS.glob("*.whl")))]
        subprocess.run(cmd, cwd=ROOT, timeout=budget, check=False)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(BENCH), str(SITE)])
        missing = missing_modules(sys.executable, env)
        if not missing:
            return sys.executable, env, f"{sys.executable} + wheels from .whl/ in {SITE.name}/"
        raise SystemExit(
            f"still missing after installing .whl/: {', '.join(REQUIRED[m] for m in missing)}; add their wheels "
            "(make gpu-wheels on a machine with a package index) or run make install"
        )
    left = budget - (time.time() - started)
    print(f"installing into {ROOT / '.venv'} (pip install -e '.[test]')", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(ROOT / ".venv")], cwd=ROOT, check=True, timeout=max(left, 30))
    pip = [str(venv_python), "-m", "pip", "install", "-q", "--retries", "1", "--timeout", "15"]  # fail fast offline
    subprocess.run(pip + ["--upgrade", "pip"], cwd=ROOT, check=False, timeout=max(left, 30))
    proc = subprocess.run(pip + ["-e", ".[test]"], cwd=ROOT, timeout=max(budget - (time.time() - started), 60))
    if proc.returncode != 0:
        raise SystemExit(
            'pip install -e ".[test]" failed: without a package index, carry the wheels the machine lacks in .whl/ '
            "(make gpu-wheels) or pass --python with an interpreter that has them"
        )
    return str(venv_python), env, f"{venv_python}: pip install -e '.[test]'"


def base_env() -> dict[str, str]:
    drop = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    paths = [str(ROOT), str(BENCH)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["PYTHONWARNINGS"] = "ignore::DeprecationWarning"
    env["DIT_LIGHTNING_DEBUG"] = "1"  # tracebacks in the logs: a failure here must be diagnosable from them
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS (what Trainer(deterministic=...) sets)
    return env


# ---- the tiny training runs -------------------------------------------------------------------
@dataclass(frozen=True)
class FitSpec:
    name: str
    precision: str
    checkpointing: str = "none"
    compile: str = "none"
    cuda_only: bool = False
    dry: bool = True  # part of the dry run (the CPU-capable subset)


FITS = [
    FitSpec("32-true", "32-true"),
    FitSpec("32-true+ckpt-all", "32-true", "all", dry=False),
    FitSpec("bf16-mixed", "bf16-mixed", dry=False),
    FitSpec("bf16-mixed+ckpt-half", "bf16-mixed", "half"),
    FitSpec("16-mixed", "16-mixed", cuda_only=True),
    FitSpec("16-mixed+ckpt-all", "16-mixed", "all", cuda_only=True),
    FitSpec("bf16-mixed+compile", "bf16-mixed", compile="blocks"),
]


def sizes(ctx: Context) -> dict[str, int]:
    if ctx.dry:
        return dict(depth=2, hidden_size=32, num_heads=4, batch=32, steps=8, every=4, dist_steps=4, dist_every=2)
    # 1733 training digits: 27 steps per epoch at batch 64, so step 100 (the resume point) is mid-epoch
    return dict(depth=4, hidden_size=128, num_heads=4, batch=64, steps=200, every=100, dist_steps=6, dist_every=3)


def fit_config(
    ctx: Context,
    out: Path,
    precision: str,
    steps: int,
    every: int,
    checkpointing: str = "none",
    compile: str = "none",
    tf32: bool = True,
    strategy: Optional[dict] = None,
    num_nodes: int = 1,
    log_every: int = 1,
    sync_audit: bool = False,
) -> Path:
    """A ``dit-lightning fit`` config (JSON, which YAML reads) for a tiny DiT on the digits store."""
    s = sizes(ctx)
    callbacks = [
        {"class_path": "dit_lightning.callbacks.DiTThroughputMonitor", "init_args": {"warmup_steps": 2}},
        {"class_path": "dit_lightning.callbacks.GPUMemoryMonitor"},
        {
            "class_path": "gpu_check_facts.RunFacts",
            "init_args": {"output": str(out / "facts"), "sync_audit": sync_audit},
        },
    ]
    trainer: dict[str, Any] = {
        "accelerator": "cpu" if ctx.dry else "gpu",
        "devices": 1,
        "num_nodes": num_nodes,
        "precision": precision,
        "max_steps": steps,
        "log_every_n_steps": log_every,
        "val_check_interval": steps,
        "check_val_every_n_epoch": None,
        "limit_val_batches": 1,
        "num_sanity_val_steps": 0,
        "deterministic": "warn",  # deterministic kernels where torch has them; the others warn (recorded)
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(out), "name": "", "version": ""},
        },
        "callbacks": callbacks,
    }
    if strategy is not None:
        trainer["strategy"] = strategy
    config = {
        "seed_everything": 0,
        "model": {
            "model": "custom",
            "depth": s["depth"],
            "hidden_size": s["hidden_size"],
            "num_heads": s["num_heads"],
            "patch_size": 2,
            "activation_checkpointing": checkpointing,
            "compile": compile,
            "tf32": tf32,
            "ema_decay": 0.999,
            "ema_warmup": True,
            "sample_steps": 10,
        },
        "data": {
            "path": str(ctx.store),
            "global_batch_size": s["batch"],
            "val_size": 64,
            "num_workers": 0,
            "random_flip": False,
        },
        "trainer": trainer,
        "checkpoint": {"dirpath": str(out / "ckpt"), "every_n_train_steps": every, "save_top_k": -1, "save_last": True},
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(json.dumps(config, indent=1))
    return path


def fit(ctx: Context, config: Path, log: Path, ckpt_path: Optional[Path] = None, ranks: int = 1) -> Proc:
    """``dit-lightning fit --config CONFIG`` (as ``python -m dit_lightning.cli``, the same entry point);
    with ``ranks=2``, two processes that Lightning sees as two nodes of one device each (both on
    cuda:0, or the CPU), joined through MASTER_ADDR/MASTER_PORT."""
    cmd = [ctx.python, "-m", "dit_lightning.cli", "fit", "--config", str(config)]
    if ckpt_path is not None:
        cmd += ["--ckpt_path", str(ckpt_path)]
    if ranks == 1:
        return run(ctx, cmd, log)
    port = free_port()
    envs = [
        {**ctx.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(ranks)}
        | {"NODE_RANK": str(r), "LOCAL_RANK": "0"}
        for r in range(ranks)
    ]
    results: list[Proc] = [Proc(None, 0.0, log)] * ranks

    def rank(r: int) -> None:
        results[r] = run(ctx, cmd, log if r == 0 else log.with_suffix(f".rank{r}.log"), env=envs[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = next((p for p in results if not p.ok), None)
    return bad or results[0]


def facts(out: Path, rank: int = 0) -> dict[str, Any]:
    try:
        return json.loads((out / f"facts_rank{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def metrics(out: Path) -> dict[str, dict[int, str]]:
    """Logged step metrics by name, as the CSV strings (equal strings = equal floats)."""
    result: dict[str, dict[int, str]] = {}
    path = out / "metrics.csv"
    if not path.exists():
        return result
    with open(path) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("step", "epoch") and value not in ("", None):
                    result.setdefault(key, {})[int(row["step"])] = value
    return result


def step_checkpoint(out: Path, step: int) -> Optional[Path]:
    """The checkpoint a run saved at ``step`` (``every_n_train_steps`` divides the run's steps)."""
    hits = sorted((out / "ckpt").glob(f"*step={step}.ckpt")) + sorted((out / "ckpt").glob(f"*step={step}-*.ckpt"))
    return hits[0] if hits else None


def final_checkpoint(out: Path, step: int) -> Path:
    path = step_checkpoint(out, step)
    if path is None:
        raise FileNotFoundError(f"no checkpoint of step {step} in {out / 'ckpt'}")
    return path


def weights(path: Path) -> dict[str, Any]:
    from dit_lightning.checkpoints import read_checkpoint

    ck = read_checkpoint(path, tmp_dir=tempfile.gettempdir())
    state = {f"model.{k}": v for k, v in ck.model.items()}
    state.update({f"ema.{k}": v for k, v in (ck.ema or {}).items()})
    return {"state": state, "step": ck.meta.get("global_step")}


def compare(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, float]:
    """(bit-identical, max absolute difference) of two weight sets with the same keys."""
    import torch

    if a.keys() != b.keys():
        return False, math.inf
    same, worst = True, 0.0
    for k in a:
        x, y = a[k].float(), b[k].float()
        if x.shape != y.shape:
            return False, math.inf
        if not torch.equal(a[k], b[k]):
            same = False
            worst = max(worst, (x - y).abs().max().item())
    return same, worst


def moved_ratio(final: dict[str, Any], other: dict[str, Any], start: dict[str, Any]) -> float:
    """||final - other|| / ||final - start|| over the trained weights: the disagreement relative to
    how far training moved the weights after the resume point."""
    import torch

    keys = [k for k in final if k.startswith("model.") and final[k].is_floating_point()]
    diff = torch.sqrt(sum(((final[k].float() - other[k].float()) ** 2).sum() for k in keys))
    moved = torch.sqrt(sum(((final[k].float() - start[k].float()) ** 2).sum() for k in keys))
    return float(diff / moved) if moved > 0 else math.inf


RESUME_TOLERANCE = 0.05  # of the distance moved after the resume point, where a kernel is nondeterministic
EQUIVALENCE_ATOL = 1e-5  # float32 reduction-order differences over a few steps (cf. tests/distributed)


def nondeterministic(*dirs: Path) -> list[str]:
    found: list[str] = []
    for d in dirs:
        found += facts(d).get("nondeterministic_kernels", [])
        for log in d.glob("*.log"):
            for line in log.read_text(errors="replace").splitlines():
                if "does not have a deterministic implementation" in line:
                    found.append(line.strip()[:200])
    return sorted(set(found))


def check_resume(ctx: Context, stage: str, name: str, full: Path, resumed: Path, every: int, steps: int) -> None:
    """The resumed run against the uninterrupted one: the first loss after the resume point is
    bit-identical (the forward kernels are deterministic and the state was restored exactly); the
    final weights are bit-identical unless a kernel warned that it is nondeterministic, then within
    RESUME_TOLERANCE of the distance the weights moved after the resume point."""
    try:
        a, b = metrics(full).get("train/loss", {}), metrics(resumed).get("train/loss", {})
        after = sorted(s for s in b if s >= every)
        if not after:
            ctx.add(stage, f"{name}: resumed losses", "fail", "no loss logged after the resume point")
            return
        first_same = a.get(after[0]) == b[after[0]]
        all_same = all(a.get(s) == b[s] for s in after)
        ctx.add(
            stage,
            f"{name}: first loss after resuming at step {every}",
            "pass" if first_same else "fail",
            f"{b[after[0]]} vs {a.get(after[0])}",
            "bit-identical",
        )
        final_a, final_b = weights(final_checkpoint(full, steps)), weights(final_checkpoint(resumed, steps))
        same, worst = compare(final_a["state"], final_b["state"])
        kernels = nondeterministic(full, resumed)
        if same:
            ctx.add(stage, f"{name}: resumed = uninterrupted", "pass", "bit-identical weights (model + EMA)", "")
            return
        if not kernels:
            ctx.add(
                stage,
                f"{name}: resumed = uninterrupted",
                "fail",
                f"max |dw| {worst:.3g}; losses {'equal' if all_same else 'differ'}",
                "bit-identical (no kernel reported nondeterminism)",
            )
            return
        start = weights(final_checkpoint(full, every))
        ratio = moved_ratio(final_a["state"], final_b["state"], start["state"])
        ctx.add(
            stage,
            f"{name}: resumed ~ uninterrupted",
            "pass" if ratio <= RESUME_TOLERANCE else "fail",
            f"{ratio:.2%} of the distance moved since step {every} (max |dw| {worst:.3g})",
            f"<= {RESUME_TOLERANCE:.0%} (nondeterministic: {'; '.join(kernels)[:300]})",
        )
    except Exception as e:  # a missing checkpoint is a finding, not a crash of the check
        ctx.add(stage, f"{name}: resume comparison", "fail", f"{type(e).__name__}: {e}"[:300])


# ---- stages -----------------------------------------------------------------------------------
def stage_gpu_tests(ctx: Context) -> None:
    files = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text()
    )
    if not files:
        ctx.add("gpu-tests", "gpu-marked tests found", "fail", "none", "the CUDA-only tests of tests/")
        return
    junit = ctx.work / "gpu-tests.xml"
    cmd = [ctx.python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu", "-rA"]
    if ctx.dry:  # the tests' names only (they are imported, and skip, in the ordinary test run)
        ids = [f"{f}::{name}" for f in files for name in gpu_marked_tests(ROOT / f)]
        ctx.add("gpu-tests", "gpu-marked tests found", "pass" if ids else "fail", len(ids), "> 0", ", ".join(files))
        for node in ids:
            ctx.add("gpu-tests", node, "skipped: needs CUDA")
        return
    env = {**ctx.env, "DIT_REQUIRE_GPU": "1"}
    proc = run(ctx, cmd + ["--junitxml", str(junit), *files], ctx.work / "gpu-tests.log", env=env)
    cases = parse_junit(junit) or parse_verbose(proc.tail(400000))  # the log has the tests finished before a cut
    for node, status, message in cases:
        ctx.add("gpu-tests", node, status, message[:200] if status != "pass" else "")
    if proc.timed_out:
        ctx.add("gpu-tests", "pytest -m gpu", "cut: stage budget", proc.error_line())
    elif not cases or not proc.ok:
        ctx.add("gpu-tests", "pytest -m gpu", "fail" if not proc.ok else "pass", proc.error_line(), "exit 0")


def gpu_marked_tests(path: Path) -> list[str]:
    """Names of the test functions of a file decorated with ``pytest.mark.gpu``."""
    import ast

    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            marks = [ast.unparse(d) for d in node.decorator_list]
            if any(m == "pytest.mark.gpu" or m.startswith("pytest.mark.gpu(") for m in marks):
                names.append(node.name)
    return names


def parse_verbose(log: str) -> list[tuple[str, str, str]]:
    """(test, status, message) from ``pytest -v`` lines (``tests/x.py::test_y PASSED [ 50%]``)."""
    out = []
    for m in re.finditer(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", log, re.M):
        out.append((m.group(1), "pass" if m.group(2) == "PASSED" else "fail", m.group(2)))
    return out


def parse_junit(path: Path) -> list[tuple[str, str, str]]:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    out = []
    for case in root.iter("testcase"):
        node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        status, message = "pass", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                status = "fail"  # under DIT_REQUIRE_GPU=1 a skip is a failure too
                message = f"{tag}: {el.get('message', '')}"
        out.append((node, status, message))
    return out


def stage_fit(ctx: Context) -> None:
    s = sizes(ctx)
    specs = sorted((f for f in FITS if f.dry or not ctx.dry), key=lambda f: f.compile == "none")  # longest first
    for spec in FITS:
        if spec not in specs:
            ctx.add("fit", spec.name, "skipped: not in the dry run (the GPU run trains it)")

    def job(spec: FitSpec) -> None:
        if spec.cuda_only and ctx.dry:
            ctx.add("fit", spec.name, "skipped: needs CUDA (16-mixed with GradScaler)")
            return
        full, resumed = ctx.work / "fit" / spec.name, ctx.work / "fit" / f"{spec.name}.resumed"
        config = fit_config(
            ctx, full, spec.precision, s["steps"], s["every"], checkpointing=spec.checkpointing, compile=spec.compile
        )
        proc = fit(ctx, config, full / "fit.log")
        if not proc.ok:
            status = "cut: stage budget" if proc.timed_out else "fail"
            ctx.add("fit", f"{spec.name}: fit", status, proc.error_line(), f"{s['steps']} steps")
            return
        check_fit(ctx, spec, full, proc.seconds)
        if ctx.dry and spec.compile != "none":  # saves a second CPU compilation (~15 s)
            ctx.add("fit", f"{spec.name}: resume", "skipped: dry run (the resume path is that of the other runs)")
            return
        start = step_checkpoint(full, s["every"])
        if start is None:
            ctx.add("fit", f"{spec.name}: checkpoint at step {s['every']}", "fail", "not written")
            return
        rconfig = fit_config(
            ctx, resumed, spec.precision, s["steps"], s["every"], checkpointing=spec.checkpointing, compile=spec.compile
        )
        rproc = fit(ctx, rconfig, resumed / "fit.log", ckpt_path=start)
        if not rproc.ok:
            status = "cut: stage budget" if rproc.timed_out else "fail"
            ctx.add("fit", f"{spec.name}: resumed fit", status, rproc.error_line())
            return
        check_resume(ctx, "fit", spec.name, full, resumed, s["every"], s["steps"])

    jobs = [functools.partial(job, spec) for spec in specs] + [functools.partial(sync_audit, ctx)]
    parallel(jobs, workers=2 if ctx.dry else len(jobs))


def sync_audit(ctx: Context) -> None:
    """CUDA's sync-debug mode over a bf16 fit logged every 10 steps: the package may synchronise the
    host with the device only at the logged steps (the non-finite check, the monitors), never on the
    hot path between them (issue 24)."""
    name = "host syncs (sync-debug mode)"
    if ctx.dry:
        ctx.add("fit", name, "skipped: needs CUDA (torch.cuda.set_sync_debug_mode)")
        return
    out = ctx.work / "fit" / "sync-audit"
    config = fit_config(ctx, out, "bf16-mixed", 30, 30, log_every=10, sync_audit=True)
    proc = fit(ctx, config, out / "fit.log")
    if not proc.ok:
        ctx.add("fit", name, "cut: stage budget" if proc.timed_out else "fail", proc.error_line())
        return
    report = facts(out).get("host_syncs") or {}
    if not report:
        ctx.add("fit", name, "fail", "no sync report written")
        return
    quiet = report.get("package_outside_logged_steps") or {}
    ours = sum((report.get("package") or {}).values())
    measured = (
        f"{report.get('total')} syncs in {report.get('steps')} steps: {ours} by dit_lightning (at logged steps), "
        f"{report.get('total', 0) - ours} by torch/Lightning; top: {json.dumps(report.get('others'))[:300]}"
    )
    detail = f"package syncs outside logged steps: {json.dumps(quiet)[:500]}" if quiet else ""
    ctx.add("fit", name, "fail" if quiet else "pass", measured, "none by dit_lightning between logged steps", detail)


def expected_peak(ctx: Context, dtype: str, tf32: bool) -> Optional[float]:
    from dit_lightning.planner.hardware import peak_flops_for
    from dit_lightning.precision import to_dtype

    return None if ctx.dry else peak_flops_for(ctx.device_name, to_dtype(dtype), tf32=tf32)


def check_fit(ctx: Context, spec: FitSpec, out: Path, seconds: float) -> None:
    f, m = facts(out), metrics(out)
    s = sizes(ctx)
    losses = [float(v) for v in m.get("train/loss", {}).values()]
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    ctx.add(
        "fit",
        f"{spec.name}: {s['steps']} steps, loss finite",
        "pass" if finite and f.get("global_step") == s["steps"] else "fail",
        f"step {f.get('global_step')}, loss {losses[0]:.4f} -> {losses[-1]:.4f} ({seconds:.0f} s)"
        if losses
        else "no loss logged",
    )
    want_dtype = {"32-true": "float32", "bf16-mixed": "bfloat16", "16-mixed": "float16"}[spec.precision]
    ctx.add("fit", f"{spec.name}: compute dtype", "pass" if f.get("compute_dtype") == want_dtype else "fail",
            f.get("compute_dtype"), want_dtype)  # fmt: skip
    if spec.precision == "16-mixed":
        scales = [float(v) for v in m.get("train/loss_scale", {}).values()]
        ok = bool(f.get("grad_scaler")) and bool(scales) and all(math.isfinite(x) and x > 0 for x in scales)
        ctx.add(
            "fit",
            f"{spec.name}: GradScaler active, scale logged",
            "pass" if ok else "fail",
            f"scale {scales[0]:g} -> {scales[-1]:g} ({len(scales)} logged)" if scales else "train/loss_scale missing",
            "train/loss_scale > 0 at every step",
        )
    fused_expected = not ctx.dry  # the module fuses AdamW on CUDA when nothing forbids it
    ctx.add(
        "fit",
        f"{spec.name}: fused AdamW",
        "pass" if bool(f.get("fused")) == fused_expected else "fail",
        f.get("fused"),
        "fused on CUDA" if fused_expected else "foreach on CPU (the module fuses on CUDA only)",
    )
    want_blocks = {"none": 0, "half": s["depth"] // 2, "all": s["depth"]}[spec.checkpointing]
    ctx.add("fit", f"{spec.name}: checkpointed blocks", "pass" if f.get("checkpoint_blocks") == want_blocks else "fail",
            f.get("checkpoint_blocks"), want_blocks)  # fmt: skip
    if spec.compile != "none":
        ctx.add("fit", f"{spec.name}: compiled", "pass" if f.get("compiled") else "fail", f.get("compiled"), True)
    peak = expected_peak(ctx, want_dtype, tf32=bool(f.get("tf32")))
    mfu = (f.get("throughput") or {}).get("mfu")
    if ctx.dry:
        ctx.add("fit", f"{spec.name}: MFU", "skipped: no peak FLOP/s on CPU")
    else:
        ok = peak is not None and f.get("peak_flops") == peak and mfu is not None and 0 < mfu <= 1
        ctx.add(
            "fit",
            f"{spec.name}: MFU against the {want_dtype} peak",
            "pass" if ok else "fail",
            f"MFU {mfu:.2%} of {f.get('peak_flops', 0) / 1e12:.0f} TFLOP/s" if mfu else f"peak {f.get('peak_flops')}",
            f"peak {peak / 1e12:.0f} TFLOP/s" if peak else "a tabled peak for this GPU",
        )


def stage_distributed(ctx: Context) -> None:
    s = sizes(ctx)
    steps, every = s["dist_steps"], s["dist_every"]
    base = ctx.work / "distributed"
    # Lightning's default backend (NCCL on CUDA, gloo on CPU) in one process; gloo for two processes on one
    # device (NCCL refuses two ranks on one GPU)
    gloo = {"process_group_backend": "gloo"}
    fsdp1 = {"class_path": "dit_lightning.distributed.DiTFSDPStrategy", "init_args": {"state_dict_type": "sharded"}}
    fsdp2 = {"class_path": "dit_lightning.distributed.DiTFSDP2Strategy", "init_args": {}}
    fsdp2_gloo = {"class_path": "dit_lightning.distributed.DiTFSDP2Strategy", "init_args": dict(gloo)}
    fsdp2_bf16 = {
        "class_path": "dit_lightning.distributed.DiTFSDP2Strategy",
        "init_args": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
    }
    ddp = {"class_path": "dit_lightning.distributed.DiTDDPStrategy", "init_args": dict(gloo)}
    runs = {  # name: (strategy, processes, CUDA only, in the dry run)
        "single": (None, 1, False, True),
        "fsdp1": (fsdp1, 1, True, True),
        "fsdp2": (fsdp2, 1, False, True),
        "fsdp2-bf16": (fsdp2_bf16, 1, False, False),
        "ddp-2proc": (ddp, 2, False, False),  # dry run: the 2-process launch is exercised by fsdp2-2proc
        "fsdp2-2proc": (fsdp2_gloo, 2, False, True),
    }
    procs: dict[str, Proc] = {}

    def job(name: str) -> None:
        strategy, ranks, cuda_only, in_dry_run = runs[name]
        if cuda_only and ctx.dry:
            ctx.add("distributed", name, "skipped: needs CUDA (Lightning 2.6's FSDPStrategy is GPU only)")
            return
        if ctx.dry and not in_dry_run:
            ctx.add("distributed", name, "skipped: not in the dry run (the GPU run trains it)")
            return
        if name == "fsdp2-2proc" and not ctx.dry:
            # Two ranks on one GPU need gloo (NCCL refuses them), and torch 2.11 cannot build a CUDA
            # DeviceMesh over a gloo group (it deep-copies gloo's options: "cannot pickle ... _Options",
            # seen on an H200, 2026-12-04); the dry run trains it on the CPU, a 2-GPU machine over NCCL
            ctx.add("distributed", name, "skipped: needs 2 GPUs (FSDP2's CUDA mesh refuses gloo, NCCL two ranks)")
            return
        config = fit_config(ctx, base / name, "32-true", steps, every, tf32=False, strategy=strategy, num_nodes=ranks)
        procs[name] = fit(ctx, config, base / name / "fit.log", ranks=ranks)
        if name in ("fsdp1", "fsdp2") and procs[name].ok:
            start = step_checkpoint(base / name, every)
            rconfig = fit_config(ctx, base / f"{name}.resumed", "32-true", steps, every, tf32=False, strategy=strategy)
            procs[f"{name}.resumed"] = fit(ctx, rconfig, base / f"{name}.resumed" / "fit.log", ckpt_path=start)

    order = sorted(runs, key=lambda n: runs[n][1] == 1)  # the 2-process runs first: they take longest
    parallel([functools.partial(job, n) for n in order], workers=2 if ctx.dry else len(runs))
    ref, single = base / "single", procs.get("single")
    ref_w = None
    if single is not None and single.ok:
        ref_w = weights(final_checkpoint(ref, steps))["state"]
    else:
        ctx.add("distributed", "single-process reference", "fail", single.error_line() if single else "not run")
    for name, (_, ranks, _, _) in runs.items():
        if name == "single" or name not in procs:
            continue
        proc, out = procs[name], base / name
        if not proc.ok:
            hint = " (NCCL refuses two ranks on one GPU; these use gloo)" if ranks > 1 and not ctx.dry else ""
            status = "cut: stage budget" if proc.timed_out else "fail"
            ctx.add("distributed", f"{name}: fit", status, proc.error_line() + hint)
            continue
        f = facts(out)
        wrapped = f.get("fsdp1_units", 0) > 0 if name == "fsdp1" else f.get("fsdp2") if "fsdp2" in name else True
        detail = f"strategy {f.get('strategy')}, world size {f.get('world_size')}"
        if name == "fsdp1":
            detail += f", {f.get('fsdp1_units')} FSDP units, {f.get('sharding_strategy')}"
        ctx.add(
            "distributed",
            f"{name}: wrapped, world size {ranks}",
            "pass" if wrapped and f.get("world_size") == ranks else "fail",
            detail,
        )
        if name == "fsdp2-bf16":
            peak = expected_peak(ctx, "bf16-mixed", tf32=False)
            ok = f.get("compute_dtype") == "bfloat16" and (ctx.dry or f.get("peak_flops") == peak)
            ctx.add(
                "distributed",
                "fsdp2-bf16: MFU peak from param_dtype (precision 32-true)",
                "pass" if ok else "fail",
                f"compute {f.get('compute_dtype')}, peak {f.get('peak_flops')}",
                f"bfloat16, peak {peak}" if not ctx.dry else "bfloat16",
            )
            continue
        if ref_w is not None:
            try:
                same, worst = compare(weights(final_checkpoint(out, steps))["state"], ref_w)
                ctx.add(
                    "distributed",
                    f"{name} = one process",
                    "pass" if worst <= EQUIVALENCE_ATOL else "fail",
                    "bit-identical" if same else f"max |dw| {worst:.2g}",
                    f"<= {EQUIVALENCE_ATOL:g} (fp32 reduction order)",
                )
            except Exception as e:
                ctx.add("distributed", f"{name} = one process", "fail", f"{type(e).__name__}: {e}"[:300])
        resumed = procs.get(f"{name}.resumed")
        if resumed is not None:
            if resumed.ok:
                check_resume(ctx, "distributed", name, out, base / f"{name}.resumed", every, steps)
            else:
                # cut by the stage's budget on a busy machine is a cut, as in the fit stage: not a failure
                status = "cut: stage budget" if resumed.timed_out else "fail"
                ctx.add("distributed", f"{name}: resumed fit", status, resumed.error_line())


BENCH_GRID = [
    "fp32",
    "tf32",
    "16-mixed",
    "bf16-mixed",
    "bf16+ckpt-half",
    "bf16+ckpt-all",
    "bf16+fused-adamw",
    "bf16+flash",
    "bf16+math",
    "bf16+compile",
]


def stage_bench(ctx: Context) -> None:
    grid = [c for c in BENCH_GRID if not (ctx.dry and c == "bf16+compile")]
    if ctx.dry:
        ctx.add("bench", "bf16+compile", "skipped: dry run (compile is covered by the fit stage)")
        size = ["--device", "cpu", "--model", "custom", "--depth", "2", "--hidden-size", "64", "--num-heads", "4"]
        size += ["--patch-size", "2", "--latent-size", "8", "--num-classes", "10", "--batch", "8", "--steps", "2"]
        size += ["--warmup", "1", "--threads", "1"]
    else:
        size = ["--device", "cuda", "--model", "DiT-XL/2", "--latent-size", "32", "--batch", "64", "--steps", "5"]
        size += ["--warmup", "2"]
    cmd = [ctx.python, str(BENCH / "bench_optimizations.py"), *size, "--max-seconds", "6"]
    cmd += ["--configs", ",".join(grid), "--name", ctx.slug, "--out", str(ctx.out)]
    proc = run(ctx, cmd, ctx.work / "bench.log")
    stem = ctx.out / f"optimizations_{'cpu' if ctx.dry else 'cuda'}_{ctx.slug}"
    rows = read_csv(stem.with_suffix(".csv"))
    ctx.files += [str(stem.with_suffix(x)) for x in (".md", ".csv", ".png") if stem.with_suffix(x).exists()]
    done = {r["config"] for r in rows}
    for r in rows:
        if r["status"] != "ok":
            status = "skipped: " + r["status"] if r["status"].startswith("n/a") else "fail"
            ctx.add("bench", r["config"], status, r["status"])
            continue
        peak, pred = float(r["peak_bytes"]), float(r["planner_bytes"] or "nan")
        ratio = pred / peak if peak else math.nan
        mfu = f", MFU {float(r['mfu']):.1%}" if r.get("mfu") else ""
        within = "compile" in r["config"] or (math.isfinite(ratio) and 0.8 <= ratio <= 1.2)
        ctx.add(
            "bench",
            r["config"],
            "pass" if within else "fail",
            f"{float(r['images_per_s']):.1f} img/s, peak {peak / 2**20:,.0f} MiB, planner x{ratio:.2f}{mfu}",
            "planner within 20% of the measured peak" + (" (eager prediction)" if "compile" in r["config"] else ""),
        )
    for name in grid:
        if name not in done:
            status = "cut: stage budget" if proc.timed_out else "fail"
            ctx.add("bench", name, status, proc.error_line() if not proc.ok else "no row written")
    ctx.claims = claims(rows, ctx)


def read_csv(path: Path) -> list[dict[str, str]]:
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def claims(rows: list[dict[str, str]], ctx: Context) -> list[dict[str, str]]:
    ok = {r["config"]: r for r in rows if r["status"] == "ok"}
    out = []
    for claim, config, baseline, metric, low, high in CLAIMS:
        a, b = ok.get(config), ok.get(baseline)
        entry = {"claim": claim, "measured as": f"{config} vs {baseline}", "claimed": "", "measured": "-"}
        entry["claimed"] = f"{low:+.0%}..{high:+.0%}" if metric != "speed" else f"{low:+.0%}..{high:+.0%} img/s"
        if metric == "time":
            entry["claimed"] = f"{low:+.0%}..{high:+.0%} step time"
        if a and b:
            if metric == "memory":
                value = float(a["peak_bytes"]) / float(b["peak_bytes"]) - 1
            elif metric == "speed":
                value = float(a["images_per_s"]) / float(b["images_per_s"]) - 1
            else:
                value = float(b["images_per_s"]) / float(a["images_per_s"]) - 1
            better = value < low if metric in ("memory",) else value > high if metric == "speed" else value < low
            verdict = "holds" if low <= value <= high else ("better than claimed" if better else "worse than claimed")
            entry["measured"] = f"{value:+.0%}"
            entry["verdict"] = verdict + (" (CPU, tiny model: not evidence for a GPU)" if ctx.dry else "")
        else:
            entry["verdict"] = "not measured (row missing: cut, failed or n/a here)"
        out.append(entry)
    return out


def stage_sampling(ctx: Context) -> None:
    if ctx.dry:
        size = ["--device", "cpu", "--model", "DiT-S/8", "--latent-size", "8", "--depth", "2", "--hidden-size", "64"]
        size += ["--num-heads", "4", "--num-classes", "10", "--num-samples", "2", "--batch-size", "2", "--threads", "1"]
    else:
        size = ["--device", "cuda", "--model", "DiT-XL/2", "--latent-size", "32", "--num-samples", "16"]
        size += ["--batch-size", "16"]
    cmd = [ctx.python, str(BENCH / "bench_sampling.py"), *size, "--precision", "fp32,bf16", "--repeats", "1"]
    cmd += ["--no-reference-loop", "--cfg-scale", "1.5", "--name", ctx.slug, "--output-dir", str(ctx.out)]
    proc = run(ctx, cmd, ctx.work / "sampling.log")
    stem = ctx.out / f"sampling_{ctx.slug}"
    rows = read_csv(stem.with_suffix(".csv"))
    if not proc.ok or not rows:
        ctx.add("sampling", "DDPM-250 vs DDIM-50", "cut: stage budget" if proc.timed_out else "fail", proc.error_line())
        return
    ctx.files += [str(stem.with_suffix(x)) for x in (".md", ".csv")]
    for prec in ("fp32", "bf16"):
        ddpm = next((r for r in rows if r["precision"] == prec and r["sampler"].startswith("DDPM")), None)
        ddim = next((r for r in rows if r["precision"] == prec and r["sampler"].startswith("DDIM")), None)
        if not ddpm or not ddim:
            ctx.add("sampling", f"{prec}: DDPM-250 vs DDIM-50", "fail", "rows missing")
            continue
        speedup = float(ddim["images_per_s"]) / float(ddpm["images_per_s"])
        ctx.add(
            "sampling",
            f"{prec}: DDPM-250 vs DDIM-50 with CFG",
            "pass" if speedup > 1 else "fail",
            f"{float(ddpm['images_per_s']):.3g} vs {float(ddim['images_per_s']):.3g} img/s (DDIM x{speedup:.1f})",
            "DDIM faster (50 vs 250 model calls)",
        )


STAGES: list[tuple[str, str, Callable[[Context], None]]] = [
    ("gpu-tests", "gpu-marked tests (a skip fails)", stage_gpu_tests),
    ("fit", "dit-lightning fit: precisions, checkpointing, fused AdamW, compile, resume", stage_fit),
    ("distributed", "FSDP1 / FSDP2 at world size 1; DDP / FSDP2 with 2 processes on one device", stage_distributed),
    ("bench", "optimisation grid (memory vs planner, images/s, MFU)", stage_bench),
    ("sampling", "DDPM-250 vs DDIM-50 with CFG, fp32 and bf16", stage_sampling),
]


# ---- environment and report --------------------------------------------------------------------
def describe_environment(ctx: Context) -> None:
    import lightning
    import torch

    from dit_lightning.planner.hardware import device_key

    env = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": f"{platform.python_version()} ({ctx.python})",
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "host": f"{platform.machine()}, {os.cpu_count()} CPU cores",
    }
    if torch.cuda.is_available() and not ctx.dry:
        ctx.device_name = torch.cuda.get_device_name(0)
        props = torch.cuda.get_device_properties(0)
        env["device"] = f"{ctx.device_name} ({props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor})"
        env["driver"] = nvidia_smi("driver_version")
        env["cuda"] = f"{torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
        key = device_key(ctx.device_name)
        ctx.slug = key or re.sub(r"[^a-z0-9]+", "-", ctx.device_name.lower()).strip("-")
    else:
        env["device"] = f"CPU ({platform.processor() or platform.machine()})" if ctx.dry else "no CUDA device"
        ctx.slug = "dry-run-cpu" if ctx.dry else "no-gpu"
    pins = re.findall(r'"(torch|lightning)[=<>]=?([^"]*)"', (ROOT / "pyproject.toml").read_text())
    env["pinned"] = ", ".join(f"{n}{v}" for n, v in pins)
    ctx.environment = env


def nvidia_smi(query: str) -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def _md_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    def cell(x: Any) -> str:
        return str(x).replace("|", "/").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]


def summary_tables(ctx: Context) -> tuple[list[str], list[str]]:
    stages = _md_table(
        ["stage", "status", "seconds", "budget", "checks passed", "failed", "skipped / cut", "note"],
        [
            [
                st.name,
                st.status,
                f"{st.seconds:.0f}",
                f"{st.budget_s:.0f}",
                sum(c.status == "pass" for c in ctx.checks if c.stage == st.name),
                sum(c.status == "fail" for c in ctx.checks if c.stage == st.name),
                sum(c.status.startswith(("skipped", "cut")) for c in ctx.checks if c.stage == st.name),
                st.note,
            ]
            for st in ctx.stages
        ],
    )
    claim_rows = [[c["claim"], c["measured as"], c["claimed"], c["measured"], c["verdict"]] for c in ctx.claims]
    claims_md = _md_table(["seed's claim", "measured as", "claimed", "measured", "verdict"], claim_rows)
    return stages, claims_md


def write_report(ctx: Context, final: bool) -> Path:
    stem = ctx.out / f"gpu_check_{ctx.slug}"
    stages, claims_md = summary_tables(ctx)
    mode = "dry run (CPU, tiny sizes)" if ctx.dry else "GPU"
    lines = [
        f"# GPU check: {ctx.environment.get('device', '?')}" + (" (dry run)" if ctx.dry else ""),
        "",
        *(f"- {k}: {v}" for k, v in ctx.environment.items()),
        f"- mode: {mode}; total budget {ctx.deadline - ctx.start:.0f} s, elapsed {time.monotonic() - ctx.start:.0f} s",
        f"- command: `{ctx.args.command_line}`",
        "",
    ]
    if not final:
        lines += [
            "**Partial: the check is still running or was stopped; stages below without a status did not run.**",
            "",
        ]
    lines += ["## Stages", "", *stages, "", "## The seed's claims beside the measured figures", "", *claims_md, ""]
    lines += [
        "Memory is the peak `torch.cuda.max_memory_allocated` of one training step (on CPU: the allocator's peak); "
        "speed is images/s at the same micro-batch; step time = 1 / images/s. Rows come from the `bench` stage.",
        "",
        "## Checks",
        "",
        *_md_table(
            ["stage", "check", "status", "measured", "expected", "detail"],
            [[c.stage, c.name, c.status, c.measured, c.expected, c.detail] for c in ctx.checks],
        ),
        "",
        "## Tolerances",
        "",
        "- Resume: every run uses `Trainer(deterministic='warn')` (deterministic kernels where torch has them, "
        "`CUBLAS_WORKSPACE_CONFIG=:4096:8`). The first loss after the resume point must be bit-identical (the forward "
        "kernels are deterministic and the restored state is exact). The final weights (model and EMA) must be "
        "bit-identical unless a kernel warned that it has no deterministic implementation (named in the check); then "
        "the disagreement must stay within "
        f"{RESUME_TOLERANCE:.0%} of the distance the weights moved after the resume point (atomic-add ordering noise "
        "grows with training but stays far below the update itself; a broken resume differs by ~100%).",
        f"- One process vs FSDP/DDP: max |dw| <= {EQUIVALENCE_ATOL:g} after a few fp32 steps with TF32 off (the sum "
        "over ranks changes the reduction order only).",
        "- Bench: the planner's peak within 20% of the measured one (compile rows: eager prediction, not checked).",
        "",
    ]
    if ctx.files:
        lines += ["Tables written by the stages: " + ", ".join(f"`{Path(f).name}`" for f in ctx.files), ""]
    _write_text(stem.with_suffix(".md"), "\n".join(lines))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(asdict(Check("", "", ""))))
    writer.writeheader()
    for st in ctx.stages:
        writer.writerow(asdict(Check(st.name, "stage", st.status, f"{st.seconds:.1f} s", f"<= {st.budget_s:.0f} s")))
    for c in ctx.checks:
        writer.writerow(asdict(c))
    for claim in ctx.claims:
        row = Check("summary", claim["claim"], claim.get("verdict", ""), claim["measured"], claim["claimed"])
        writer.writerow(asdict(row))
    _write_text(stem.with_suffix(".csv"), buf.getvalue())
    return stem


def _write_text(path: Path, text: str) -> None:
    try:
        from dit_lightning.atomic import write_text
    except ImportError:  # before the install: a plain temporary-and-rename
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, text)


def print_summary(ctx: Context, stem: Path) -> None:
    stages, claims_md = summary_tables(ctx)
    print("\n== GPU check summary" + (" (dry run)" if ctx.dry else "") + f": {ctx.environment.get('device')}")
    print("\n".join(stages))
    print("\n== The seed's claims beside the measured figures")
    print("\n".join(claims_md))
    failed = [c for c in ctx.checks if c.status == "fail"]
    if failed:
        print(f"\n{len(failed)} check(s) failed:")
        for c in failed:
            print(f"  {c.stage}: {c.name}: {c.measured}")
    print(f"\nwrote {stem}.md and {stem}.csv ({time.monotonic() - ctx.start:.0f} s)")


# ---- main -------------------------------------------------------------------------------------
def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (< 3 minutes)")
    p.add_argument("--out", default=None, help="tables (default docs/benchmarks; dry run: outputs/gpu-check-dry)")
    p.add_argument("--work", default=None, help="checkpoints and logs (default outputs/gpu-check/<mode>)")
    p.add_argument("--budget", type=float, default=None, help="seconds for everything (default 480; dry run 175)")
    p.add_argument("--stages", default=",".join(n for n, _, _ in STAGES), help="comma-separated subset of the stages")
    p.add_argument("--python", default=None, help="interpreter with the dependencies (default: found or installed)")
    p.add_argument("--_started", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_install", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.stages.split(",")) - {n for n, _, _ in STAGES}
    if unknown:
        p.error(f"unknown stages {sorted(unknown)}: choose from {', '.join(n for n, _, _ in STAGES)}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    given = list(sys.argv[1:] if argv is None else argv)
    internal = {i for i, a in enumerate(given) if a.startswith("--_")}  # the re-run's own flags and values
    internal |= {i + 1 for i in internal} | {i for i, a in enumerate(given) if a == "--python" and args._install}
    internal |= {i + 1 for i, a in enumerate(given) if a == "--python" and args._install}
    args.command_line = "python benchmarks/gpu_check.py " + " ".join(
        shlex.quote(a) for i, a in enumerate(given) if i not in internal
    )
    started_wall = args._started or time.time()
    dry = args.dry_run
    budget = args.budget or TOTAL_BUDGET["dry" if dry else "gpu"]
    if args._install is None:  # the install stage, then the check under the interpreter it found
        t0 = time.monotonic()
        try:
            python, env, how = install(args, started_wall)
        except (SystemExit, subprocess.SubprocessError, OSError) as e:
            print(f"gpu-check: install failed: {e}", file=sys.stderr)
            return 2
        info = json.dumps({"how": how, "seconds": time.monotonic() - t0})
        cmd = [python, str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv)]
        cmd += ["--_started", str(started_wall), "--_install", info, "--python", python]
        if python != sys.executable or str(SITE) in env.get("PYTHONPATH", ""):
            return subprocess.run(cmd, env=env, cwd=ROOT).returncode
        args._install, args.python = info, python
    for path in (str(BENCH), str(ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)
    install_info = json.loads(args._install)
    start = time.monotonic() - (time.time() - started_wall)
    out = Path(args.out or (ROOT / ("outputs/gpu-check-dry" if dry else "docs/benchmarks")))
    work = Path(args.work or (ROOT / "outputs" / "gpu-check" / ("dry-run" if dry else "gpu")))
    ctx = Context(
        args, dry, start, start + budget, out.resolve(), work.resolve(), args.python or sys.executable, base_env()
    )
    ctx.env["OMP_NUM_THREADS"] = "1" if dry else "2"  # parallel runs share the cores
    install_stage = Stage("install", "dependencies", BUDGETS["install"][1 if dry else 0], "ok", install_info["seconds"])
    install_stage.note = install_info["how"]
    ctx.stages.append(install_stage)
    describe_environment(ctx)
    import torch

    if not dry and not torch.cuda.is_available():  # nothing is written: no table of a GPU that is not there
        print(
            "gpu-check needs a CUDA GPU: torch.cuda.is_available() is False in "
            f"{ctx.python} (torch {torch.__version__}); on a machine without one run "
            "`python benchmarks/gpu_check.py --dry-run` (or make gpu-check-dry)",
            file=sys.stderr,
        )
        return 2
    if ctx.work.exists():
        import shutil

        shutil.rmtree(ctx.work)  # checkpoints of an earlier check would be resumed from
    ctx.work.mkdir(parents=True, exist_ok=True)
    from dit_lightning.data import prepare_digits

    ctx.store = Path(prepare_digits(str(ctx.work / "digits")))
    selected = args.stages.split(",")
    for name, title, fn in STAGES:
        i = [n for n, _, _ in STAGES].index(name)
        stage = Stage(name, title, BUDGETS[name][1 if dry else 0])
        ctx.stages.append(stage)
        if name not in selected:
            stage.status, stage.note = "skipped", "not selected (--stages)"
            continue
        left = ctx.deadline - SUMMARY_RESERVE_S - time.monotonic()
        if left < 5:
            stage.status, stage.note = "cut", "no time left in the total budget"
            continue
        ctx.stage_deadline = time.monotonic() + min(stage.budget_s, left)
        print(f"\n== [{i + 1}/{len(STAGES)}] {name}: {title} (budget {min(stage.budget_s, left):.0f} s)", flush=True)
        t0 = time.monotonic()
        try:
            fn(ctx)
        except Exception as e:  # an error in one stage is recorded; the next stage runs
            trace = traceback.format_exc()
            (ctx.work / f"{name}.error.log").write_text(trace)
            ctx.add(name, f"{name} stage", "fail", f"{type(e).__name__}: {e}"[:300], detail=f"{name}.error.log")
            stage.status = "error"
        stage.seconds = time.monotonic() - t0
        mine = [c for c in ctx.checks if c.stage == name]
        if stage.status != "error":
            if any(c.status == "fail" for c in mine):
                stage.status = "failed"
            elif any(c.status.startswith("cut") for c in mine) or time.monotonic() >= ctx.stage_deadline:
                stage.status = "cut"
            else:
                stage.status = "ok"
        stage.note = f"{sum(c.status == 'pass' for c in mine)}/{len(mine)} checks passed"
        write_report(ctx, final=False)
    stem = write_report(ctx, final=True)
    print_summary(ctx, stem)
    return 1 if any(c.status == "fail" for c in ctx.checks) or any(s.status == "error" for s in ctx.stages) else 0


if __name__ == "__main__":
    sys.exit(main())
