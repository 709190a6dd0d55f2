"""Structured pruning of a DiT: fewer blocks, fewer MLP channels, fewer attention heads.

Every function returns a *new, smaller* :class:`~dit_lightning.models.dit.DiT` built from its
new configuration and loaded with ``strict=True``: no masks, no zeroed rows left behind, so
the parameter count, the MACs (``flops.py``) and the speed really shrink and the result saves
and loads like any DiT of its shape.

What is removed is chosen by a stated importance score:

* blocks (:func:`block_importance`): the increase of the diffusion loss on a calibration
  batch, with fixed timesteps and noise, when the block is replaced by the identity;
* MLP channels (:func:`mlp_channel_scores`): ``|fc1 row j| * |fc2 column j|`` (L1 or L2), the
  size of the channel's path through the block (SwiGLU: ``|gate row j| * |value row j| * |w3 column j|``,
  the two halves of ``w12`` and the column of ``w3`` pruned together), or its mean |activation| (the
  input of ``fc2`` / ``w3``) on a calibration batch times ``|fc2 column j|``;
* attention heads (:func:`head_scores`): ``|W_v rows of head h| * |proj columns of head h|``,
  the size of the head's path to the residual stream.

A channel or head whose output weights are zero scores zero, so it is removed first and its
removal leaves the outputs exactly unchanged.

Pure PyTorch (no Lightning); ``dit-lightning prune`` (:mod:`dit_lightning.commands.prune`) drives it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor, nn

from .config import build_from_config, mlp_ratio_for, model_config, swiglu_mlp_ratio_for
from .dit import DiT, DiTBlock, SwiGLUFeedForward, mlp_channels

StateDict = dict[str, Tensor]

Criterion = Literal["l1", "l2"]


def _rebuild(model: DiT, cfg: dict[str, Any], sd: StateDict) -> DiT:
    """The new model of configuration ``cfg`` holding ``sd``, on ``model``'s device and dtype,
    in ``model``'s train/eval mode."""
    p = next(model.parameters())
    # Built on meta and allocated empty: no time spent initialising weights that the strict
    # load (pos_embed included) overwrites anyway.
    new = build_from_config(cfg, device=p.device, dtype=p.dtype, empty=True)
    new.load_state_dict(sd, strict=True)
    new.requires_grad_(True)
    new.pos_embed.requires_grad_(False)
    return new.train(model.training)


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
def calibration_loss(
    model: nn.Module, diffusion: Any, inputs: tuple[Tensor, Tensor, Tensor, Tensor], chunk: int = 256
) -> float:
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
def block_importance(model: DiT, diffusion: Any, batch: dict[str, Tensor], draws: int = 1, seed: int = 0) -> Tensor:
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


def _output_projection(block: DiTBlock) -> nn.Linear:
    """The feed-forward's last matrix, whose input columns are the channels (``fc2``, SwiGLU's ``w3``)."""
    return block.mlp.w3 if isinstance(block.mlp, SwiGLUFeedForward) else block.mlp.fc2


@torch.no_grad()
def mlp_channel_scores(model: DiT, criterion: Criterion = "l1") -> list[Tensor]:
    """Per block, the (mlp_hidden,) importance of each channel: ``|fc1 row j| * |fc2 col j|``
    (SwiGLU: ``|gate row j| * |value row j| * |w3 col j|``)."""
    out = []
    for block in model.blocks:
        mlp = block.mlp
        if isinstance(mlp, SwiGLUFeedForward):
            gate, value = mlp.w12.weight.float().chunk(2, dim=0)
            w3 = mlp.w3.weight.float()
            out.append(_norm(gate, 1, criterion) * _norm(value, 1, criterion) * _norm(w3, 0, criterion))
        else:
            fc1, fc2 = mlp.fc1.weight.float(), mlp.fc2.weight.float()
            out.append(_norm(fc1, 1, criterion) * _norm(fc2, 0, criterion))
    return out


@torch.no_grad()
def mlp_activation_scores(
    model: DiT, diffusion: Any, batch: dict[str, Tensor], draws: int = 1, seed: int = 0
) -> list[Tensor]:
    """Per block, mean |GELU output of channel j| (SwiGLU: of the gated product) on calibration
    inputs times ``|fc2 col j|_1`` (``w3``'s): the channel's typical contribution to the residual
    stream (data-aware)."""
    sums = [torch.zeros(mlp_channels(b), dtype=torch.float64) for b in model.blocks]
    count = [0]
    handles = []
    for i, block in enumerate(model.blocks):

        def hook(_m: nn.Module, args: tuple[Tensor, ...], i: int = i) -> None:
            act = args[0]  # the input of fc2 / w3: the channels' activations
            sums[i] += act.detach().abs().double().sum(dim=(0, 1)).cpu()
            if i == 0:
                count[0] += act.shape[0] * act.shape[1]

        handles.append(_output_projection(block).register_forward_pre_hook(hook))
    try:
        calibration_loss(model, diffusion, calibration_inputs(batch, diffusion.num_timesteps, draws=draws, seed=seed))
    finally:
        for h in handles:
            h.remove()
    return [
        (s / max(count[0], 1)).float() * _output_projection(b).weight.detach().float().abs().sum(0).cpu()
        for s, b in zip(sums, model.blocks)
    ]


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
    The count is the same in every block (one ``mlp_ratio``); which channels differ per block.
    A SwiGLU channel is a gate row and a value row of ``w12`` and a column of ``w3``, pruned together."""
    mlp_hidden = mlp_channels(model.blocks[0])
    if keep_channels is None:
        if keep_ratio is None:
            raise ValueError("give exactly one of keep_ratio and keep_channels")
        keep_channels = int(mlp_hidden * keep_ratio)
    elif keep_ratio is not None:
        raise ValueError("give exactly one of keep_ratio and keep_channels")
    keep_channels = max(multiple_of, keep_channels // multiple_of * multiple_of)
    if not 1 <= keep_channels <= mlp_hidden:
        raise ValueError(f"keep_channels={keep_channels}: the MLPs have {mlp_hidden} channels, choose 1..{mlp_hidden}")
    scores = list(scores) if scores is not None else mlp_channel_scores(model, criterion)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for i, block in enumerate(model.blocks):
        s = scores[i].float().cpu()
        # Highest scores first; ties keep the lower index (so "keep all" is the identity order).
        order = torch.argsort(-s, stable=True)[:keep_channels]
        idx = torch.sort(order).values.to(_output_projection(block).weight.device)
        p = f"blocks.{i}.mlp."
        if isinstance(block.mlp, SwiGLUFeedForward):
            rows = torch.cat([idx, idx + mlp_hidden])  # the gate's rows, then the value's (w12's halves)
            sd[p + "w12.weight"] = sd[p + "w12.weight"][rows].clone()
            sd[p + "w12.bias"] = sd[p + "w12.bias"][rows].clone()
            sd[p + "w3.weight"] = sd[p + "w3.weight"][:, idx].clone()
        else:
            sd[p + "fc1.weight"] = sd[p + "fc1.weight"][idx].clone()
            sd[p + "fc1.bias"] = sd[p + "fc1.bias"][idx].clone()
            sd[p + "fc2.weight"] = sd[p + "fc2.weight"][:, idx].clone()
    cfg = model_config(model)
    swiglu = isinstance(model.blocks[0].mlp, SwiGLUFeedForward)
    cfg["mlp_ratio"] = (swiglu_mlp_ratio_for if swiglu else mlp_ratio_for)(model.hidden_size, keep_channels)
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
    qkv shrinks to (3 * inner, hidden) and proj to (hidden, inner). Rope's tables (per head
    channel) and a QK-norm's weights (per head channel) stay as they are."""
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


__all__ = [
    "block_importance",
    "calibration_inputs",
    "calibration_loss",
    "head_scores",
    "mlp_activation_scores",
    "mlp_channel_scores",
    "prune_depth",
    "prune_heads",
    "prune_mlp",
    "select_blocks",
]
