"""Analytic parameter and multiply-accumulate counts of a DiT.

The paper's "Gflops" are multiply-accumulates (MACs) of one forward pass for one image; real
FLOPs are 2x. These closed forms count every matrix multiplication (patch embedding, timestep
MLP, adaLN regressions, qkv/proj, attention scores and values, MLP, final layer) and nothing
elementwise. They agree with the published table to within 0.1% (the published figures came
from a tracing counter whose treatment of a few small ops differs slightly).

LightningDiT's block options count as built: SwiGLU's three matrices (``w12``: D -> 2m, ``w3``:
m -> D, with m = int(2/3 * int(D * mlp_ratio))), RMSNorm's gains (D per norm), adaLN without
shifts (4D outputs, not 6D). Rope and RMSNorm are elementwise (no MACs); rope has no parameters.

REG's class token (``class_token_dim`` D) is one more element of every block's sequence (1 + T
tokens), its entry (Linear(D, hidden) and an affine LayerNorm) and its exit (Linear(hidden, D)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .dit import swiglu_hidden


@dataclass(frozen=True)
class DiTShape:
    """The sizes that determine the cost of a DiT."""

    depth: int
    hidden_size: int
    num_heads: int
    patch_size: int
    input_size: int = 32
    in_channels: int = 4
    num_classes: int = 1000
    learn_sigma: bool = True
    mlp_ratio: float = 4.0
    class_dropout_prob: float = 0.1
    frequency_embedding_size: int = 256
    attn_dim: Optional[int] = None  # width of q, k, v; None: hidden_size (differs after head pruning)
    # the block options (dit.py): DiT's block by default, LightningDiT's rmsnorm / swiglu / rope / wo_shift
    norm: str = "layernorm"
    mlp: str = "gelu"
    pos_embed: str = "sincos"
    wo_shift: bool = False
    class_token_dim: Optional[int] = None  # REG's class token of that width; None: none

    @property
    def tokens(self) -> int:
        """The patch tokens T."""
        return (self.input_size // self.patch_size) ** 2

    @property
    def sequence(self) -> int:
        """The tokens every block sees: T, and REG's class token first when there is one."""
        return self.tokens + (1 if self.class_token_dim else 0)

    @property
    def class_token_params(self) -> tuple[int, int]:
        """(entry, exit) parameters of REG's class token: Linear(D, hidden) + LayerNorm(hidden) with
        weight and bias, and Linear(hidden, D); (0, 0) without it."""
        if not self.class_token_dim:
            return 0, 0
        c, d = self.class_token_dim, self.hidden_size
        return c * d + d + 2 * d, d * c + c

    @property
    def out_channels(self) -> int:
        return 2 * self.in_channels if self.learn_sigma else self.in_channels

    @property
    def qkv_dim(self) -> int:
        return self.hidden_size if self.attn_dim is None else self.attn_dim

    @property
    def mlp_hidden(self) -> int:
        """The feed-forward's hidden channels (SwiGLU: the width of its gated product)."""
        if self.mlp == "swiglu":
            return swiglu_hidden(self.hidden_size, self.mlp_ratio)
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def mlp_matrices(self) -> int:
        """D x m matrices of the feed-forward: GELU's fc1 and fc2, SwiGLU's w12 (two) and w3."""
        return 3 if self.mlp == "swiglu" else 2

    @property
    def adaln_chunks(self) -> int:
        """Vectors a block's adaLN regresses: shift, scale, gate twice; 4 without shifts."""
        return 4 if self.wo_shift else 6

    @property
    def norm_params(self) -> int:
        """Parameters of one token norm: RMSNorm's gain; DiT's LayerNorms have none."""
        return self.hidden_size if self.norm == "rmsnorm" else 0

    @classmethod
    def of(cls, model) -> DiTShape:
        """The shape of a built :class:`~dit_lightning.models.dit.DiT`."""
        return cls(
            depth=model.depth,
            hidden_size=model.hidden_size,
            num_heads=model.num_heads,
            patch_size=model.patch_size,
            input_size=model.input_size,
            in_channels=model.in_channels,
            num_classes=model.num_classes,
            learn_sigma=model.learn_sigma,
            mlp_ratio=model.mlp_ratio,
            class_dropout_prob=model.class_dropout_prob,
            attn_dim=getattr(model, "attn_dim", None),
            norm=getattr(model, "norm_kind", "layernorm"),
            mlp=getattr(model, "mlp_kind", "gelu"),
            pos_embed=getattr(model, "pos_embed_kind", "sincos"),
            wo_shift=bool(getattr(model, "wo_shift", False)),
            class_token_dim=getattr(model, "class_token_dim", None),
        )


def block_macs(s: DiTShape) -> int:
    """MACs of one DiT block for one image (over its whole sequence, REG's class token included)."""
    t, d, m, a = s.sequence, s.hidden_size, s.mlp_hidden, s.qkv_dim
    qkv_proj = t * d * 3 * a + t * a * d
    attention = 2 * t * t * a  # QK^T and AV over all heads
    mlp = s.mlp_matrices * t * d * m
    adaln = d * s.adaln_chunks * d  # once per image, not per token
    return qkv_proj + attention + mlp + adaln


def dit_macs(s: DiTShape) -> int:
    """MACs of one forward pass of the whole network for one image."""
    t, d, p = s.tokens, s.hidden_size, s.patch_size
    patch_embed = t * (p * p * s.in_channels) * d
    t_embed = s.frequency_embedding_size * d + d * d
    final = d * 2 * d + t * d * (p * p * s.out_channels)
    token = 2 * d * s.class_token_dim if s.class_token_dim else 0  # REG's entry and exit maps
    return patch_embed + t_embed + s.depth * block_macs(s) + final + token


def training_flops(s: DiTShape, recomputed_blocks: int = 0) -> tuple[int, int]:
    """(useful, executed) FLOPs of one training image: forward + backward = 3x the forward
    FLOPs (2 FLOPs per MAC); activation checkpointing re-runs the forward of each recomputed
    block, which is executed but not useful work (MFU counts only the useful part)."""
    useful = 3 * 2 * dit_macs(s)
    executed = useful + 2 * recomputed_blocks * block_macs(s)
    return useful, executed


def dit_params(s: DiTShape, include_pos_embed: bool = True) -> int:
    """Number of parameters (the fixed ``pos_embed`` included by default, as in checkpoints)."""
    d, p, m, a = s.hidden_size, s.patch_size, s.mlp_hidden, s.qkv_dim
    patch_embed = s.in_channels * p * p * d + d
    t_embed = s.frequency_embedding_size * d + d + d * d + d
    y_embed = (s.num_classes + int(s.class_dropout_prob > 0)) * d
    k = s.adaln_chunks
    mlp = (d * m + m) * (s.mlp_matrices - 1) + (m * d + d)
    block = (d * 3 * a + 3 * a) + (a * d + d) + mlp + (d * k * d + k * d) + 2 * s.norm_params
    final = (d * 2 * d + 2 * d) + (d * p * p * s.out_channels + p * p * s.out_channels) + s.norm_params
    pos = s.tokens * d if include_pos_embed else 0
    return patch_embed + t_embed + y_embed + s.depth * block + final + pos + sum(s.class_token_params)


def shape_of(name: str, **overrides: Any) -> DiTShape:
    """The :class:`DiTShape` of a named configuration (``"DiT-XL/2"``), with overrides."""
    from .dit import dit_config

    kwargs: dict[str, Any] = {} if name == "custom" else dit_config(name)
    kwargs.update({k: v for k, v in overrides.items() if v is not None and k in DiTShape.__dataclass_fields__})
    return DiTShape(**kwargs)
