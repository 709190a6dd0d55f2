"""``dit-lightning evaluate``: sample a checkpoint (as ``dit-lightning sample``), then measure the
images: FID / IS / KID with torchmetrics, or the digits demo's classifier metrics."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..atomic import write_json
from ..evaluation.digits import digits_metrics_from_samples
from ..evaluation.fid import compute_metrics, find_inception_weights
from ..precision import SamplingPrecision
from ..sampling import LabelSpec, Sampler
from .sample import Weights
from .sample import sample as run_sampling


def evaluate(
    checkpoint: str,
    output: str,
    reference: Optional[str] = None,
    num_samples: int = 50_000,
    metrics: list[str] = ["fid"],  # noqa: B006 - jsonargparse needs a plain default
    inception_weights: Optional[str] = None,
    feature_extractor: Optional[nn.Module] = None,
    antialias: bool = False,
    cache_dir: Optional[str] = "auto",
    image_size: Optional[int] = None,
    max_reference: Optional[int] = None,
    labels: LabelSpec = "random",
    sampler: Optional[Sampler] = None,
    num_steps: Optional[int] = None,
    eta: float = 0.0,
    cfg_scale: Optional[float] = None,
    guide_channels: Optional[int] = None,
    seed: int = 0,
    batch_size: int = 32,
    precision: SamplingPrecision = "fp32",
    weights: Weights = "ema",
    vae: Optional[str] = None,
    device: str = "auto",
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    progress: bool = True,
) -> Optional[dict[str, Any]]:
    """Sample ``num_samples`` images (resumable, distributed: see ``dit-lightning sample``) and
    measure them: FID / IS / KID with torchmetrics, and "digits" (classifier accuracy and
    Fréchet distances in offline feature spaces, for the digits demo). Writes
    ``output/metrics.json``; returns the metrics on the process that computed them.

    ``reference``: an image folder, a latent store (decoded), an ``.npz`` of images (``arr_0``)
    or of statistics (``mu``/``sigma``, e.g. ADM's ``VIRTUAL_imagenet256_labeled.npz``).
    ``inception_weights``: the local InceptionV3 weights file (offline machines).
    The Inception and reference settings are checked before sampling starts.
    """
    wanted = [m.lower() for m in metrics]
    inception_needed = any(m in wanted for m in ("fid", "is", "kid")) and feature_extractor is None
    if inception_needed:
        find_inception_weights(inception_weights)  # fail now, not after hours of sampling
    if reference is not None and not os.path.exists(reference):
        raise FileNotFoundError(f"reference {reference} does not exist")
    result = run_sampling(
        checkpoint, output, num_samples=num_samples, labels=labels, sampler=sampler, num_steps=num_steps, eta=eta,
        cfg_scale=cfg_scale, guide_channels=guide_channels, seed=seed, batch_size=batch_size, precision=precision,
        weights=weights, vae=vae, device=device, rank=rank, world_size=world_size, progress=progress,
    )  # fmt: skip
    if not result["complete"]:
        return None  # another rank finishes the set and measures it
    dev = str(
        torch.device("cuda", 0)
        if device == "auto" and torch.cuda.is_available()
        else ("cpu" if device == "auto" else device)
    )
    samples_dir = result["samples_dir"]
    out: dict[str, Any] = {"samples": result["npz"] or samples_dir, "reference": reference}
    image_metrics = [m for m in wanted if m != "digits"]
    if image_metrics:
        out.update(
            compute_metrics(
                samples_dir,
                reference,
                image_metrics,
                inception_weights,
                feature_extractor,
                antialias,
                cache_dir,
                image_size=image_size,
                max_samples=num_samples,
                max_reference=max_reference,
                device=dev,
            )  # fmt: skip
        )
    if "digits" in wanted:
        out["digits"] = digits_metrics_from_samples(samples_dir, limit=num_samples)
    config = json.loads((Path(output) / "sample_config.json").read_text())
    out["sampling"] = {
        k: config[k] for k in ("sampler", "num_steps", "cfg_scale", "guide_channels", "seed", "weights", "vae")
    }
    write_json(Path(output) / "metrics.json", out)
    if progress:
        shown = {k: v for k, v in out.items() if k in ("fid", "is", "kid", "num_samples", "num_reference")}
        print(f"metrics: {json.dumps(shown)} -> {Path(output) / 'metrics.json'}")
    return out
