"""Structured pruning of a DiT: fewer blocks, fewer MLP channels, fewer attention heads.

Every function returns a *new, smaller* :class:`~dit_lightning.models.dit.DiT` built from its
new configuration and loaded with ``strict=True``: no masks, no zeroed rows left behind, so
the parameter count, the MACs (``flops.py``) and the speed really shrink and the result saves
and loads like any DiT of its shape.

What is removed is chosen by a stated importance score:

* blocks (:func:`block_importance`): the increase of the diffusion loss on a calibration
  batch, with fixed timesteps and noise, when the block is replaced by the identity;
* MLP channels (:func:`mlp_channel_scores`): ``|fc1 row j| * |fc2 column j|`` (L1 or L2), the
  size of the channel's path through the block, or its mean |activation| on a calibration
  batch times ``|fc2 column j|``;
* attention heads (:func:`head_scores`): ``|W_v rows of head h| * |proj columns of head h|``,
  the size of the head's path to the residual stream.

A channel or head whose output weights are zero scores zero, so it is removed first and its
removal leaves the outputs exactly unchanged.

Pure PyTorch (no Lightning). The ``prune`` function is the ``dit-lightning prune`` tool.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor, nn

from .checkpoint import StateDict, atomic_torch_save, infer_dit_config, read_checkpoint, to_reference_format
from .dit import DiT, dit_config

Criterion = Literal["l1", "l2"]

# DiT constructor arguments that define the architecture (activation checkpointing does not).
_ARCH_KEYS = (
    "input_size",
    "patch_size",
    "in_channels",
    "hidden_size",
    "depth",
    "num_heads",
    "mlp_ratio",
    "class_dropout_prob",
    "num_classes",
    "learn_sigma",
    "qk_norm",
)


# --------------------------------------------------------------------------------------
# Configurations: of a live model, of a checkpoint, and building a model from one
# --------------------------------------------------------------------------------------


def model_config(model: DiT) -> dict[str, Any]:
    """The constructor arguments that rebuild ``model``'s architecture (``attn_dim``, the width
    of q/k/v, only when it differs from ``hidden_size``, i.e. after head pruning)."""
    attn = model.blocks[0].attn if len(model.blocks) else None
    cfg: dict[str, Any] = {
        "input_size": model.input_size,
        "patch_size": model.patch_size,
        "in_channels": model.in_channels,
        "hidden_size": model.hidden_size,
        "depth": len(model.blocks),
        "num_heads": model.num_heads,
        "mlp_ratio": mlp_ratio_for(model.hidden_size, model.blocks[0].mlp.fc1.out_features) if len(model.blocks) else model.mlp_ratio,
        "class_dropout_prob": model.class_dropout_prob,
        "num_classes": model.num_classes,
        "learn_sigma": model.learn_sigma,
        "qk_norm": attn is not None and isinstance(attn.q_norm, nn.LayerNorm),
    }
    if attn is not None and attn.num_heads * attn.head_dim != model.hidden_size:
        cfg["attn_dim"] = int(attn.num_heads * attn.head_dim)
    return cfg


def build_from_config(cfg: dict[str, Any], device: Any = None, dtype: Optional[torch.dtype] = None) -> DiT:
    """A freshly initialised DiT of configuration ``cfg`` (as :func:`model_config` returns,
    ``attn_dim`` of head-pruned models included)."""
    cfg = {k: v for k, v in cfg.items() if k in _ARCH_KEYS or k in ("activation_checkpointing", "attn_dim")}
    return DiT(**cfg).to(device=device, dtype=dtype)


def _rebuild(model: DiT, cfg: dict[str, Any], sd: StateDict) -> DiT:
    """The new model of configuration ``cfg`` holding ``sd``, on ``model``'s device and dtype,
    in ``model``'s train/eval mode."""
    p = next(model.parameters())
    with torch.device("meta"):
        new = build_from_config(cfg)
    # Built on meta and allocated empty: no time spent initialising weights that the strict
    # load (pos_embed included) overwrites anyway.
    new = new.to_empty(device=p.device).to(p.dtype)
    new.load_state_dict(sd, strict=True)
    new.requires_grad_(True)
    new.pos_embed.requires_grad_(False)
    return new.train(model.training)


def checkpoint_dit_config(ckpt: dict[str, Any], sd: Optional[StateDict] = None) -> dict[str, Any]:
    """The architecture of a checkpoint read by :func:`read_checkpoint`.

    Shapes come from the weights (:func:`infer_dit_config`); what weights cannot tell comes
    from the recorded arguments when there are any: ``num_heads`` (Lightning hyper-parameters,
    :func:`save_pruned`), else the heads of the named ``model``, else ``args["model_config"]``
    (``dit-lightning export``); likewise ``class_dropout_prob``. The number of heads matters:
    it changes the outputs without changing any shape.
    """
    sd = sd if sd is not None else ckpt["model"]
    cfg = infer_dit_config(sd)
    # fc1 rows / hidden can round below the exact ratio (e.g. 61 / 56): DiT would build one
    # channel fewer from it, so take the ratio that rebuilds the stored width.
    cfg["mlp_ratio"] = mlp_ratio_for(cfg["hidden_size"], sd["blocks.0.mlp.fc1.weight"].shape[0])
    inner = sd["blocks.0.attn.qkv.weight"].shape[0] // 3 if "blocks.0.attn.qkv.weight" in sd else cfg["hidden_size"]
    args = ckpt.get("args") or {}
    recorded = args.get("model_config") if isinstance(args.get("model_config"), dict) else {}
    # Heads: a top-level num_heads is what the run was configured with (Lightning hparams, or
    # save_pruned); a named model implies its heads; a recorded model_config comes last since
    # `export` fills it from infer_dit_config, which can only guess heads.
    heads: Optional[int] = None
    if args.get("num_heads"):
        heads = int(args["num_heads"])
    elif isinstance(args.get("model"), str) and args["model"] != "custom":
        try:
            heads = dit_config(args["model"])["num_heads"]
        except ValueError:
            heads = None
    if heads is None and recorded.get("num_heads"):
        heads = int(recorded["num_heads"])
    dropout = args.get("class_dropout_prob", recorded.get("class_dropout_prob"))
    if dropout is not None:
        cfg["class_dropout_prob"] = float(dropout)
    if cfg["class_dropout_prob"] == 0.0:
        # No null row in the label table then: num_classes = rows (infer assumed rows - 1).
        cfg["num_classes"] = sd["y_embedder.embedding_table.weight"].shape[0]
    if heads is not None:
        cfg["num_heads"] = heads
    elif inner != cfg["hidden_size"] and "attn_dim" not in cfg:  # guess as infer_dit_config does
        cfg["num_heads"] = max(1, inner // 64)
    if inner != cfg["hidden_size"]:
        if inner % cfg["num_heads"]:
            raise ValueError(f"attention width {inner} is not divisible by num_heads {cfg['num_heads']}")
        cfg["attn_dim"] = inner
    return cfg


def load_dit(path: str, weights: Literal["ema", "model"] = "ema") -> tuple[DiT, dict[str, Any]]:
    """(model, checkpoint) for any supported checkpoint, its architecture recovered with
    :func:`checkpoint_dit_config`; ``weights="ema"`` falls back to the raw weights if the file
    has no EMA. The model is in eval mode."""
    ckpt = read_checkpoint(path)
    sd = ckpt["ema"] if weights == "ema" and ckpt["ema"] else ckpt["model"]
    cfg = checkpoint_dit_config(ckpt, sd)
    with torch.device("meta"):
        model = build_from_config(cfg)
    model = model.to_empty(device="cpu")
    model.load_state_dict(sd, strict=True)
    model.pos_embed.requires_grad_(False)
    return model.eval(), ckpt


def save_pruned(
    model: DiT, path: str, ema: Optional[DiT] = None, extra_args: Optional[dict[str, Any]] = None
) -> str:
    """Write ``model`` in the reference format ``{model, ema, args}`` with its configuration in
    ``args["model_config"]`` (what :func:`checkpoint_dit_config` reads back) and the flat DiT
    arguments (``depth``, ``mlp_ratio``...) next to it, so ``init_from`` and ``export`` read it."""
    cfg = model_config(model)
    args: dict[str, Any] = {"model": "custom", **cfg, "model_config": cfg, **(extra_args or {})}
    ema_sd = ema.state_dict() if ema is not None else None
    atomic_torch_save(to_reference_format(model.state_dict(), ema_sd, args=args), path)
    return str(path)


# --------------------------------------------------------------------------------------
# Calibration: the diffusion loss at fixed timesteps and noise
# --------------------------------------------------------------------------------------


def calibration_inputs(
    batch: dict[str, Tensor], num_timesteps: int, draws: int = 1, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x, y, t, noise) for a calibration batch, repeated ``draws`` times with independent
    timesteps and noise from a seeded generator: every model scored sees the same inputs."""
    x, y = batch["x"], batch["y"]
    x = x.repeat(draws, *([1] * (x.ndim - 1)))
    y = y.repeat(draws)
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, num_timesteps, (x.shape[0],), generator=g).to(x.device)
    noise = torch.randn(x.shape, generator=g).to(device=x.device, dtype=x.dtype)
    return x, y, t, noise


@torch.no_grad()
def calibration_loss(model: nn.Module, diffusion: Any, inputs: tuple[Tensor, Tensor, Tensor, Tensor], chunk: int = 256) -> float:
    """Mean diffusion loss (the hybrid loss with a learned variance) of ``model`` in eval mode
    on fixed calibration inputs, computed in chunks to bound memory."""
    x, y, t, noise = inputs
    was = model.training
    model.eval()
    total = 0.0
    for s in range(0, len(x), chunk):
        sl = slice(s, s + chunk)
        terms = diffusion.training_losses(model, x[sl], t[sl], model_kwargs={"y": y[sl]}, noise=noise[sl])
        total += float(terms["loss"].double().sum())
    model.train(was)
    return total / len(x)


@torch.no_grad()
def block_importance(
    model: DiT, diffusion: Any, batch: dict[str, Tensor], draws: int = 1, seed: int = 0
) -> Tensor:
    """(depth,) importance of each block: the calibration loss with the block skipped (its
    output replaced by its input, the identity) minus the loss of the full model. Timesteps and
    noise are drawn once (``seed``) so all blocks are compared on the same inputs. A block can
    score below zero: the model was better without it on this batch."""
    inputs = calibration_inputs(batch, diffusion.num_timesteps, draws=draws, seed=seed)
    base = calibration_loss(model, diffusion, inputs)
    scores = []
    for block in model.blocks:
        handle = block.register_forward_hook(lambda _m, args, _out: args[0])  # skip: x -> x
        try:
            scores.append(calibration_loss(model, diffusion, inputs) - base)
        finally:
            handle.remove()
    return torch.tensor(scores, dtype=torch.float64)


# --------------------------------------------------------------------------------------
# Depth
# --------------------------------------------------------------------------------------


def select_blocks(depth: int, keep: Union[int, Sequence[int]], scores: Optional[Tensor] = None) -> list[int]:
    """The sorted block indices to keep: explicit indices, or the ``keep`` highest-scoring
    blocks, or (no scores) ``keep`` evenly spaced blocks including the first and the last."""
    if isinstance(keep, int):
        if not 1 <= keep <= depth:
            raise ValueError(f"keep={keep} blocks: the model has {depth}, choose 1..{depth}")
        if scores is not None:
            if len(scores) != depth:
                raise ValueError(f"{len(scores)} scores for {depth} blocks")
            # Stable order on ties: the earlier block wins.
            order = sorted(range(depth), key=lambda i: (-float(scores[i]), i))
            return sorted(order[:keep])
        if keep == 1:
            return [depth - 1]
        return sorted({round(i * (depth - 1) / (keep - 1)) for i in range(keep)})
    indices = [int(i) for i in keep]
    if not indices:
        raise ValueError("keep at least one block")
    if len(set(indices)) != len(indices) or any(not 0 <= i < depth for i in indices):
        raise ValueError(f"keep={indices}: block indices must be distinct and in 0..{depth - 1}")
    return sorted(indices)


def prune_depth(model: DiT, keep: Union[int, Sequence[int]], scores: Optional[Tensor] = None) -> DiT:
    """A DiT with only the blocks ``keep`` (indices, in their order) or the ``keep`` most
    important blocks by ``scores`` (e.g. :func:`block_importance`); every other weight is
    copied. Equals running the original with the dropped blocks skipped."""
    kept = select_blocks(len(model.blocks), keep, scores)
    sd = {}
    for k, v in model.state_dict().items():
        if k.startswith("blocks."):
            _, i, rest = k.split(".", 2)
            if int(i) in kept:
                sd[f"blocks.{kept.index(int(i))}.{rest}"] = v.clone()
        else:
            sd[k] = v.clone()
    cfg = model_config(model)
    cfg["depth"] = len(kept)
    return _rebuild(model, cfg, sd)


# --------------------------------------------------------------------------------------
# MLP channels
# --------------------------------------------------------------------------------------


def _norm(w: Tensor, dim: int, criterion: str) -> Tensor:
    if criterion == "l1":
        return w.abs().sum(dim)
    if criterion == "l2":
        return w.pow(2).sum(dim).sqrt()
    raise ValueError(f"unknown criterion {criterion!r}: use 'l1' or 'l2' (or pass scores)")


@torch.no_grad()
def mlp_channel_scores(model: DiT, criterion: Criterion = "l1") -> list[Tensor]:
    """Per block, the (mlp_hidden,) importance of each channel: ``|fc1 row j| * |fc2 col j|``."""
    out = []
    for block in model.blocks:
        fc1, fc2 = block.mlp.fc1.weight.float(), block.mlp.fc2.weight.float()
        out.append(_norm(fc1, 1, criterion) * _norm(fc2, 0, criterion))
    return out


@torch.no_grad()
def mlp_activation_scores(model: DiT, diffusion: Any, batch: dict[str, Tensor], draws: int = 1, seed: int = 0) -> list[Tensor]:
    """Per block, mean |GELU output of channel j| on calibration inputs times ``|fc2 col j|_1``:
    the channel's typical contribution to the residual stream (data-aware)."""
    sums = [torch.zeros(b.mlp.fc1.out_features, dtype=torch.float64) for b in model.blocks]
    count = [0]
    handles = []
    for i, block in enumerate(model.blocks):

        def hook(_m, _args, out, i=i):
            sums[i] += out.detach().abs().double().sum(dim=(0, 1)).cpu()
            if i == 0:
                count[0] += out.shape[0] * out.shape[1]

        handles.append(block.mlp.act.register_forward_hook(hook))
    try:
        calibration_loss(model, diffusion, calibration_inputs(batch, diffusion.num_timesteps, draws=draws, seed=seed))
    finally:
        for h in handles:
            h.remove()
    return [(s / max(count[0], 1)).float() * b.mlp.fc2.weight.detach().float().abs().sum(0).cpu() for s, b in zip(sums, model.blocks)]


def mlp_ratio_for(hidden_size: int, channels: int) -> float:
    """A float ``r`` with ``int(hidden_size * r) == channels`` exactly (what DiT and
    ``infer_dit_config`` compute), nudged by an ulp where ``channels / hidden_size`` rounds low."""
    r = channels / hidden_size
    while int(hidden_size * r) < channels:
        r = math.nextafter(r, math.inf)
    if int(hidden_size * r) != channels:
        raise ValueError(f"no mlp_ratio gives {channels} channels at hidden_size {hidden_size}")
    return r


def prune_mlp(
    model: DiT,
    keep_ratio: Optional[float] = None,
    keep_channels: Optional[int] = None,
    criterion: Criterion = "l1",
    scores: Optional[Sequence[Tensor]] = None,
    multiple_of: int = 1,
) -> DiT:
    """A DiT whose MLPs keep ``keep_channels`` hidden channels per block (or the fraction
    ``keep_ratio``, rounded down to ``multiple_of``, e.g. 8 or 64 for tensor cores), the most
    important ones by ``scores`` (default :func:`mlp_channel_scores` with ``criterion``).
    The count is the same in every block (one ``mlp_ratio``); which channels differ per block."""
    mlp_hidden = model.blocks[0].mlp.fc1.out_features
    if (keep_ratio is None) == (keep_channels is None):
        raise ValueError("give exactly one of keep_ratio and keep_channels")
    if keep_channels is None:
        keep_channels = int(mlp_hidden * keep_ratio)
    keep_channels = max(multiple_of, keep_channels // multiple_of * multiple_of)
    if not 1 <= keep_channels <= mlp_hidden:
        raise ValueError(f"keep_channels={keep_channels}: the MLPs have {mlp_hidden} channels, choose 1..{mlp_hidden}")
    scores = list(scores) if scores is not None else mlp_channel_scores(model, criterion)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for i, block in enumerate(model.blocks):
        s = scores[i].float().cpu()
        # Highest scores first; ties keep the lower index (so "keep all" is the identity order).
        order = torch.argsort(-s, stable=True)[:keep_channels]
        idx = torch.sort(order).values.to(block.mlp.fc1.weight.device)
        p = f"blocks.{i}.mlp."
        sd[p + "fc1.weight"] = sd[p + "fc1.weight"][idx].clone()
        sd[p + "fc1.bias"] = sd[p + "fc1.bias"][idx].clone()
        sd[p + "fc2.weight"] = sd[p + "fc2.weight"][:, idx].clone()
    cfg = model_config(model)
    cfg["mlp_ratio"] = mlp_ratio_for(model.hidden_size, keep_channels)
    return _rebuild(model, cfg, sd)


# --------------------------------------------------------------------------------------
# Attention heads
# --------------------------------------------------------------------------------------


@torch.no_grad()
def head_scores(model: DiT, criterion: Criterion = "l1") -> list[Tensor]:
    """Per block, the (num_heads,) importance of each head: ``|W_v rows of h| * |proj cols of h|``.
    (q and k only shape where a head looks; its output goes through v and proj.)"""
    out = []
    for block in model.blocks:
        attn = block.attn
        h, hd = attn.num_heads, attn.head_dim
        inner = h * hd
        wv = attn.qkv.weight.float()[2 * inner : 3 * inner].reshape(h, hd, -1)
        wp = attn.proj.weight.float().reshape(-1, h, hd).transpose(0, 1)  # (h, dim, hd)
        if criterion == "l1":
            out.append(wv.abs().sum((1, 2)) * wp.abs().sum((1, 2)))
        elif criterion == "l2":
            out.append(wv.pow(2).sum((1, 2)).sqrt() * wp.pow(2).sum((1, 2)).sqrt())
        else:
            raise ValueError(f"unknown criterion {criterion!r}: use 'l1' or 'l2' (or pass scores)")
    return out


def prune_heads(
    model: DiT, keep_heads: int, criterion: Criterion = "l1", scores: Optional[Sequence[Tensor]] = None
) -> DiT:
    """A DiT whose attention keeps ``keep_heads`` heads per block (the most important by
    ``scores``, default :func:`head_scores`). The head dimension stays, so the attention width
    becomes ``keep_heads * head_dim`` while the residual width ``hidden_size`` is unchanged:
    qkv shrinks to (3 * inner, hidden) and proj to (hidden, inner)."""
    heads = model.blocks[0].attn.num_heads
    hd = model.blocks[0].attn.head_dim
    if not 1 <= keep_heads <= heads:
        raise ValueError(f"keep_heads={keep_heads}: the model has {heads} heads, choose 1..{heads}")
    scores = list(scores) if scores is not None else head_scores(model, criterion)
    inner = heads * hd
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for i, block in enumerate(model.blocks):
        order = torch.argsort(-scores[i].float().cpu(), stable=True)[:keep_heads]
        kept = torch.sort(order).values
        cols = (kept[:, None] * hd + torch.arange(hd)[None]).reshape(-1)  # positions in one of q/k/v
        rows = torch.cat([cols + s * inner for s in range(3)]).to(block.attn.qkv.weight.device)
        cols = cols.to(rows.device)
        p = f"blocks.{i}.attn."
        sd[p + "qkv.weight"] = sd[p + "qkv.weight"][rows].clone()
        sd[p + "qkv.bias"] = sd[p + "qkv.bias"][rows].clone()
        sd[p + "proj.weight"] = sd[p + "proj.weight"][:, cols].clone()
    cfg = model_config(model)
    cfg["num_heads"] = keep_heads
    if keep_heads * hd != model.hidden_size:
        cfg["attn_dim"] = keep_heads * hd
    else:
        cfg.pop("attn_dim", None)
    return _rebuild(model, cfg, sd)


# --------------------------------------------------------------------------------------
# The tool
# --------------------------------------------------------------------------------------


def load_calibration_batch(path: str, size: int = 256, seed: int = 0) -> dict[str, Tensor]:
    """``size`` random samples of a latent store (posterior means, scaled, unflipped), as a
    training batch dict."""
    import numpy as np

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
) -> str:
    """Prune a DiT checkpoint into a smaller DiT and write it in the reference format.

    Args:
        checkpoint: any supported checkpoint (Lightning, reference ``{model, ema, args}``, raw).
        output: the ``.pt`` file to write; ``init_from`` it to fine-tune (docs/shrinking.md).
        depth: keep this many blocks: the most important by :func:`block_importance` on the
            calibration store; evenly spaced ones when there is no calibration data.
        mlp_ratio: new MLP width ``int(hidden_size * mlp_ratio)`` (the original is 4.0).
        heads: attention heads to keep per block (head dim unchanged).
        calibration: a latent store (e.g. ``data/digits``) for the data-aware scores.
        calibration_size, calibration_draws: samples, and timestep/noise draws per sample.
        criterion: channel/head score: weight norms ``l1``/``l2``; ``activation`` (MLP only,
            needs calibration) mean |activation| times the L1 norm of the channel's fc2 column.
        keep_blocks: explicit block indices to keep (instead of ``depth``).
        weights: prune the EMA weights (default) or the raw ones; the pruned weights are
            written as both ``model`` and ``ema``, ready to fine-tune.
        noise_schedule, diffusion_steps: of the calibration loss; default the checkpoint's.
        seed: of the calibration subset, timesteps and noise.
    Returns the output path.
    """
    from ..diffusion import create_diffusion
    from .flops import DiTShape, dit_macs

    model, ckpt = load_dit(checkpoint, weights=weights)
    args = ckpt.get("args") or {}
    diffusion = create_diffusion(
        "",
        noise_schedule=noise_schedule or args.get("noise_schedule") or "linear",
        learn_sigma=model.learn_sigma,
        diffusion_steps=diffusion_steps or args.get("diffusion_steps") or 1000,
    )
    batch = load_calibration_batch(calibration, calibration_size, seed) if calibration else None
    report: dict[str, Any] = {"pruned_from": str(checkpoint), "weights": weights, "date": datetime.datetime.now().isoformat(timespec="seconds")}
    params_before = sum(p.numel() for p in model.parameters())
    macs_before = dit_macs(DiTShape.of(model))
    if batch is not None:
        inputs = calibration_inputs(batch, diffusion.num_timesteps, calibration_draws, seed)
        report["calibration_loss_before"] = calibration_loss(model, diffusion, inputs)

    if keep_blocks is not None or (depth is not None and depth < len(model.blocks)):
        scores = None
        if keep_blocks is None and batch is not None:
            scores = block_importance(model, diffusion, batch, draws=calibration_draws, seed=seed)
            report["block_importance"] = [round(float(s), 6) for s in scores]
        kept = select_blocks(len(model.blocks), keep_blocks if keep_blocks is not None else depth, scores)
        report["kept_blocks"] = kept
        model = prune_depth(model, kept)
    if heads is not None and heads < model.num_heads:
        model = prune_heads(model, heads, criterion="l1" if criterion == "activation" else criterion)
    if mlp_ratio is not None:
        channels = int(model.hidden_size * mlp_ratio)
        if channels < model.blocks[0].mlp.fc1.out_features:
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
    carry = {k: args[k] for k in ("noise_schedule", "diffusion_steps", "learn_sigma") if k in args}
    save_pruned(model, output, ema=model, extra_args={**carry, "pruning": report})
    cfg = model_config(model)
    print(
        f"pruned {checkpoint} -> {output}: depth {cfg['depth']}, mlp_ratio {cfg['mlp_ratio']:.4g}, heads {cfg['num_heads']}; "
        f"{report['params_before'] / 1e6:.3f}M -> {report['params_after'] / 1e6:.3f}M parameters"
        + (
            f"; calibration loss {report['calibration_loss_before']:.4f} -> {report['calibration_loss_after']:.4f}"
            if "calibration_loss_after" in report
            else ""
        )
    )
    return str(output)


__all__ = [
    "block_importance",
    "build_from_config",
    "calibration_inputs",
    "calibration_loss",
    "checkpoint_dit_config",
    "head_scores",
    "load_dit",
    "mlp_activation_scores",
    "mlp_channel_scores",
    "mlp_ratio_for",
    "model_config",
    "prune",
    "prune_depth",
    "prune_heads",
    "prune_mlp",
    "save_pruned",
    "select_blocks",
]
