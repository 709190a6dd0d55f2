"""Which share of the work a tool process does: explicit arguments, torchrun's environment, devices."""

import pytest
import torch

from dit_lightning.ranks import rank_indices, resolve_device, resolve_rank


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
