"""``dit-lightning prune``: a smaller DiT from a checkpoint, by depth, MLP width and heads
(the scores and the surgery are :mod:`dit_lightning.models.pruning`)."""

from __future__ import annotations

import datetime
from typing import Any, Literal, Optional, Union

import numpy as np
from torch import Tensor

from ..checkpoints import load_dit, save_dit
from ..diffusion import create_diffusion
from ..models.config import model_config
from ..models.dit import SwiGLUFeedForward, mlp_channels, swiglu_hidden
from ..models.flops import DiTShape, dit_macs
from ..models.pruning import (
    block_importance,
    calibration_inputs,
    calibration_loss,
    mlp_activation_scores,
    mlp_channel_scores,
    prune_depth,
    prune_heads,
    prune_mlp,
    select_blocks,
)
from .output import check_new_output


def _mlp_width(model: Any, mlp_ratio: float) -> int:
    """The MLP channels ``mlp_ratio`` gives ``model``'s feed-forward (SwiGLU: two thirds of GELU's)."""
    swiglu = isinstance(model.blocks[0].mlp, SwiGLUFeedForward)
    return swiglu_hidden(model.hidden_size, mlp_ratio) if swiglu else int(model.hidden_size * mlp_ratio)


def _check_request(
    model: Any,
    depth: Optional[int],
    mlp_ratio: Optional[float],
    heads: Optional[int],
    keep_blocks: Optional[list[int]],
    checkpoint: str,
) -> None:
    """Refuse pruning requests that cannot shrink ``model``, naming what it has."""
    blocks, width = len(model.blocks), mlp_channels(model.blocks[0])
    have = f"{checkpoint} has depth {blocks}, {model.num_heads} heads, mlp_ratio {model_config(model)['mlp_ratio']:g}"
    if depth is not None and not 1 <= depth < blocks:
        raise ValueError(f"--depth {depth}: {have}; prune to a depth from 1 to {blocks - 1}")
    if keep_blocks is not None:
        bad = sorted({b for b in keep_blocks if not 0 <= b < blocks})
        if bad or not keep_blocks or len(set(keep_blocks)) >= blocks:
            raise ValueError(
                f"--keep_blocks {keep_blocks}: {have}; keep 1 to {blocks - 1} distinct blocks of 0..{blocks - 1}"
            )
    if heads is not None and not 1 <= heads < model.num_heads:
        raise ValueError(f"--heads {heads}: {have}; keep from 1 to {model.num_heads - 1} heads")
    if mlp_ratio is not None and not 0 < _mlp_width(model, mlp_ratio) < width:
        raise ValueError(
            f"--mlp_ratio {mlp_ratio}: {have}; a smaller ratio (fewer than {width} MLP channels) prunes the MLP"
        )
    if depth is None and keep_blocks is None and heads is None and mlp_ratio is None:
        raise ValueError(f"nothing to prune: {have}; pass --depth, --keep_blocks, --heads and/or --mlp_ratio")


def load_calibration_batch(path: str, size: int = 256, seed: int = 0) -> dict[str, Tensor]:
    """``size`` random samples of a latent store (posterior means, scaled, unflipped), as a
    training batch dict."""
    from ..data.datamodule import LatentBatchDataset

    ds = LatentBatchDataset(path, train=False)
    n = len(ds)
    idx = np.sort(np.random.default_rng(seed).permutation(n)[: min(size, n)])
    return ds.get_batch(idx)


def prune(
    checkpoint: str,
    output: str,
    depth: Optional[int] = None,
    mlp_ratio: Optional[float] = None,
    heads: Optional[int] = None,
    calibration: Optional[str] = None,
    calibration_size: int = 256,
    calibration_draws: int = 4,
    criterion: Literal["l1", "l2", "activation"] = "l1",
    keep_blocks: Optional[list[int]] = None,
    weights: Literal["ema", "model"] = "ema",
    multiple_of: int = 1,
    noise_schedule: Optional[str] = None,
    diffusion_steps: Optional[int] = None,
    seed: int = 0,
    overwrite: bool = False,
) -> str:
    """Prune a DiT checkpoint into a smaller DiT and write it in the reference format.

    Args:
        checkpoint: any supported checkpoint (Lightning, reference ``{model, ema, args}``, raw).
        output: the ``.pt`` file to write; ``init_from`` it to fine-tune (docs/shrinking.md).
        depth: keep this many blocks: the most important by :func:`block_importance` on the
            calibration store; evenly spaced ones when there is no calibration data.
        mlp_ratio: new MLP width ``int(hidden_size * mlp_ratio)`` (the original is 4.0; SwiGLU's is two
            thirds of that, as LightningDiT builds it).
        heads: attention heads to keep per block (head dim unchanged).
        calibration: a latent store (e.g. ``data/digits``) for the data-aware scores.
        calibration_size: samples of the calibration store used for the scores.
        calibration_draws: timestep / noise draws per calibration sample.
        criterion: channel/head score: weight norms ``l1``/``l2``; ``activation`` (MLP only,
            needs calibration) mean |activation| times the L1 norm of the channel's fc2 column.
        keep_blocks: explicit block indices to keep (instead of ``depth``).
        weights: prune the EMA weights (default) or the raw ones; the pruned weights are
            written as both ``model`` and ``ema``, ready to fine-tune.
        multiple_of: round the kept MLP channels down to a multiple of this (8 or 64 suit tensor cores).
        noise_schedule: of the calibration loss ("linear" or "cosine"); default the checkpoint's.
        diffusion_steps: of the calibration loss; default the checkpoint's.
        seed: of the calibration subset, timesteps and noise.
        overwrite: replace an existing ``output`` (otherwise an existing file is an error).
    Returns the output path.

    A request that would not make the network smaller (``depth`` not below the model's, more
    heads or a wider MLP than it has, nothing asked at all) is an error, not an unpruned copy.
    """
    check_new_output(output, overwrite)
    loaded = load_dit(checkpoint, weights=weights)
    model, args = loaded.net, loaded.args
    _check_request(model, depth, mlp_ratio, heads, keep_blocks, checkpoint)
    diffusion = create_diffusion(
        "",
        noise_schedule=noise_schedule or args.get("noise_schedule") or "linear",
        learn_sigma=model.learn_sigma,
        diffusion_steps=diffusion_steps or args.get("diffusion_steps") or 1000,
    )
    if calibration and model.class_token_dim is not None:  # its loss would need REG's noisy class token
        raise ValueError(
            f"--calibration scores blocks and heads by the DDPM loss of a network without inputs beyond the latents; "
            f"{checkpoint} has REG's class token (class_token_dim {model.class_token_dim}): prune it by weight "
            "magnitude (leave --calibration unset)"
        )
    batch = load_calibration_batch(calibration, calibration_size, seed) if calibration else None
    report: dict[str, Any] = {
        "pruned_from": str(checkpoint),
        "weights": weights,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    params_before = sum(p.numel() for p in model.parameters())
    macs_before = dit_macs(DiTShape.of(model))
    if batch is not None:
        inputs = calibration_inputs(batch, diffusion.num_timesteps, calibration_draws, seed)
        report["calibration_loss_before"] = calibration_loss(model, diffusion, inputs)

    keep: Optional[Union[int, list[int]]] = keep_blocks  # explicit indices, else a smaller depth
    if keep is None and depth is not None and depth < len(model.blocks):
        keep = depth
    if keep is not None:
        scores = None
        if keep_blocks is None and batch is not None:
            scores = block_importance(model, diffusion, batch, draws=calibration_draws, seed=seed)
            report["block_importance"] = [round(float(s), 6) for s in scores]
        kept = select_blocks(len(model.blocks), keep, scores)
        report["kept_blocks"] = kept
        model = prune_depth(model, kept)
    if heads is not None and heads < model.num_heads:
        model = prune_heads(model, heads, criterion="l1" if criterion == "activation" else criterion)
    if mlp_ratio is not None:
        channels = _mlp_width(model, mlp_ratio)
        if channels < mlp_channels(model.blocks[0]):
            if criterion == "activation":
                if batch is None:
                    raise ValueError("criterion='activation' needs calibration data")
                mlp_scores = mlp_activation_scores(model, diffusion, batch, draws=calibration_draws, seed=seed)
            else:
                mlp_scores = mlp_channel_scores(model, criterion)
            model = prune_mlp(model, keep_channels=channels, scores=mlp_scores, multiple_of=multiple_of)
    if batch is not None:
        report["calibration_loss_after"] = calibration_loss(model, diffusion, inputs)
    report.update(
        params_before=params_before,
        params_after=sum(p.numel() for p in model.parameters()),
        gmacs_before=macs_before / 1e9,
        gmacs_after=dit_macs(DiTShape.of(model)) / 1e9,
    )
    carry: dict[str, Any] = {k: args[k] for k in ("noise_schedule", "diffusion_steps", "learn_sigma") if k in args}
    save_dit(model, output, ema=model, extra_args={**carry, "pruning": report})
    cfg = model_config(model)
    print(
        f"pruned {checkpoint} -> {output}: depth {cfg['depth']}, mlp_ratio {cfg['mlp_ratio']:.4g}, heads "
        f"{cfg['num_heads']}; "
        f"{report['params_before'] / 1e6:.3f}M -> {report['params_after'] / 1e6:.3f}M parameters"
        + (
            f"; calibration loss {report['calibration_loss_before']:.4f} -> {report['calibration_loss_after']:.4f}"
            if "calibration_loss_after" in report
            else ""
        )
    )
    return str(output)
