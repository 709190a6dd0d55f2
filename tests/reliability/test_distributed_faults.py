"""Distributed faults on CPU (gloo), and the multi-node profiles run as two "nodes" on one machine.

- A rank killed with SIGKILL in a 2-process DDP or FSDP2 run: the other rank exits at once with a
  message naming the lost rank (it used to print gloo's "Connection reset by peer"), and the run
  resumes from its last checkpoint bit for bit.
- A frozen rank (SIGSTOP: a hung process or an unreachable node, whose connections stay open and
  whose collectives never return) is named after ``--fault_tolerance.peer_timeout`` seconds and the
  others stop, instead of waiting for the 30-minute collective timeout.
- SIGTERM to the launching process of a 2-process run: every rank checkpoints together, exit 143.
- ``torchrun --nnodes 2`` on localhost with ``configs/hardware/multinode.yaml`` (DDP) and
  ``fsdp-v2-hybrid-multinode.yaml`` (HSDP, 2 nodes x 2 processes) start, train and checkpoint.

Slow (several multi-process runs): ``pytest -m slow tests/reliability``.
"""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dit_lightning.checkpoints import is_sharded_checkpoint, read_checkpoint
from tests.helpers.cli import DEMO, ROOT, fit_args
from tests.helpers.ports import free_port, with_master_port

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
FSDP2_CPU = str(ROOT / "configs" / "hardware" / "fsdp-v2-cpu.yaml")
TIMEOUT = 420
# A killed peer is found at once (its sockets close); the rest is start-up and the diagnosis.
PROMPT_EXIT_S = 60


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], cwd: Path, timeout: float = TIMEOUT) -> tuple[int, str, float]:
    """Run a job in its own session until its main process exits (every rank left then, e.g. a
    stopped one, is killed; so is everything after ``timeout``): (exit status, output, seconds)."""
    t0 = time.monotonic()
    log = cwd / f"job-{len(list(cwd.glob('job-*.log')))}.log"
    with open(log, "w") as f:  # a file, not a pipe: a stopped rank would hold a pipe open
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=with_master_port(_env()), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_leftovers(proc.pid)
            proc.wait()
            raise AssertionError(f"timed out after {timeout} s\n{log.read_text()[-5000:]}") from None
        finally:
            _kill_leftovers(proc.pid)
    return code, log.read_text(), time.monotonic() - t0


def _kill_leftovers(session: int) -> list[int]:
    """Kill what is left of a job's session (a stopped rank); returns the pids that were left."""
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == session:
                    left.append(int(entry))
                    os.kill(int(entry), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
    return left


def _fit(tmp: Path, name: str, steps: int, digits: Path, strategy: str, extra: tuple[str, ...] = ()) -> list[str]:
    profile = (
        ["--config", FSDP2_CPU, "--trainer.callbacks=[]"]
        if strategy == "fsdp2"
        else ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy",
              "dit_lightning.distributed.DiTDDPStrategy", "--trainer.strategy.process_group_backend", "gloo"]
    )  # fmt: skip
    args = fit_args(tmp, name, steps, ["--data.path", str(digits), *profile, *extra])
    return [sys.executable, "-m", "dit_lightning.cli", *args]


def _losses(run_dir: Path) -> dict[int, str]:
    with open(run_dir / "metrics.csv") as f:
        return {int(r["step"]): r["train/loss"] for r in csv.DictReader(f) if r.get("train/loss")}


def _kill_rank(rank: int, step: int, signum: int = int(signal.SIGKILL)) -> tuple[str, ...]:
    return (
        "--trainer.callbacks+=tests.helpers.cli.KillRankAtStep", "--trainer.callbacks.rank", str(rank),
        "--trainer.callbacks.step", str(step), "--trainer.callbacks.signum", str(signum),
    )  # fmt: skip


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_killed_rank_is_named_and_the_run_resumes_bit_for_bit(digits, tmp_path, strategy):
    code, out, _ = _run(_fit(tmp_path, "full", 8, digits, strategy), tmp_path)
    assert code == 0, out[-4000:]
    code, out, seconds = _run(_fit(tmp_path, "run", 8, digits, strategy, _kill_rank(1, 6)), tmp_path)
    assert code == 1 and seconds < PROMPT_EXIT_S, (code, seconds, out[-4000:])
    # named by the main thread (the collective failed) or by Lightning's process observer, whichever is first
    assert re.search(r"lost rank 1 \(pid \d+ on [^)]*\) exited \((killed|exit)[^)]*\) at step 6", out), out[-4000:]
    assert "--ckpt_path last" in out and "(step 4), was written before and is kept" in out
    last = tmp_path / "run" / "ckpt" / "last.ckpt"
    assert is_sharded_checkpoint(last) == (strategy == "fsdp2") and read_checkpoint(last).meta["global_step"] == 4
    # what a sharded save killed half-way leaves (it writes beside last.ckpt, then renames): removed
    partial = last.with_name(".last.ckpt.k1lled_2.tmp")  # atomic.staging_directory's name
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 1000)
    code, out, _ = _run(_fit(tmp_path, "run", 8, digits, strategy, ("--ckpt_path", str(last))), tmp_path)
    assert code == 0, out[-4000:]
    assert not partial.exists() and "left by a checkpoint save that was interrupted" in out
    full, resumed = _losses(tmp_path / "full"), _losses(tmp_path / "run")
    # the killed run's rows are kept (the resumed run appends its own: steps after the checkpoint appear twice)
    assert sorted(resumed) == list(range(8)) and all(resumed[s] == full[s] for s in range(8)), (full, resumed)


def test_a_killed_rank_0_is_named_by_the_other(digits, tmp_path):
    code, out, seconds = _run(_fit(tmp_path, "run", 40, digits, "ddp", _kill_rank(0, 6)), tmp_path)
    assert code != 0 and seconds < PROMPT_EXIT_S, (code, seconds, out[-4000:])
    assert "rank 1 lost rank 0 (it hosts the rendezvous store" in out, out[-4000:]


def test_a_frozen_rank_is_named_after_the_peer_timeout(digits, tmp_path):
    args = _fit(tmp_path, "run", 40, digits, "ddp", (*_kill_rank(1, 6, int(signal.SIGSTOP)),
                "--fault_tolerance.peer_timeout", "10"))  # fmt: skip
    code, out, seconds = _run(args, tmp_path)
    assert code == 1 and seconds < PROMPT_EXIT_S + 20, (code, seconds, out[-4000:])
    assert re.search(r"lost rank 1 \(pid \d+ on .*\) sent no heartbeat for 1\d s", out), out[-4000:]


def test_sigterm_to_the_launching_process_checkpoints_every_rank(digits, tmp_path):
    signal_rank_0 = ("--trainer.callbacks+=tests.helpers.cli.SignalAtStep", "--trainer.callbacks.step", "3",
                     "--trainer.callbacks.rank", "0")  # fmt: skip
    code, out, _ = _run(_fit(tmp_path, "run", 40, digits, "ddp", signal_rank_0), tmp_path)
    assert code == 143, out[-4000:]
    assert "[rank 0] dit-lightning: SIGTERM received" in out and "[rank 1] dit-lightning: SIGTERM received" in out
    assert torch.load(tmp_path / "run" / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 3


@pytest.mark.parametrize(
    "profile, per_node",
    [("multinode.yaml", 1), ("fsdp-v2-hybrid-multinode.yaml", 2)],
    ids=["ddp-2-nodes", "hsdp-2x2"],
)
def test_the_multi_node_profiles_train_and_checkpoint_on_two_simulated_nodes(digits, tmp_path, profile, per_node):
    port = free_port()
    out_dir = tmp_path / "run"
    args = [
        "fit", "--config", DEMO, "--config", str(ROOT / "configs" / "hardware" / profile),
        "--model.depth", "2", "--model.hidden_size", "32", "--model.num_heads", "4",
        "--data.path", str(digits), "--data.global_batch_size", "32", "--data.val_size", "64",
        "--trainer.accelerator", "cpu", "--trainer.devices", str(per_node), "--trainer.num_nodes", "2",
        "--trainer.precision", "32-true", "--trainer.strategy.process_group_backend", "gloo",
        "--trainer.max_steps", "4", "--trainer.val_check_interval", "1000", "--trainer.callbacks=[]",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.logger.save_dir", str(out_dir), "--checkpoint.every_n_train_steps", "2",
    ]  # fmt: skip
    if per_node == 2:
        args += ["--trainer.strategy.hybrid_shard_size", "2"]
    nodes = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", str(per_node), "--master_addr", "127.0.0.1", "--master_port", str(port),
               "-m", "dit_lightning.cli", *args]  # fmt: skip
        log = open(tmp_path / f"node{node}.log", "w")
        nodes.append(subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))  # fmt: skip
    try:
        codes = [p.wait(timeout=TIMEOUT) for p in nodes]
    finally:
        for p in nodes:
            _kill_leftovers(p.pid)
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert codes == [0, 0], "\n".join(log[-4000:] for log in logs)
    world = 2 * per_node
    assert f"GLOBAL_RANK: {world - 1}, MEMBER: {world}/{world}" in "".join(logs)
    last = out_dir / "version_0" / "checkpoints" / "last.ckpt"
    assert (out_dir / "last.ckpt").resolve() == last.resolve()
    ckpt = read_checkpoint(last)
    assert ckpt.meta["global_step"] == 4 and ckpt.ema is not None and ckpt.model.keys() == ckpt.ema.keys()
    if per_node == 2:  # HSDP: sharded within a "node" (each rank holds half), every rank writes its part
        total, local = (
            int(n.replace(",", "")) for n in re.search(r"sharded ([\d,]+) .* \(([\d,]+) on rank 0", logs[0]).groups()
        )
        assert 0.45 < local / total < 0.55, (local, total)
        assert is_sharded_checkpoint(last) and len(list(last.glob("*.distcp"))) == world
