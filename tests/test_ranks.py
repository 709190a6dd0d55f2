"""Which share of the work a tool process does: explicit arguments, torchrun's environment, devices."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dit_lightning.ranks import rank_indices, resolve_device, resolve_rank
from tests.helpers.cli import ROOT


def test_explicit_rank_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert resolve_rank(1, 2) == (1, 2, 1)  # local rank defaults to the rank
    assert resolve_rank() == (3, 4, 3)  # torchrun's variables
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_rank() == (3, 4, 1)


def test_rank_outside_the_world_is_refused(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_rank() == (0, 1, 0)
    with pytest.raises(ValueError, match="outside world_size 2"):
        resolve_rank(2, 2)
    with pytest.raises(ValueError, match="outside"):
        resolve_rank(0, 0)


def test_rank_shares_are_disjoint_and_complete():
    shares = [list(rank_indices(10, r, 3)) for r in range(3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert sorted(i for s in shares for i in s) == list(range(10))


def test_devices():
    assert resolve_device("cpu", 5) == torch.device("cpu")
    expect = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto", 0).type == expect


# Collectives still queued in gloo's worker threads when the script ends: each one's tensors are freed
# by the worker, which needs the GIL. Left to interpreter exit this aborts about every other run
# ("terminate called without an active exception", -6: the failure of the 2-rank CLI fits, whose last
# collective is ``after_fit``'s broadcast); closed first, never.
COLLECTIVES_IN_FLIGHT_AT_EXIT = textwrap.dedent(
    """
    import sys
    import tempfile

    import torch
    import torch.distributed as dist

    from dit_lightning.ranks import close_process_group

    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    for _ in range(200):
        dist.broadcast(torch.ones(100_000), src=0, async_op=True)
    close_process_group()
    assert not dist.is_initialized()
    close_process_group()  # nothing to close: a no-op
    """
)


def test_closing_the_process_group_lets_queued_collectives_finish_before_exit():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, "-c", COLLECTIVES_IN_FLIGHT_AT_EXIT], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, (proc.returncode, proc.stderr[-2000:])
