import os

import pytest
import torch

# Two cores on CI: keep intra-op threads bounded so parallel helpers do not thrash.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One intra-op thread, for modules of tiny models (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    their matmuls gain nothing from a second thread, and on a busy 2-core machine the threads'
    spin-waits made steps 5-20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_dit_kwargs(**overrides):
    """A DiT small enough for CPU tests (a few thousand parameters)."""
    kw = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=4, num_classes=10)
    kw.update(overrides)
    return kw
