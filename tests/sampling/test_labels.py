"""Class labels of sample indices: ranges, lists, "all", and keyed random labels."""

import pytest
import torch

from dit_lightning.sampling import parse_labels


def test_parse_labels():
    assert parse_labels("0-3,7", 10).classes == (0, 1, 2, 3, 7)
    assert parse_labels([5, 1], 10)(torch.arange(5)).tolist() == [5, 1, 5, 1, 5]
    assert parse_labels("all", 3).classes == (0, 1, 2)
    rnd = parse_labels("random", 1000, seed=3)
    first = rnd(torch.arange(100))
    assert first[:10].tolist() == rnd(torch.arange(10)).tolist()  # label of i independent of N
    assert len(set(first.tolist())) > 50 and 0 <= int(first.min()) and int(first.max()) < 1000
    with pytest.raises(ValueError, match="outside"):
        parse_labels("5-12", 10)
    with pytest.raises(ValueError, match="parse"):
        parse_labels("cats", 10)
