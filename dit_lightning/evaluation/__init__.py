"""Measuring what a trained DiT generates: FID / IS / KID (``fid``) and the digits demo's
offline classifier accuracy and Fréchet distances (``digits``).

Names are imported lazily, so importing the package costs nothing until a metric is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .digits import digits_accuracy, digits_frechet, digits_metrics, digits_metrics_from_samples
    from .fid import (
        FeatureStats,
        InceptionFeatures,
        InceptionWeightsMissing,
        compute_metrics,
        evaluate,
        find_inception_weights,
        frechet_distance,
        image_batches,
        reference_stats,
    )

_EXPORTS = {
    "digits_accuracy": "digits",
    "digits_frechet": "digits",
    "digits_metrics": "digits",
    "digits_metrics_from_samples": "digits",
    "FeatureStats": "fid",
    "InceptionFeatures": "fid",
    "InceptionWeightsMissing": "fid",
    "compute_metrics": "fid",
    "evaluate": "fid",
    "find_inception_weights": "fid",
    "frechet_distance": "fid",
    "image_batches": "fid",
    "reference_stats": "fid",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
