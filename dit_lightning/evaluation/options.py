"""The metric knobs in one place: what an evaluation measures, against what, and how its images are
sampled. ``dit-lightning evaluate`` and the ``test`` stage's :class:`~dit_lightning.callbacks.GenerationMetrics`
both take :class:`MetricOptions`' fields as flat options (``--num_samples``, ``--evaluation.reference``...),
through one ``**options`` that jsonargparse reads off the ``MetricOptions(**options)`` call, and both
check them with :meth:`MetricOptions.check` before any sampling.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Literal, Optional, Union, cast, get_args

from torch import Tensor, nn

from ..sampling import SAMPLING_OPTION_NAMES, LabelSpec, SamplingOptions
from .fid import check_metrics, find_inception_weights, load_inception_state_dict

Metric = Literal["fid", "is", "kid", "digits"]
# ``reference="store"``: the held-out split (``data.val_size``) of the run's own data store, for
# ``dit-lightning test``: its pixels (pixel stores) or its decoded latents (VAE stores).
STORE_REFERENCE = "store"
METRICS: tuple[Metric, ...] = get_args(Metric)


def metric_names(metrics: Union[str, Sequence[str]]) -> list[Metric]:
    """The metrics asked for: a list, or one string with comma-separated names (``"fid,is"``),
    lower-cased; a ValueError naming the choices for an unknown one."""
    names = [m.strip().lower() for m in (metrics.split(",") if isinstance(metrics, str) else metrics)]
    names = [m for m in names if m]
    unknown = sorted(set(names) - set(METRICS))
    if unknown:
        raise ValueError(f"unknown metrics {unknown}: choose from {', '.join(METRICS)}")
    return cast(list[Metric], names)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricOptions(SamplingOptions):
    """What is measured and against what (the fields below), and how the images are sampled (the
    fields of :class:`~dit_lightning.sampling.SamplingOptions`, inherited so that one set of flat
    options carries both; :attr:`sampling` is that part alone).

    Attributes:
        num_samples: images to generate and measure (50,000 for the published FID-50K).
        reference: the real images for FID / KID: an image folder, a latent store (decoded), an
            ``.npz`` of images (``arr_0``) or of statistics (``mu``/``sigma``, e.g. ADM's
            ``VIRTUAL_imagenet256_labeled.npz``); ``store`` (``test`` only): the held-out split
            (``data.val_size``) of the run's own store, which training never saw.
        inception_weights: the local InceptionV3 weights file for FID / IS / KID (offline machines);
            default ``$DIT_INCEPTION_WEIGHTS`` or torch hub's checkpoint cache.
        feature_extractor: an ``nn.Module`` mapping uint8 (N, 3, H, W) images to (N, D) features, used
            instead of Inception (Python API; not for IS).
        antialias: torchmetrics' resize to 299 px; False (TF1-compatible) matches published FIDs.
        cache_dir: where reference statistics are cached ("auto": ``~/.cache/dit-lightning/fid-stats``;
            None: off).
        image_size: centre-crop size of reference folder images.
        max_reference: use at most this many reference images.
        kid_subset_size: KID's subset size (capped by the number of images).
        labels: "random" (uniform, keyed on seed and index: the FID protocol), "all" (cycled), "0-9",
            "1,5,7" or a list.
    """

    num_samples: int = 50_000
    reference: Optional[str] = None
    inception_weights: Optional[str] = None
    feature_extractor: Optional[Callable[[Tensor], Tensor]] = None
    antialias: bool = False
    cache_dir: Optional[str] = "auto"
    image_size: Optional[int] = None
    max_reference: Optional[int] = None
    kid_subset_size: int = 1000
    labels: LabelSpec = "random"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.feature_extractor is not None and not isinstance(self.feature_extractor, nn.Module):
            raise TypeError("feature_extractor must be a torch.nn.Module mapping uint8 (N, 3, H, W) to (N, D)")

    @property
    def sampling(self) -> SamplingOptions:
        """How the images are sampled: the :class:`SamplingOptions` fields alone."""
        return SamplingOptions(**{name: getattr(self, name) for name in SAMPLING_OPTION_NAMES})

    def check(self, metrics: Sequence[str]) -> None:
        """Refuse, before any sampling, what cannot be measured: an unknown metric, FID / KID without a
        reference (or one that does not exist, or an ``.npz`` holding pickles), IS with a feature
        extractor, fewer than 2 samples, missing or wrong InceptionV3 weights."""
        wanted = metric_names(metrics)
        image_metrics = [m for m in wanted if m != "digits"]
        check_metrics(image_metrics, self.reference, cast(Optional[nn.Module], self.feature_extractor))
        if self.reference not in (None, STORE_REFERENCE) and not os.path.exists(self.reference):
            raise FileNotFoundError(f"the FID reference {self.reference} does not exist")
        if self.num_samples < 2:
            raise ValueError(f"num_samples must be at least 2 to measure anything, got {self.num_samples}")
        if image_metrics and self.feature_extractor is None:
            # says how to get the weights; read and checked now, not after hours of sampling
            load_inception_state_dict(find_inception_weights(self.inception_weights))
