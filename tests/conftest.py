import os

import pytest
import torch

# Two cores on CI: keep intra-op threads bounded so parallel helpers do not thrash.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def tiny_dit_kwargs(**overrides):
    """A DiT small enough for CPU tests (a few thousand parameters)."""
    kw = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=4, num_classes=10)
    kw.update(overrides)
    return kw
