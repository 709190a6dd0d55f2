"""Measuring what a trained DiT generates: FID / IS / KID (``fid``) and the digits demo's
offline classifier accuracy and Fréchet distances (``digits``); :class:`MetricOptions`, the knobs
``evaluate`` and the ``test`` stage share.

Cheap to import: torchmetrics, the Inception network and scikit-learn load when a metric is used.
"""

from .digits import digits_accuracy, digits_frechet, digits_metrics, digits_metrics_from_samples
from .fid import (
    FeatureStats,
    InceptionFeatures,
    InceptionWeightsMissing,
    compute_metrics,
    find_inception_weights,
    frechet_distance,
    image_batches,
    metrics_from_features,
    reference_stats,
)
from .options import METRICS, Metric, MetricOptions, metric_names

__all__ = [
    "METRICS",
    "FeatureStats",
    "InceptionFeatures",
    "InceptionWeightsMissing",
    "Metric",
    "MetricOptions",
    "compute_metrics",
    "digits_accuracy",
    "digits_frechet",
    "digits_metrics",
    "digits_metrics_from_samples",
    "find_inception_weights",
    "frechet_distance",
    "image_batches",
    "metric_names",
    "metrics_from_features",
    "reference_stats",
]
