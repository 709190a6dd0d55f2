"""How good are the images the model generates? FID / IS / KID and the digits metrics, logged by
``dit-lightning test`` (and, if asked, after every validation)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal, Optional, cast

import lightning as L
import numpy as np
import torch
from torch import Tensor, nn

from ..atomic import write_json
from ..evaluation.digits import digits_metrics, uint8_digit_features
from ..evaluation.fid import FeatureStats, build_extractor, metrics_from_features, reference_stats
from ..evaluation.options import STORE_REFERENCE, Metric, MetricOptions, metric_names
from ..images import to_uint8
from ..models import DiT
from ..sampling import LabelPlan, LabelSpec, SamplingOptions, parse_labels
from ..vae import is_pixel_space
from .checkpoint import run_path

Stage = Literal["test", "validate"]


class GenerationMetrics(L.Callback):
    """Samples ``num_samples`` class-conditional images from the module's evaluation weights and
    logs how good they are, as ``test/fid``, ``test/is``, ``test/kid``, ``test/digits_accuracy``...

    - ``"fid"``, ``"kid"``, ``"is"``: torchmetrics on InceptionV3 features (or ``feature_extractor``)
      against ``reference``; the same computation as ``dit-lightning evaluate``.
    - ``"digits"``: the digits demo's offline metrics: the accuracy of an independent classifier on
      the requested classes, and Fréchet distances in pixel and classifier space next to the
      real-vs-real floor (``dit_lightning.evaluation.digits``).

    The options (``**options``): :class:`~dit_lightning.evaluation.MetricOptions`' fields as flat
    arguments, the same as ``dit-lightning evaluate``'s: what is measured against what
    (``num_samples``, ``reference``, ``inception_weights``, ``labels``...) and how the images are
    sampled (the fields of :class:`~dit_lightning.sampling.SamplingOptions`: ``sampler``,
    ``num_steps``, ``cfg_scale``, ``guide_channels``, ``seed``...: ``--evaluation.cfg_scale``; unset
    ones take the module's). Sample ``i`` is keyed on ``(seed, i)`` as in ``dit-lightning sample``
    (its label under ``labels="random"``, its initial and per-step noise). Rank ``r`` of ``W`` makes
    samples ``r, r + W, ...``; the features of all ranks are gathered in index order, so the numbers
    do not depend on the number of devices or the batch size. Every check (metric names, Inception
    weights on disk, the reference, a digits model for ``"digits"``) runs in ``setup``, before the
    first batch, and reference statistics are computed there once (and cached).

    Args:
        metrics: any of "fid", "is", "kid", "digits"; empty: nothing is sampled.
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
        batch_size: int = 64,
        stages: list[Stage] = ["test"],  # noqa: B006
        output: Optional[str] = None,
        **options: Any,
    ) -> None:
        self.measured = MetricOptions(**options)  # jsonargparse reads the flat init args off this call
        self.options = self.measured.sampling
        self.metrics: list[str] = list(metric_names(metrics))
        self.image_metrics = [m for m in self.metrics if m != "digits"]
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

    @property
    def num_samples(self) -> int:
        return self.measured.num_samples

    @property
    def labels(self) -> LabelSpec:
        return self.measured.labels

    # ---- set-up: every check before any work ---------------------------------------------
    def _active(self, stage: Optional[str]) -> bool:
        if not self.metrics:
            return False
        return (stage == "test" and "test" in self.stages) or (
            stage in ("fit", "validate") and "validate" in self.stages
        )

    def check(self, pl_module: L.LightningModule) -> None:
        """Raise a clear error for settings that cannot be measured (called in ``setup``)."""
        self.measured.check(self.metrics)  # metric names, the reference, the sample count, the Inception weights
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

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self._active(stage):
            return
        self.check(pl_module)
        if not self.image_metrics:
            return
        device = trainer.strategy.root_device
        m = self.measured
        extractor, self._dim = build_extractor(
            self.image_metrics, m.inception_weights, cast(Optional[nn.Module], m.feature_extractor), m.antialias
        )
        self._extractor = extractor.to(device).eval()
        if m.reference is None or not ("fid" in self.metrics or "kid" in self.metrics):
            return
        reference, indices = m.reference, None
        if reference == STORE_REFERENCE:
            reference, indices = self._held_out(trainer)  # on every rank: a bad setting stops them all
        if trainer.is_global_zero:
            # Rank 0 alone holds the reference: the metrics are computed there.
            self._reference = reference_stats(
                reference, self._extractor, m.cache_dir, self.batch_size, m.image_size, m.max_reference,
                keep_features="kid" in self.metrics, device=device, dim=self._dim, indices=indices,
            )  # fmt: skip

    @staticmethod
    def _held_out(trainer: L.Trainer) -> tuple[str, np.ndarray]:
        """``reference="store"``: the store of the run's data module and its held-out items (the
        validation split, set up before the callbacks: Lightning sets the data module up first)."""
        data = getattr(trainer, "datamodule", None)
        path, held_out = getattr(data, "path", None), getattr(data, "val_indices", None)
        if path is None:
            raise ValueError(
                "--evaluation.reference store measures against the held-out split of the run's latent store "
                "(a LatentDataModule); this run has none: give the reference's path instead"
            )
        if held_out is None or len(held_out) < 2:
            raise ValueError(
                f"--evaluation.reference store measures against the held-out split of {path}, and the data module "
                "holds out fewer than 2 items: set --data.val_size (the fit's, e.g. 0.1) so that training never "
                "saw them"
            )
        return str(path), np.asarray(held_out)

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
                        gathered["image"], self.image_metrics, self._reference, self._dim, self.measured.kid_subset_size
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
