"""``dit-lightning evaluate``: sample a checkpoint (as ``dit-lightning sample``), then measure the
images: FID / IS / KID with torchmetrics, or the digits demo's classifier metrics."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional, Union, cast

import torch
from torch import nn

from ..atomic import check_writable, write_json
from ..evaluation.digits import digits_metrics_from_samples
from ..evaluation.fid import compute_metrics
from ..evaluation.options import STORE_REFERENCE, MetricOptions, metric_names
from ..sampling import SAMPLING_OPTION_NAMES
from ..signals import on_stop
from .sample import Weights
from .sample import sample as run_sampling


def evaluate(
    checkpoint: str,
    output: str,
    metrics: Union[str, list[str]] = "fid",
    batch_size: int = 32,
    weights: Weights = "ema",
    vae: Optional[str] = None,
    device: str = "auto",
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    progress: bool = True,
    **options: Any,
) -> Optional[dict[str, Any]]:
    """Sample ``num_samples`` images (as ``dit-lightning sample``: keyed, resumable, multi-rank) and
    measure them; writes ``output/metrics.json`` and returns the metrics (on the process that
    computed them). Settings are checked before sampling starts.

    The options (``**options``): :class:`~dit_lightning.evaluation.MetricOptions`' fields as flat
    flags, the same as the ``test`` stage's (``--evaluation.*``): what is measured against what
    (``--num_samples``, ``--reference``, ``--inception_weights``, ``--labels``...) and how the images
    are sampled (the fields of :class:`~dit_lightning.sampling.SamplingOptions`: ``--sampler``,
    ``--num_steps``, ``--cfg_scale``, ``--guide_channels``, ``--seed``: also the key of the labels...;
    unset ones take the checkpoint's settings, as ``dit-lightning sample``).

    Args:
        checkpoint: any DiT checkpoint (Lightning, reference ``{model, ema, opt, args}``, raw weights).
        output: the sample directory (``dit-lightning sample``'s layout) and ``metrics.json``.
        metrics: ``fid``, ``is``, ``kid`` and/or ``digits`` (the digits demo's classifier accuracy and
            Fréchet distances): one name, a comma-separated list (``fid,is``) or a list.
        batch_size: samples per forward (per rank); does not change the images.
        weights: "ema" (default) or "raw" training weights.
        vae: the VAE that decodes latents (default: the checkpoint's).
        device: "auto", "cpu" or "cuda" (under torchrun each rank takes cuda:LOCAL_RANK).
        rank: this process's rank (default: torch.distributed, then torchrun's RANK).
        world_size: the number of processes sharing the samples (default: torchrun's WORLD_SIZE).
        progress: print progress and the result.
    """
    measured = MetricOptions(**options)  # jsonargparse reads the flat flags off this call
    wanted = metric_names(metrics)
    if not wanted:
        raise ValueError(f"metrics {metrics!r}: name at least one of fid, is, kid, digits")
    if measured.reference == STORE_REFERENCE:
        raise ValueError(
            "--reference store means the held-out split of a run's data store (`dit-lightning test "
            "--evaluation.reference store`); evaluate has no run: "
            "give the reference's path (a store, a folder, an .npz)"
        )
    measured.check(wanted)  # the reference, the sample count, the Inception weights: before hours of sampling
    reference, num_samples, extractor = measured.reference, measured.num_samples, measured.feature_extractor
    check_writable(output, "output directory", "Choose another --output.")
    result = run_sampling(
        checkpoint, output, num_samples=num_samples, labels=measured.labels, batch_size=batch_size, weights=weights,
        vae=vae, device=device, rank=rank, world_size=world_size, progress=progress,
        **dataclasses.asdict(measured.sampling),
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
                    measured.inception_weights,
                    cast(Optional[nn.Module], extractor),
                    measured.antialias,
                    measured.cache_dir,
                    image_size=measured.image_size,
                    max_samples=num_samples,
                    max_reference=measured.max_reference,
                    kid_subset_size=measured.kid_subset_size,
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
