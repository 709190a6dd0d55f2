"""Which class sample ``i`` is drawn for: a pure function of ``i`` (and the seed)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
from torch import Tensor

from ..keyed_random import keyed_randint, sample_keys

LabelSpec = Union[str, list[int]]

# Key of the keyed-random labels; fixed forever, since it defines which class sample i is.
_KEY_LABEL = 0x1AB


@dataclass(frozen=True)
class LabelPlan:
    """Which class sample ``i`` gets: ``classes[i % len(classes)]``, or keyed-random.

    Both are pure functions of ``i``, so a run can be extended (10K -> 50K samples) or split
    over ranks without changing the labels of the samples already written.
    """

    classes: Optional[tuple[int, ...]]  # None: random
    num_classes: int
    seed: int = 0

    def __call__(self, indices: Union[Tensor, np.ndarray, Sequence[int]]) -> Tensor:
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        if self.classes is None:
            return keyed_randint(sample_keys(idx, self.seed, _KEY_LABEL), self.num_classes)
        table = torch.tensor(self.classes, dtype=torch.long)
        return table[idx % len(table)]

    def describe(self) -> str:
        return "random" if self.classes is None else ",".join(map(str, self.classes))


def parse_labels(labels: LabelSpec, num_classes: int, seed: int = 0) -> LabelPlan:
    """``"random"``, ``"all"``, ranges and lists (``"0-9"``, ``"1,5,88-90"``) or a list of ints."""
    if isinstance(labels, str):
        text = labels.strip().lower()
        if text == "random":
            return LabelPlan(None, num_classes, seed)
        if text == "all":
            return LabelPlan(tuple(range(num_classes)), num_classes, seed)
        classes: list[int] = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
            if m:
                lo, hi = int(m.group(1)), int(m.group(2))
                if hi < lo:
                    raise ValueError(f"empty label range {part!r}")
                classes.extend(range(lo, hi + 1))
            elif part.isdigit():
                classes.append(int(part))
            else:
                raise ValueError(f"cannot parse labels {labels!r}: use 'random', 'all', '0-9' or '1,5,7'")
    else:
        classes = [int(c) for c in labels]
    if not classes:
        raise ValueError("no class labels given")
    bad = [c for c in classes if not 0 <= c < num_classes]
    if bad:
        raise ValueError(f"labels {bad[:5]} outside the model's {num_classes} classes (0..{num_classes - 1})")
    return LabelPlan(tuple(classes), num_classes, seed)


class SampleRequests(torch.utils.data.Dataset):
    """Items ``{"index", "y"}`` for samples ``indices``: a predict dataloader for
    ``DiTModule.predict_step`` (``Trainer.predict`` shards it over ranks)."""

    def __init__(self, indices: Sequence[int], plan: LabelPlan) -> None:
        self.indices = torch.as_tensor(list(indices), dtype=torch.long)
        self.labels = plan(self.indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> dict[str, Tensor]:
        return {"index": self.indices[k], "y": self.labels[k]}
