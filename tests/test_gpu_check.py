"""``make gpu-check`` cannot rot while no GPU is at hand: its ``--dry-run`` runs every stage end to end
at tiny sizes on the CPU (benchmarks/gpu_check.py), and the pieces it judges with are checked here:
the seed's-claims verdicts, and the conftest hook that turns a skipped ``gpu`` test into a failure."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402

STAGE_NAMES = ["install"] + [name for name, _, _ in gpu_check.STAGES]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpu-check")
    out, work = base / "out", base / "work"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DIT_REQUIRE_GPU", None)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)]
    proc = subprocess.run(cmd + ["--work", str(work)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    rows = list(csv.DictReader(open(out / "gpu_check_dry-run-cpu.csv")))
    return proc, out, rows


def test_dry_run_reports_every_stage_and_passes(dry_run):
    proc, out, rows = dry_run
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    stages = {r["stage"]: r["status"] for r in rows if r["name"] == "stage"}
    assert list(stages) == STAGE_NAMES
    # ok, or cut by its budget on a busy machine; never failed, errored or forgotten
    assert all(status in ("ok", "cut") for status in stages.values()), stages
    assert not [r for r in rows if r["status"] == "fail"]
    assert "GPU check summary (dry run)" in proc.stdout and "| stage | status |" in proc.stdout
    md = (out / "gpu_check_dry-run-cpu.md").read_text()
    for line in ("- torch:", "- lightning:", "- date:", "- command: `python benchmarks/gpu_check.py --dry-run"):
        assert line in md


def test_dry_run_names_what_only_a_gpu_can_run(dry_run):
    _, _, rows = dry_run
    status = {(r["stage"], r["name"]): r["status"] for r in rows}
    for stage, name in [("fit", "16-mixed"), ("fit", "16-mixed+ckpt-all"), ("distributed", "fsdp1")]:
        assert status[(stage, name)].startswith("skipped: needs CUDA"), (stage, name)
    gpu_tests = [r for r in rows if r["stage"] == "gpu-tests" and "::" in r["name"]]
    assert len(gpu_tests) >= 7 and all(r["status"] == "skipped: needs CUDA" for r in gpu_tests)


def test_dry_run_puts_the_seeds_claims_beside_the_measurements(dry_run):
    proc, out, rows = dry_run
    claims = [r for r in rows if r["stage"] == "summary"]
    assert [r["name"] for r in claims] == [c[0] for c in gpu_check.CLAIMS]
    assert all(r["status"] for r in claims)  # a verdict, or "not measured" with the reason
    md = (out / "gpu_check_dry-run-cpu.md").read_text()
    assert "## The seed's claims beside the measured figures" in md
    for claim, *_ in gpu_check.CLAIMS:
        assert claim in md and claim in proc.stdout


def _bench_row(config: str, images_per_s: float, peak_mib: float) -> dict[str, str]:
    return {"config": config, "status": "ok", "images_per_s": str(images_per_s), "peak_bytes": str(peak_mib * 2**20)}


def test_claim_verdicts():
    rows = [
        _bench_row("fp32", 100, 1000),
        _bench_row("bf16-mixed", 120, 600),  # -40% memory, +20% speed: both claims hold
        _bench_row("bf16+ckpt-all", 80, 150),  # -75% vs bf16 (better than -50..60%), step time +50%
        {"config": "16-mixed", "status": "failed: OOM"},
    ]
    ctx = type("Ctx", (), {"dry": False})()
    got = {c["claim"]: (c["measured"], c["verdict"]) for c in gpu_check.claims(rows, ctx)}
    assert got["AMP saves 35-45% memory"] == ("-40%", "holds")
    assert got["AMP is 15-25% faster"] == ("+20%", "holds")
    assert got["checkpointing saves a further 50-60%"] == ("-75%", "better than claimed")
    assert got["checkpointing is 20-30% slower"] == ("+50%", "worse than claimed")
    assert got["AMP + checkpointing save 70-80%"] == ("-85%", "better than claimed")
    assert got["AMP saves 35-45% memory (fp16 + GradScaler)"][1].startswith("not measured")


def test_a_skipped_gpu_test_fails_when_the_gpu_run_requires_it(tmp_path):
    marker = "pytest.mark." + "gpu"  # spelled apart: this file holds no gpu-marked test itself
    (tmp_path / "test_sample.py").write_text(
        textwrap.dedent(f"""
        import pytest

        @{marker}
        @pytest.mark.skipif(True, reason="needs a CUDA device")
        def test_cuda_only():
            pass

        @pytest.mark.skipif(True, reason="not a gpu test")
        def test_other_skip():
            pass
        """)
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-rA"]
    cmd += ["-W", "ignore::pytest.PytestUnknownMarkWarning", "test_sample.py"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    required = subprocess.run(cmd, cwd=tmp_path, env={**env, "DIT_REQUIRE_GPU": "1"}, capture_output=True, text=True)
    assert required.returncode != 0
    assert "test_cuda_only is marked gpu but skipped (needs a CUDA device)" in required.stdout
    assert "1 skipped" in required.stdout  # the unmarked skip stays a skip
    plain = subprocess.run(cmd, cwd=tmp_path, env={k: v for k, v in env.items() if k != "DIT_REQUIRE_GPU"},
                           capture_output=True, text=True)  # fmt: skip
    assert plain.returncode == 0 and "2 skipped" in plain.stdout
