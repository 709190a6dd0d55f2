import os

import pytest
import torch
from torch.utils.data import Dataset

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


# DiTModule arguments of a tiny model on 1 x 8 x 8 "digits" (10 classes).
TINY_MODULE = dict(model="custom", latent_shape=(1, 8, 8), num_classes=10, depth=2, hidden_size=32, num_heads=4, patch_size=2)


class DictDataset(Dataset):
    """``n`` fixed random 1 x 8 x 8 samples in [-1, 1] as ``{"x", "y", "index"}`` batches."""

    def __init__(self, n: int = 32):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 1, 8, 8, generator=g).clamp(-1, 1)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "index": torch.tensor(i)}
