"""``dit-lightning sample``: images from a DiT checkpoint into a directory, per-sample
deterministic, distributed and resumable.

Reads any supported checkpoint (Lightning, reference ``{model, ema, opt, args}`` or the released
raw state dict; the architecture comes from :func:`~dit_lightning.checkpoints.load_dit`), samples
class-conditional latents (:func:`~dit_lightning.sampling.sample_latents`), decodes them with the
VAE and writes one PNG per sample, a grid and an ADM-evaluator ``.npz``.

Layout of an output directory::

    sample_config.json   the settings that determine the images (a resume must match them)
    samples/000123-c207.png   sample 123, class 207 (written atomically)
    grid.png             the first ``grid_size`` samples
    samples.npz          key ``arr_0``: uint8 (N, H, W, 3), assembled from the PNGs once all exist
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from torch import nn

from ..atomic import check_writable, make_directory, remove_stale_temporaries, write_json
from ..checkpoints import load_dit
from ..diffusion import DDPMObjective, ObjectiveName, PathType, Prediction, declared_objective
from ..images import existing_samples, save_sample, to_uint8, write_grid, write_npz_from_pngs
from ..latents import LatentTransform
from ..ranks import close_process_group, join_torchrun_group, rank_indices, resolve_device, resolve_rank
from ..sampling import (
    DIFFUSERS_SAMPLERS,
    SAMPLING_OPTION_NAMES,
    LabelSpec,
    ResolvedSamplingOptions,
    SamplingOptions,
    StepLines,
    parse_labels,
    sample_latents,
)
from ..signals import on_stop, safe_points, stop_point
from ..vae import DEFAULT_SCALE_FACTOR, DEFAULT_VAE, decode_latents, is_pixel_space, load_vae

Weights = Literal["ema", "raw"]
# A sample PNG is written in milliseconds: an older temporary file was left by a killed run.
_STALE_TMP_S = 60.0

# Settings that determine the pixels of sample i; a resumed run must match them exactly. The
# objective's are what a network's output means (``TrainingObjective.shared_settings``).
_IMAGE_KEYS = (
    "weights_fingerprint", "weights", "labels", "vae", "scale_factor", "latent_transform", "num_heads", "objective",
    "noise_schedule", "diffusion_steps", "path_type", "prediction", *SAMPLING_OPTION_NAMES,
)  # fmt: skip
# What a setting absent from a sample_config.json meant: the behaviour before it was recorded, which is
# its default (runs before `clip_denoised` never clipped; every run before flow matching was DDPM on the
# linear schedule of 1000 steps, which a flow record does not name).
_IMAGE_KEY_DEFAULTS: dict[str, Any] = {
    **ResolvedSamplingOptions().record(),
    **DDPMObjective().shared_settings(),
}


def weights_fingerprint(net: nn.Module) -> str:
    """A short hash of a few trained tensors: tells two checkpoints apart (a ``last.ckpt``
    overwritten by more training keeps its name and size) without hashing gigabytes."""
    sd = net.state_dict()
    h = hashlib.sha1()
    for name in (
        "final_layer.linear.weight",
        "final_layer.adaLN_modulation.1.weight",
        "y_embedder.embedding_table.weight",
    ):
        h.update(sd[name].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _check_or_write_config(path: Path, config: dict[str, Any]) -> None:
    """Write the run's settings, or check that those of the samples already there are the same (a
    record with no sample beside it, from a run that failed before its first image, is replaced)."""
    if path.exists() and existing_samples(path.parent / "samples"):
        old = json.loads(path.read_text())
        before = {k: old.get(k, _IMAGE_KEY_DEFAULTS.get(k)) for k in _IMAGE_KEYS}
        now = {k: config.get(k, _IMAGE_KEY_DEFAULTS.get(k)) for k in _IMAGE_KEYS}
        diff = {k: (before[k], now[k]) for k in _IMAGE_KEYS if before[k] != now[k]}
        if diff:
            desc = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"{path.parent} holds samples made with other settings ({desc}). Resuming would mix "
                "images of two runs: use another output directory, or delete this one."
            )
        if old.get("num_samples", 0) >= config["num_samples"]:
            return
    write_json(path, config)


def _stopped_note(samples_dir: Path, num_samples: int) -> str:
    """What a signal that stopped the sampling leaves: whole samples, resumed by the same command."""
    have = len(existing_samples(samples_dir))
    if have >= num_samples:
        return f"all {num_samples} samples are in {samples_dir}; run the same command again to write the grid and .npz"
    return (
        f"{have} of {num_samples} samples are in {samples_dir} (each written whole); run the same command again to "
        "resume from there"
    )


def _log(msg: str, enabled: bool) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)


def _chunks(seq: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    for start in range(0, len(seq), size):
        yield seq[start : start + size]


def _check_arguments(**values: Any) -> None:
    """Explicit settings out of range fail before anything is loaded (never a silent default)."""
    least = {"num_steps": 2, "num_samples": 1, "batch_size": 1, "grid_size": 0}
    for name, value in values.items():
        if value is None:
            continue
        if name == "eta":
            if value < 0:
                raise ValueError(f"--eta {value}: the DDIM noise must be >= 0 (0: deterministic)")
        elif value < least[name]:
            hint = " (250 is the paper's; 2 is the fewest a sampler takes)" if name == "num_steps" else ""
            raise ValueError(f"--{name} {value}: must be at least {least[name]}{hint}")


def sample(
    checkpoint: str,
    output: str,
    num_samples: Optional[int] = None,
    labels: LabelSpec = "random",
    batch_size: int = 32,
    weights: Weights = "ema",
    vae: Optional[str] = None,
    scale_factor: Optional[float] = None,
    num_heads: Optional[int] = None,
    device: str = "auto",
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    grid_size: int = 64,
    grid_nrow: Optional[int] = None,
    write_npz: bool = True,
    progress: bool = True,
    objective: Optional[ObjectiveName] = None,
    path_type: Optional[PathType] = None,
    prediction: Optional[Prediction] = None,
    **sampling: Any,
) -> dict[str, Any]:
    """Sample images from a DiT checkpoint into ``output`` (PNGs, grid, ADM ``.npz``).

    How the images are sampled: ``**sampling``, the fields of
    :class:`~dit_lightning.sampling.SamplingOptions` as flat arguments (``--sampler``,
    ``--num_steps``, ``--cfg_scale``, ``--guide_channels``, ``--seed``...); unset ones take the
    Lightning checkpoint's settings, else DDPM-250 without guidance, and pixel stores (``vae``
    "none/pixels") clamp each x_0 estimate to [-1, 1].

    Args:
        checkpoint: Lightning ``.ckpt``, reference ``{model, ema, opt, args}``, a raw state
            dict like the released ``DiT-XL-2-256x256.pt``, a diffusers DiT directory or a
            ``.safetensors`` file; no model config is needed.
        output: directory; rerunning with the same settings resumes (existing PNGs are kept).
        num_samples: images to make (default: one per entry of an explicit label list).
        labels: "random" (keyed on seed and index), "all", "0-9", "1,5,7" or a list; an
            explicit list is cycled: sample i gets ``labels[i % len(labels)]``.
        batch_size: samples per forward (per rank); does not change the images.
        weights: "ema" (default) or "raw" training weights.
        vae: hub id or local directory of a diffusers AutoencoderKL, or "none/pixels" for pixel
            stores; default: the checkpoint's, else sd-vae-ft-ema for 4-channel latents.
        scale_factor: latent scale of a file that records no latent transform (a raw state dict):
            decode ``vae.decode(z / scale_factor)``; given, it replaces the checkpoint's transform.
            Default: the checkpoint's latent transform (its store's: a scale and shift, or
            per-channel statistics), else its ``scale_factor``, else 0.18215 for a VAE.
        num_heads: attention heads, when a raw checkpoint of a custom size does not match hidden/64.
        device: "auto", "cpu", "cuda"; under torchrun each rank takes cuda:LOCAL_RANK.
        rank: this process's rank (default: torch.distributed, then RANK from torchrun); ranks
            may also run as separate jobs with ``rank`` and ``world_size``.
        world_size: the number of processes sharing the samples (default: WORLD_SIZE).
        grid_size: images in grid.png.
        grid_nrow: images per row of grid.png (default: a square).
        write_npz: assemble ``samples.npz`` once every PNG exists (rank 0 after a barrier
            under torchrun; otherwise whichever process finds the set complete).
        progress: print progress to stderr.
        objective: what trained a checkpoint that does not record it (a released raw state dict:
            ``flow`` for SiT's ``SiT-XL-2-256x256.pt``; DDPM when unset). A checkpoint that records its
            objective is sampled as it says, and a contradicting value is refused.
        path_type: the declared flow's interpolant (unset: SiT's ``linear``); its default sampler is SiT's
            ``sde-euler``. A value that contradicts the checkpoint's record is refused.
        prediction: the declared flow's network output (unset: SiT's ``velocity``).
    """
    t_start = time.perf_counter()
    options = SamplingOptions(**sampling)  # jsonargparse reads the flat flags off this call
    _check_arguments(
        num_steps=options.num_steps,
        eta=options.eta,
        num_samples=num_samples,
        batch_size=batch_size,
        grid_size=grid_size,
    )
    check_writable(output, "output directory", "Choose another --output.")  # before the checkpoint is read
    # Ranks given as arguments (separate jobs, tests) need no process group: the last one to
    # finish assembles the npz. Under torchrun we join its group for a final barrier.
    explicit_rank = rank is not None and world_size is not None
    rank, world_size, local_rank = resolve_rank(rank, world_size)
    dev = resolve_device(device, local_rank)
    own_group = join_torchrun_group(world_size, explicit_rank, dev)
    try:
        loaded = load_dit(checkpoint, weights=weights, num_heads=num_heads, device=dev)
        for note in loaded.notes:
            print(f"note: {note}", file=sys.stderr)
        net = loaded.net.requires_grad_(False)
        vae_name = vae or loaded.vae or (DEFAULT_VAE if net.in_channels == 4 else "none/pixels")
        pixels = is_pixel_space(vae_name)
        if pixels and net.in_channels not in (1, 3):
            raise ValueError(f"{net.in_channels}-channel latents need a VAE to decode: pass vae (e.g. {DEFAULT_VAE})")
        if pixels:
            transform = LatentTransform.pixels()
        elif scale_factor is not None:
            transform = LatentTransform.scaled(scale_factor)
        else:
            transform = loaded.latent_transform or LatentTransform.scaled(loaded.scale_factor or DEFAULT_SCALE_FACTOR)
        if transform.kind == "pixels" and not pixels:  # a pixel model decoded through a VAE: said, not guessed
            raise ValueError(
                f"'{loaded.checkpoint.path}' was trained on pixels (no VAE) but vae {vae_name!r} was given: "
                "leave --vae unset (or pass none/pixels)"
            )
        scale = 1.0 if pixels else (transform.scale if transform.kind == "scale" else float(loaded.scale_factor or 1.0))
        trained = declared_objective(
            loaded.objective, objective, path_type, prediction, source=f"checkpoint '{loaded.checkpoint.path}'"
        ).for_network(net.learn_sigma)
        defaults = dict(loaded.sampling_defaults)
        defaults["sampler"] = trained.sampler_for(defaults.get("sampler"), tuple(DIFFUSERS_SAMPLERS))
        model_defaults = SamplingOptions.from_hparams({**defaults, "vae": vae_name}, net.in_channels)
        opts = options.over(model_defaults).resolved()
        trained.check_sampler(opts.sampler, tuple(DIFFUSERS_SAMPLERS))  # before anything is written
        plan = parse_labels(labels, net.num_classes, opts.seed)
        if num_samples is None:
            if plan.classes is None:
                raise ValueError("labels='random' needs num_samples")
            num_samples = len(plan.classes)
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")

        out = Path(output)
        samples_dir = out / "samples"
        make_directory(samples_dir)
        config = {
            "checkpoint": str(checkpoint),
            "weights_fingerprint": weights_fingerprint(net),
            "checkpoint_format": loaded.format,
            "model": {
                k: loaded.config[k]
                for k in ("depth", "hidden_size", "num_heads", "patch_size", "in_channels", "input_size", "num_classes")
            },
            "weights": loaded.weights,
            "labels": plan.describe(),
            "num_samples": int(num_samples),
            **opts.record(),
            # other samplers ignore eta: a resume must not fail on it
            "eta": opts.eta if opts.sampler in ("ddim", "diffusers-ddim") else 0.0,
            "vae": vae_name,
            "scale_factor": scale,
            # a plain scale is said by scale_factor alone (as before transforms were recorded)
            "latent_transform": None
            if transform.kind != "channel_stats" and not transform.shift
            else transform.record(),
            "num_heads": loaded.config["num_heads"],
            **trained.shared_settings(),
        }
        _check_or_write_config(out / "sample_config.json", config)

        remove_stale_temporaries(samples_dir, older_than_s=_STALE_TMP_S)
        done = existing_samples(samples_dir)
        mine = [i for i in rank_indices(num_samples, rank, world_size) if i not in done]
        skipped = len(rank_indices(num_samples, rank, world_size)) - len(mine)
        _log(
            f"rank {rank}/{world_size}: {len(mine)} samples to make, {skipped} already on disk "
            f"({opts.sampler}-{opts.num_steps}, cfg {opts.cfg_scale}, {loaded.weights} weights, "
            f"{opts.precision}, {dev})",
            progress,
        )
        vae_model = None if pixels else load_vae(vae_name, dev)
        t0 = time.perf_counter()
        made = 0
        stopped_note = functools.partial(_stopped_note, samples_dir, int(num_samples))
        # A signal stops at the next denoising step (the batch in progress is dropped) or between
        # batches, never in the middle of writing a batch's PNGs (dit_lightning.signals).
        with safe_points(), on_stop(stopped_note):
            for chunk in _chunks(mine, batch_size):
                stop_point()
                idx = torch.tensor(list(chunk), dtype=torch.long)
                y = plan(idx)
                steps = StepLines(f"rank {rank}: batch of {len(chunk)}") if progress else None  # long batches
                latents = sample_latents(net, y, idx, options=opts, objective=trained, on_step=steps)
                images = to_uint8(decode_latents(latents, vae_model if vae_model is not None else vae_name, transform))
                for k, (i, c) in enumerate(zip(idx.tolist(), y.tolist())):
                    save_sample(images[k], samples_dir, i, c)
                made += len(chunk)
                rate = made / (time.perf_counter() - t0)
                _log(f"rank {rank}: {made}/{len(mine)} ({rate:.2f} images/s)", progress)
        elapsed = time.perf_counter() - t0

        dist = torch.distributed
        grouped = dist.is_available() and dist.is_initialized() and world_size > 1
        if grouped:
            dist.barrier()
        result: dict[str, Any] = {
            "output": str(out),
            "samples_dir": str(samples_dir),
            "num_samples": int(num_samples),
            "rank": rank,
            "world_size": world_size,
            "generated": made,
            "skipped": skipped,
            "images_per_second": made / elapsed if made and elapsed > 0 else None,
            "npz": None,
            "grid": None,
            "complete": False,
        }
        if grouped and rank != 0:
            return result
        done = existing_samples(samples_dir)
        missing = [i for i in range(num_samples) if i not in done]
        if missing:
            _log(f"{len(missing)} of {num_samples} samples still missing (other ranks?): npz not written yet", progress)
            return result
        result["complete"] = True
        paths = [done[i] for i in range(num_samples)]
        with on_stop(stopped_note):
            result["grid"] = str(write_grid(paths[:grid_size], out / "grid.png", nrow=grid_nrow))
            if write_npz:
                npz = write_npz_from_pngs(paths, out / "samples.npz")
                result["npz"] = str(npz)
        _log(f"done in {time.perf_counter() - t_start:.1f}s: {result['npz'] or samples_dir}", progress)
        return result
    finally:
        if own_group:
            close_process_group()
