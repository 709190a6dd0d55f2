"""``dit-lightning evaluate``: sample a checkpoint (as ``dit-lightning sample``), then measure the
images: FID / IS / KID with torchmetrics, or the digits demo's classifier metrics."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from ..atomic import check_writable, write_json
from ..evaluation.digits import digits_metrics_from_samples
from ..evaluation.fid import check_plain_npz, compute_metrics, find_inception_weights, load_inception_state_dict
from ..sampling import SAMPLING_OPTION_NAMES, LabelSpec, SamplingOptions
from ..signals import on_stop
from .sample import Weights
from .sample import sample as run_sampling


def evaluate(
    checkpoint: str,
    output: str,
    reference: Optional[str] = None,
    num_samples: int = 50_000,
    metrics: Union[str, list[str]] = "fid",
    inception_weights: Optional[str] = None,
    feature_extractor: Optional[Callable[[Tensor], Tensor]] = None,
    antialias: bool = False,
    cache_dir: Optional[str] = "auto",
    image_size: Optional[int] = None,
    max_reference: Optional[int] = None,
    labels: LabelSpec = "random",
    batch_size: int = 32,
    weights: Weights = "ema",
    vae: Optional[str] = None,
    device: str = "auto",
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    progress: bool = True,
    **sampling: Any,
) -> Optional[dict[str, Any]]:
    """Sample ``num_samples`` images (as ``dit-lightning sample``: keyed, resumable, multi-rank) and
    measure them; writes ``output/metrics.json`` and returns the metrics (on the process that
    computed them). Settings are checked before sampling starts.

    How the images are sampled: ``**sampling``, the fields of
    :class:`~dit_lightning.sampling.SamplingOptions` as flat arguments (``--sampler``,
    ``--num_steps``, ``--cfg_scale``, ``--guide_channels``, ``--seed``: also the key of the labels...);
    unset ones take the checkpoint's settings, as ``dit-lightning sample``.

    Args:
        checkpoint: any DiT checkpoint (Lightning, reference ``{model, ema, opt, args}``, raw weights).
        output: the sample directory (``dit-lightning sample``'s layout) and ``metrics.json``.
        reference: the real images for FID / KID: an image folder, a latent store (decoded), an
            ``.npz`` of images (``arr_0``) or of statistics (``mu``/``sigma``, e.g. ADM's
            ``VIRTUAL_imagenet256_labeled.npz``).
        num_samples: images to generate and measure (50,000 for the published FID-50K).
        metrics: ``fid``, ``is``, ``kid`` and/or ``digits`` (the digits demo's classifier accuracy and
            Fréchet distances): one name, a comma-separated list (``fid,is``) or a list.
        inception_weights: the InceptionV3 weights file for FID / IS / KID (offline machines);
            default ``$DIT_INCEPTION_WEIGHTS`` or torch hub's checkpoint cache.
        feature_extractor: a module mapping uint8 (N, 3, H, W) images to (N, D) features, used
            instead of Inception (Python API; not for IS).
        antialias: torchmetrics' resize to 299 px; False (TF1-compatible) matches published FIDs.
        cache_dir: where reference statistics are cached ("auto": ``~/.cache/dit-lightning``; None: off).
        image_size: centre-crop size of reference folder images.
        max_reference: use at most this many reference images.
        labels: "random" (uniform, keyed on seed and index: the FID protocol), "all", "0-9",
            "1,5,7" or a list.
        batch_size: samples per forward (per rank); does not change the images.
        weights: "ema" (default) or "raw" training weights.
        vae: the VAE that decodes latents (default: the checkpoint's).
        device: "auto", "cpu" or "cuda" (under torchrun each rank takes cuda:LOCAL_RANK).
        rank: this process's rank (default: torch.distributed, then torchrun's RANK).
        world_size: the number of processes sharing the samples (default: torchrun's WORLD_SIZE).
        progress: print progress and the result.
    """
    options = SamplingOptions(**sampling)  # jsonargparse reads the flat flags off this call
    wanted = [m.strip().lower() for m in (metrics.split(",") if isinstance(metrics, str) else metrics) if m.strip()]
    known = {"fid", "is", "kid", "digits"}
    if not wanted or set(wanted) - known:
        raise ValueError(f"metrics {sorted(set(wanted) - known) or metrics!r}: choose from fid, is, kid, digits")
    extractor = feature_extractor
    if extractor is not None and not isinstance(extractor, nn.Module):
        raise TypeError("feature_extractor must be a torch.nn.Module mapping uint8 (N, 3, H, W) to (N, D)")
    if reference is not None and not os.path.exists(reference):
        raise FileNotFoundError(f"reference {reference} does not exist")
    if reference is not None and reference.endswith(".npz"):
        check_plain_npz(reference)  # before hours of sampling
    inception_needed = any(m in wanted for m in ("fid", "is", "kid")) and feature_extractor is None
    if inception_needed:
        load_inception_state_dict(find_inception_weights(inception_weights))  # checked now, not after hours of sampling
    check_writable(output, "output directory", "Choose another --output.")
    result = run_sampling(
        checkpoint, output, num_samples=num_samples, labels=labels, batch_size=batch_size, weights=weights, vae=vae,
        device=device, rank=rank, world_size=world_size, progress=progress, **dataclasses.asdict(options),
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
    measuring = (
        f"all {num_samples} samples are in {samples_dir}; they were not measured yet: run the same command again "
        "(it measures the samples on disk)"
    )
    with on_stop(lambda: measuring):  # a signal stops the measuring at once: nothing is written before the end
        if image_metrics:
            out.update(
                compute_metrics(
                    samples_dir,
                    reference,
                    image_metrics,
                    inception_weights,
                    extractor,
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
    out["sampling"] = {k: config[k] for k in (*SAMPLING_OPTION_NAMES, "weights", "vae")}
    if progress:  # shown before it is written: a failing write loses nothing
        shown = {k: v for k, v in out.items() if k in ("fid", "is", "is_std", "kid", "kid_std", "num_samples")}
        if "digits" in out:
            d = out["digits"]
            shown["digits_accuracy"] = d["accuracy"]
            shown.update({f"digits_{k}": v for k, v in d["frechet"].items() if k.startswith("fd_")})
        print("metrics: " + json.dumps(shown, sort_keys=True))
    path = write_json(Path(output) / "metrics.json", out)
    if progress:
        print(f"written to {path}")
    return out
