"""How good are the images the model generates? FID / IS / KID and the digits metrics, logged by
``dit-lightning test`` (and, if asked, after every validation)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Optional, cast

import lightning as L
import numpy as np
import torch
from torch import Tensor, nn

from ..atomic import write_json
from ..evaluation.digits import digits_metrics, uint8_digit_features
from ..evaluation.fid import (
    FeatureStats,
    build_extractor,
    check_metrics,
    find_inception_weights,
    metrics_from_features,
    reference_stats,
)
from ..images import to_uint8
from ..models import DiT
from ..sampling import LabelPlan, LabelSpec, SamplingOptions, parse_labels
from ..vae import is_pixel_space
from .checkpoint import run_path

Metric = Literal["fid", "is", "kid", "digits"]
Stage = Literal["test", "validate"]


class GenerationMetrics(L.Callback):
    """Samples ``num_samples`` class-conditional images from the module's evaluation weights and
    logs how good they are, as ``test/fid``, ``test/is``, ``test/kid``, ``test/digits_accuracy``...

    - ``"fid"``, ``"kid"``, ``"is"``: torchmetrics on InceptionV3 features (or ``feature_extractor``)
      against ``reference``; the same computation as ``dit-lightning evaluate``.
    - ``"digits"``: the digits demo's offline metrics: the accuracy of an independent classifier on
      the requested classes, and Fréchet distances in pixel and classifier space next to the
      real-vs-real floor (``dit_lightning.evaluation.digits``).

    How the images are sampled: ``**sampling``, the fields of
    :class:`~dit_lightning.sampling.SamplingOptions` as flat arguments (``sampler``, ``num_steps``,
    ``cfg_scale``, ``guide_channels``, ``seed``...: ``--evaluation.cfg_scale``); unset ones take the
    module's. Sample ``i`` is keyed on ``(seed, i)`` as in ``dit-lightning sample`` (its label under
    ``labels="random"``, its initial and per-step noise). Rank ``r`` of ``W`` makes samples
    ``r, r + W, ...``; the features of all ranks are gathered in index order, so the numbers do
    not depend on the number of devices or the batch size. Every check (metric names, Inception
    weights on disk, the reference, a digits model for ``"digits"``) runs in ``setup``, before the
    first batch, and reference statistics are computed there once (and cached).

    Args:
        metrics: any of "fid", "is", "kid", "digits"; empty: nothing is sampled.
        num_samples: images to generate (50,000 for the published FID-50K).
        reference: real images for FID / KID: an image folder, a latent store (decoded), an
            ``.npz`` of images (``arr_0``) or of statistics (``mu``/``sigma``: ADM's reference batches).
        inception_weights: the local InceptionV3 weights file (offline machines); default
            ``$DIT_INCEPTION_WEIGHTS`` or torch hub's checkpoint cache.
        feature_extractor: an ``nn.Module`` mapping uint8 (N, 3, H, W) to (N, D), used instead of
            Inception (not for IS).
        antialias: torchmetrics' resize to 299 px; False (TF1-compatible) matches published FIDs.
        cache_dir: reference statistics cache ("auto": ``~/.cache/dit-lightning/fid-stats``; None: off).
        image_size: centre-crop size of reference folder images.
        max_reference: use at most this many reference images.
        kid_subset_size: KID's subset size (capped by the number of images).
        labels: "random" (uniform, keyed on seed and index: the FID protocol), "all" (cycled),
            "0-9", "1,5,7" or a list.
        batch_size: images per sampling batch on each device (does not change the images).
        stages: "test" (default) and/or "validate" (after every validation epoch, also during fit:
            e.g. an FID-5K curve; never in the sanity check).
        output: also write the metrics with their details (per-class accuracy, sampling settings)
            to this JSON file (atomically; ``{stage}`` becomes "test" or "val", ``{log_dir}`` the
            run's directory).
    """

    def __init__(
        self,
        metrics: list[Metric] = [],  # noqa: B006 - jsonargparse needs a plain default
        num_samples: int = 50_000,
        reference: Optional[str] = None,
        inception_weights: Optional[str] = None,
        feature_extractor: Optional[Callable[[Tensor], Tensor]] = None,
        antialias: bool = False,
        cache_dir: Optional[str] = "auto",
        image_size: Optional[int] = None,
        max_reference: Optional[int] = None,
        kid_subset_size: int = 1000,
        labels: LabelSpec = "random",
        batch_size: int = 64,
        stages: list[Stage] = ["test"],  # noqa: B006
        output: Optional[str] = None,
        **sampling: Any,
    ) -> None:
        self.options = SamplingOptions(**sampling)  # jsonargparse reads the flat init args off this call
        self.metrics = [str(m).lower() for m in metrics]
        self.image_metrics = [m for m in self.metrics if m != "digits"]
        self.num_samples = int(num_samples)
        self.reference = reference
        self.inception_weights = inception_weights
        if feature_extractor is not None and not isinstance(feature_extractor, nn.Module):
            raise TypeError("feature_extractor must be a torch.nn.Module mapping uint8 (N, 3, H, W) to (N, D)")
        self.feature_extractor = feature_extractor
        self.antialias = antialias
        self.cache_dir = cache_dir
        self.image_size = image_size
        self.max_reference = max_reference
        self.kid_subset_size = kid_subset_size
        self.labels = labels
        self.batch_size = int(batch_size)
        self.stages = list(stages)
        self.output = output
        bad = set(self.stages) - {"test", "validate"}
        if bad:
            raise ValueError(f"unknown stages {sorted(bad)}: choose from 'test', 'validate'")
        self._extractor: Optional[nn.Module] = None
        self._dim: Optional[int] = None
        self._reference: Optional[FeatureStats] = None
        self.last: Optional[dict[str, Any]] = None  # the last measurement, with details

    # ---- set-up: every check before any work ---------------------------------------------
    def _active(self, stage: Optional[str]) -> bool:
        if not self.metrics:
            return False
        return (stage == "test" and "test" in self.stages) or (
            stage in ("fit", "validate") and "validate" in self.stages
        )

    def check(self, pl_module: L.LightningModule) -> None:
        """Raise a clear error for settings that cannot be measured (called in ``setup``)."""
        unknown = set(self.metrics) - {"fid", "is", "kid", "digits"}
        if unknown:
            raise ValueError(f"unknown metrics {sorted(unknown)}: choose from fid, is, kid, digits")
        check_metrics(self.image_metrics, self.reference, self.feature_extractor)
        if self.num_samples < 2:
            raise ValueError(f"num_samples must be at least 2 to measure anything, got {self.num_samples}")
        net = cast(DiT, pl_module.model)  # a DiTModule's network
        parse_labels(self.labels, net.num_classes, seed=self.options.seed)  # raises for labels outside the model
        if "digits" in self.metrics and not (
            net.in_channels == 1 and net.num_classes == 10 and is_pixel_space(pl_module.hparams.get("vae"))
        ):
            raise ValueError(
                "the 'digits' metric measures the digits demo (1-channel pixels, 10 classes, data/digits store); "
                f"this model has {net.in_channels} channel(s), {net.num_classes} classes and VAE "
                f"{pl_module.hparams.get('vae')!r}: use metrics [fid] with a reference instead"
            )
        if self.image_metrics and self.feature_extractor is None:
            find_inception_weights(self.inception_weights)  # says how to get the weights
        if self.reference is not None and not os.path.exists(self.reference):
            raise FileNotFoundError(f"the FID reference {self.reference} does not exist")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self._active(stage):
            return
        self.check(pl_module)
        if not self.image_metrics:
            return
        device = trainer.strategy.root_device
        extractor, self._dim = build_extractor(
            self.image_metrics, self.inception_weights, self.feature_extractor, self.antialias
        )
        self._extractor = extractor.to(device).eval()
        if trainer.is_global_zero and self.reference is not None and ("fid" in self.metrics or "kid" in self.metrics):
            # Rank 0 alone holds the reference: the metrics are computed there.
            self._reference = reference_stats(
                self.reference, self._extractor, self.cache_dir, self.batch_size, self.image_size, self.max_reference,
                keep_features="kid" in self.metrics, device=device, dim=self._dim,
            )  # fmt: skip

    def output_locations(self, trainer: L.Trainer, stage: str) -> list[tuple[Path, str, str]]:
        """Where this callback writes in ``stage`` (checked writable before any work):
        (directory, what, the option that sets it)."""
        if not (self.output and self._active(stage)):
            return []
        prefix = "test" if stage == "test" else "val"
        return [
            (run_path(self.output, trainer, stage=prefix).parent, "metrics file's directory", "--evaluation.output")
        ]

    # ---- sampling and measuring -------------------------------------------------------------
    @torch.no_grad()
    def _local_features(
        self, trainer: L.Trainer, pl_module: Any, indices: Tensor, plan: LabelPlan
    ) -> dict[str, Tensor]:
        """Features of this rank's samples ``indices`` (on the device: all_gather needs them there)."""
        device = pl_module.device
        parts: dict[str, list[Tensor]] = {"image": [], "digits": []}
        for chunk in indices.split(self.batch_size):
            # Padding indices (>= num_samples, so that every rank runs as many batches: a sharded
            # forward is a collective) are sampled like the others and dropped after the gather.
            labels = plan(chunk.clamp(max=self.num_samples - 1))
            with trainer.precision_plugin.forward_context():
                latents = pl_module.sample(labels, self.options, indices=chunk)
            images = torch.from_numpy(to_uint8(pl_module.decode(latents))).permute(0, 3, 1, 2)
            if self.image_metrics:
                if self._extractor is None:
                    raise RuntimeError(
                        "GenerationMetrics measures image metrics only after its setup() built the extractor"
                    )
                rgb = images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images
                parts["image"].append(self._extractor(rgb.contiguous().to(device)).float())
            if "digits" in self.metrics:  # from the 8-bit images `evaluate` reads back
                parts["digits"].append(torch.from_numpy(uint8_digit_features(images)).float().to(device))
        return {k: torch.cat(v) for k, v in parts.items() if v}

    def _gather(self, trainer: L.Trainer, local: Tensor) -> np.ndarray:
        """(per_rank, D) of every rank -> (num_samples, D) in sample-index order (index k*W + r)."""
        world = trainer.world_size
        gathered = trainer.strategy.all_gather(local) if world > 1 else local[None]
        ordered = gathered.transpose(0, 1).reshape(-1, *local.shape[1:])
        return ordered[: self.num_samples].double().cpu().numpy()

    def measure(self, trainer: L.Trainer, pl_module: Any) -> dict[str, Any]:
        """Sample, gather and measure; every rank returns the same metrics."""
        world, rank = trainer.world_size, trainer.global_rank
        per_rank = math.ceil(self.num_samples / world)
        indices = torch.arange(per_rank) * world + rank
        plan = parse_labels(self.labels, pl_module.model.num_classes, seed=self.options.seed)
        local = self._local_features(trainer, pl_module, indices, plan)
        gathered = {k: self._gather(trainer, v) for k, v in local.items()}
        result: Optional[dict[str, Any]] = None
        if trainer.is_global_zero:
            result = {"num_samples": self.num_samples}
            if "image" in gathered:
                result.update(
                    metrics_from_features(
                        gathered["image"], self.image_metrics, self._reference, self._dim, self.kid_subset_size
                    )
                )
                if self._reference is not None:
                    result["num_reference"] = int(self._reference.num_samples)
            if "digits" in gathered:
                result["digits"] = digits_metrics(gathered["digits"], plan(np.arange(self.num_samples)).numpy())
        result = trainer.strategy.broadcast(result, src=0)
        if result is None:  # rank 0 always has the metrics it broadcasts
            raise RuntimeError("GenerationMetrics: no metrics came from rank 0")
        return result

    @staticmethod
    def scalars(result: dict[str, Any]) -> dict[str, float]:
        """The loggable numbers of a :meth:`measure` result."""
        out = {k: float(v) for k, v in result.items() if k in ("fid", "is", "is_std", "kid", "kid_std")}
        if "digits" in result:
            d = result["digits"]
            out["digits_accuracy"] = d["accuracy"]
            for key in ("fd_pixels", "fd_pixels_real_baseline", "fd_svc", "fd_svc_real_baseline"):
                out[f"digits_{key}"] = d["frechet"][key]
        return out

    def _run(self, trainer: L.Trainer, pl_module: Any, prefix: str) -> None:
        result = self.measure(trainer, pl_module)
        # what DiTModule.sample ran: these options over the module's
        ran = self.options.over(SamplingOptions.from_hparams(pl_module.hparams, pl_module.model.in_channels))
        sampling = {
            "labels": self.labels if isinstance(self.labels, str) else list(self.labels),
            **ran.resolved().record(),
            "weights": pl_module.hparams.eval_weights,
        }
        self.last = {**result, "stage": prefix, "sampling": sampling, "global_step": int(trainer.global_step)}
        if prefix != "val":
            self.last["checkpoint"] = str(trainer.ckpt_path) if trainer.ckpt_path else None
        for name, value in self.scalars(result).items():
            # Identical on every rank (computed on rank 0 and broadcast): no reduction needed.
            pl_module.log(f"{prefix}/{name}", value, sync_dist=False, batch_size=self.num_samples)
        if self.output and trainer.is_global_zero:
            # the numbers first: a write that fails (a full disk) must not take them with it
            print(f"{prefix} metrics: " + json.dumps(self.scalars(result), sort_keys=True), flush=True)
            write_json(run_path(self.output, trainer, stage=prefix), self.last)

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._active("test"):
            self._run(trainer, pl_module, "test")

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if "validate" in self.stages and self.metrics and not trainer.sanity_checking:
            self._run(trainer, pl_module, "val")
