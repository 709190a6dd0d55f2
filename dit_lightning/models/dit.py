"""DiT: Scalable Diffusion Models with Transformers (Peebles & Xie, arXiv 2212.09748).

The network reads like the paper: patchify the latent, add a fixed 2D sin-cos position
embedding, condition every block on c = t_emb + y_emb through adaLN-Zero, then a final
adaLN layer and unpatchify. Parameter names and shapes match the released checkpoints,
so ``DiT-XL-2-256x256.pt`` loads with ``strict=True``.

LightningDiT's block (Yao et al., "Reconstruction vs. Generation", CVPR 2025, arXiv 2501.01423;
github.com/hustvl/LightningDiT) is a set of options of the same network: ``norm="rmsnorm"``
(:class:`RMSNorm` for every norm), ``mlp="swiglu"`` (:class:`SwiGLUFeedForward`),
``pos_embed="rope"`` (:class:`RotaryEmbedding2D` on q and k, on top of the sin-cos embedding, as
LightningDiT keeps both) and ``wo_shift`` (adaLN without its shifts). Their names match
LightningDiT's, so its state dicts load with ``strict=True`` too.

REG (Wu et al., "Representation Entanglement for Generation", NeurIPS 2025; github.com/Martinser/REG)
adds one token to the sequence: a frozen encoder's class token, noised like the latents, enters
through :class:`ClassTokenEmbedder` at position 0 (no position embedding) and is predicted back by
the final layer's ``linear_cls`` (``class_token_dim``: the encoder's width; unset: no token).

Pure PyTorch: no Lightning import, so notebooks and other trainers can use it directly.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Optional, Union, cast, overload

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# "none" | "all" | "half" | "first:N" | "every:K" | an int N (the first N blocks) | explicit indices.
CheckpointSpec = Union[None, str, int, Sequence[int]]
# The block options: DiT's block is the first of each, LightningDiT's the second.
NormKind = Literal["layernorm", "rmsnorm"]
MlpKind = Literal["gelu", "swiglu"]
PosEmbedKind = Literal["sincos", "rope"]
BLOCK_OPTIONS: dict[str, tuple[str, ...]] = {
    "norm": ("layernorm", "rmsnorm"),
    "mlp": ("gelu", "swiglu"),
    "pos_embed": ("sincos", "rope"),
}
# The rotary embedding's cos and sin tables, (T, head_dim) each, handed to every block.
RopeTables = tuple[Tensor, Tensor]


def modulate(x: Tensor, shift: Optional[Tensor], scale: Tensor) -> Tensor:
    """adaLN modulation of the token sequence ``x`` (N, T, D) by per-sample (N, D) shift/scale
    (no shift: LightningDiT's ``wo_shift``)."""
    if shift is None:
        return x * (1 + scale.unsqueeze(1))
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def check_block_options(**options: Any) -> None:
    """Refuse an unknown value of ``norm`` / ``mlp`` / ``pos_embed`` in one line naming the choices."""
    for name, value in options.items():
        if value not in BLOCK_OPTIONS[name]:
            raise ValueError(f"{name}='{value}' is not a block option: choose one of {', '.join(BLOCK_OPTIONS[name])}")


# --------------------------------------------------------------------------------------
# Embeddings
# --------------------------------------------------------------------------------------


def sincos_1d(embed_dim: int, positions: np.ndarray) -> np.ndarray:
    """MAE-style 1D sin-cos embedding: ``[sin(p * w), cos(p * w)]`` with w = 10000^(-i / (D/2))."""
    if embed_dim % 2:
        raise ValueError(f"sin-cos embedding needs an even dimension, got {embed_dim}")
    omega = np.arange(embed_dim // 2, dtype=np.float64) / (embed_dim / 2.0)
    omega = 1.0 / 10000**omega
    out = np.einsum("m,d->md", positions.reshape(-1).astype(np.float64), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def sincos_2d(embed_dim: int, grid_size: int) -> np.ndarray:
    """Fixed 2D sin-cos position embedding of shape (grid_size**2, embed_dim).

    As in the reference, the grid is built "w first": the first half of the channels
    encodes the column (w) coordinate and the second half the row (h) coordinate.
    """
    if embed_dim % 4:
        raise ValueError(f"2D sin-cos embedding needs hidden_size divisible by 4, got {embed_dim}")
    coords = np.arange(grid_size, dtype=np.float32)
    grid_w, grid_h = np.meshgrid(coords, coords)  # grid_w[i, j] = j, grid_h[i, j] = i
    emb_w = sincos_1d(embed_dim // 2, grid_w)
    emb_h = sincos_1d(embed_dim // 2, grid_h)
    return np.concatenate([emb_w, emb_h], axis=1)


class RotaryEmbedding2D(nn.Module):
    """2D rotary position embedding of q and k (EVA-02's ``VisionRotaryEmbeddingFast``, as LightningDiT
    uses it): the first half of a head's channels rotates with the token's row, the second half with
    its column, channel pairs (2i, 2i + 1) by the angle ``pos * theta^(-2i / (head_dim / 2))``.

    The tables are persistent buffers (``freqs_cos``, ``freqs_sin``, (grid**2, head_dim)) because
    LightningDiT's state dicts hold them; they are fixed, never trained.
    """

    freqs_cos: Tensor
    freqs_sin: Tensor

    def __init__(self, head_dim: int, grid_size: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"pos_embed='rope' needs a head size divisible by 4, got {head_dim}: change num_heads")
        dim = head_dim // 2  # channels per axis
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        # LightningDiT's positions, arange(n) / n * n, kept bit for bit (not always the integers)
        pos = torch.arange(grid_size) / grid_size * grid_size
        angles = torch.repeat_interleave(pos[:, None] * freqs[None], 2, dim=-1)  # (grid, dim): pairs share
        rows = angles[:, None, :].expand(grid_size, grid_size, dim)
        cols = angles[None, :, :].expand(grid_size, grid_size, dim)
        table = torch.cat([rows, cols], dim=-1).reshape(grid_size * grid_size, head_dim)
        self.register_buffer("freqs_cos", table.cos())
        self.register_buffer("freqs_sin", table.sin())

    def tables(self) -> RopeTables:
        return self.freqs_cos, self.freqs_sin


def rotate_half(x: Tensor) -> Tensor:
    """Channel pairs (a, b) -> (-b, a): the rotation by 90 degrees of each pair."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def apply_rope(x: Tensor, rope: RopeTables) -> Tensor:
    """Rotate the (N, heads, T, head_dim) queries or keys by their tokens' positions."""
    cos, sin = rope
    # the tables in x's dtype: under autocast the attention gets q, k and v in one dtype
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


class PatchEmbed(nn.Module):
    """Split the latent into p x p patches and project each to a D-dimensional token."""

    def __init__(self, input_size: int, patch_size: int, in_channels: int, hidden_size: int) -> None:
        super().__init__()
        self.grid_size = input_size // patch_size
        self.num_patches = self.grid_size**2
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (N, T, D)


class TimestepEmbedder(nn.Module):
    """Sinusoidal frequency embedding of the (integer or fractional) timestep, then an MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256) -> None:
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )

    @staticmethod
    def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
        """``cat([cos(t * f), sin(t * f)])`` with f = max_period^(-i / half)."""
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return emb

    def forward(self, t: Tensor) -> Tensor:
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(t_freq.to(cast(nn.Linear, self.mlp[0]).weight.dtype))


class LabelEmbedder(nn.Module):
    """Class embedding with a learned null class (index ``num_classes``) for classifier-free guidance.

    In training each label is replaced by the null class with probability ``dropout_prob``;
    ``force_drop_ids`` (bool or 0/1 tensor) overrides the random draw so runs can be made
    bit-identical across process layouts.
    """

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float) -> None:
        super().__init__()
        use_cfg_embedding = dropout_prob > 0
        self.embedding_table = nn.Embedding(num_classes + int(use_cfg_embedding), hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def token_drop(self, labels: Tensor, force_drop_ids: Optional[Tensor] = None) -> Tensor:
        if force_drop_ids is None:
            drop_ids = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop_ids = force_drop_ids.to(device=labels.device).bool()
        return torch.where(drop_ids, torch.full_like(labels, self.num_classes), labels)

    def forward(self, labels: Tensor, train: bool, force_drop_ids: Optional[Tensor] = None) -> Tensor:
        if (train and self.dropout_prob > 0) or force_drop_ids is not None:
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)


class ClassTokenEmbedder(nn.Module):
    """REG's entry of the (noisy) encoder class token: a linear map to the hidden width, then a
    LayerNorm with affine weights (REG's ``cls_projectors2`` and ``wg_norm``)."""

    def __init__(self, token_dim: int, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(token_dim, hidden_size)
        self.norm = nn.LayerNorm(hidden_size, elementwise_affine=True, eps=1e-6)

    def forward(self, token: Tensor) -> Tensor:
        """(N, token_dim) -> (N, 1, hidden): one sequence element."""
        return self.norm(self.proj(token)).unsqueeze(1)


# --------------------------------------------------------------------------------------
# Transformer parts
# --------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned gain (Zhang & Sennrich 2019), computed in fp32
    as LLaMA's (and LightningDiT's): ``x / sqrt(mean(x^2) + eps) * weight``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def make_norm(kind: NormKind, dim: int) -> nn.Module:
    """The block's token norm: DiT's LayerNorm without affine parameters, or LightningDiT's RMSNorm."""
    return RMSNorm(dim) if kind == "rmsnorm" else nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection, computed by PyTorch's SDPA
    (flash / memory-efficient kernels on GPU). Optional QK-norm stabilises fp16 training
    (it adds parameters, so released checkpoints use it off): a LayerNorm of each head's q and k,
    or an RMSNorm with ``norm="rmsnorm"`` (LightningDiT's). ``rope``: the rotary tables, applied
    to q and k after their norm and before SDPA. ``attn_dim``, the width of q, k and v (default
    ``dim``), differs from the residual width ``dim`` only after head pruning."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qk_norm: bool = False,
        attn_dim: Optional[int] = None,
        norm: NormKind = "layernorm",
    ) -> None:
        super().__init__()
        attn_dim = dim if attn_dim is None else attn_dim
        if attn_dim % num_heads:
            name = "hidden_size" if attn_dim == dim else "attn_dim"
            nearest = [d for d in range(1, attn_dim + 1) if attn_dim % d == 0]
            below = [d for d in nearest if d < num_heads][-1:]
            above = [d for d in nearest if d > num_heads][:1]
            raise ValueError(
                f"{name} {attn_dim} is not divisible by num_heads {num_heads}: choose a num_heads that divides "
                f"{attn_dim} (the nearest: {', '.join(str(d) for d in below + above)})"
            )
        self.num_heads = num_heads
        self.head_dim = attn_dim // num_heads
        self.qkv = nn.Linear(dim, attn_dim * 3, bias=True)
        self.q_norm = self._qk_norm(norm) if qk_norm else nn.Identity()
        self.k_norm = self._qk_norm(norm) if qk_norm else nn.Identity()
        self.proj = nn.Linear(attn_dim, dim, bias=True)

    def _qk_norm(self, norm: NormKind) -> nn.Module:
        return RMSNorm(self.head_dim) if norm == "rmsnorm" else nn.LayerNorm(self.head_dim, eps=1e-6)

    def forward(self, x: Tensor, rope: Optional[RopeTables] = None) -> Tensor:
        n, t, _ = x.shape
        qkv = self.qkv(x).reshape(n, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(n, t, self.num_heads * self.head_dim))


class Mlp(nn.Module):
    """Pointwise feed-forward: Linear -> GELU(tanh) -> Linear."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim, bias=True)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_dim, dim, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SwiGLUFeedForward(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020), LightningDiT's ``SwiGLUFFN``: one matrix ``w12`` makes the
    gate and the value (its two halves), ``silu(gate) * value``, then ``w3``. ``hidden_dim`` is the
    width of the gated product (LightningDiT: ``int(2/3 * int(hidden_size * mlp_ratio))``, so that
    its three matrices hold as many weights as GELU's two)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden_dim, bias=True)
        self.w3 = nn.Linear(hidden_dim, dim, bias=True)

    @property
    def hidden_dim(self) -> int:
        return self.w3.in_features

    def forward(self, x: Tensor) -> Tensor:
        gate, value = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(gate) * value)


def swiglu_hidden(hidden_size: int, mlp_ratio: float) -> int:
    """The SwiGLU width LightningDiT builds for ``mlp_ratio``: two thirds of GELU's, rounded down."""
    return int(2 / 3 * int(hidden_size * mlp_ratio))


def mlp_channels(block: nn.Module) -> int:
    """The hidden channels of a block's feed-forward (GELU's ``fc1`` rows, SwiGLU's product width)."""
    mlp = block.mlp
    return mlp.hidden_dim if isinstance(mlp, SwiGLUFeedForward) else cast(Mlp, mlp).fc1.out_features


class DiTBlock(nn.Module):
    """A transformer block conditioned by adaLN-Zero: the conditioning regresses shift, scale
    and a residual gate for both the attention and the MLP branch; the gates start at zero so
    every block starts as the identity. ``norm`` / ``mlp`` / ``wo_shift`` choose LightningDiT's parts
    (RMSNorm, SwiGLU, adaLN without shifts); ``rope`` (the rotary tables) is given by the network."""

    mlp: Union[Mlp, SwiGLUFeedForward]

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qk_norm: bool = False,
        attn_dim: Optional[int] = None,
        norm: NormKind = "layernorm",
        mlp: MlpKind = "gelu",
        wo_shift: bool = False,
    ) -> None:
        super().__init__()
        check_block_options(norm=norm, mlp=mlp)
        self.norm1 = make_norm(norm, hidden_size)
        self.attn = Attention(hidden_size, num_heads, qk_norm=qk_norm, attn_dim=attn_dim, norm=norm)
        self.norm2 = make_norm(norm, hidden_size)
        if mlp == "swiglu":
            self.mlp = SwiGLUFeedForward(hidden_size, swiglu_hidden(hidden_size, mlp_ratio))
        else:
            self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.wo_shift = wo_shift
        chunks = 4 if wo_shift else 6
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, chunks * hidden_size, bias=True))

    def forward(self, x: Tensor, c: Tensor, rope: Optional[RopeTables] = None) -> Tensor:
        shift_msa: Optional[Tensor]
        shift_mlp: Optional[Tensor]
        if self.wo_shift:
            scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(4, dim=1)
            shift_msa = shift_mlp = None
        else:
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), rope)
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    """adaLN (shift, scale) then a linear map from each token to its p x p x C_out patch; with REG's
    class token (``class_token_dim``), ``linear_cls`` maps the first token, modulated alike, back to
    the encoder's width."""

    def __init__(
        self,
        hidden_size: int,
        patch_size: int,
        out_channels: int,
        norm: NormKind = "layernorm",
        class_token_dim: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.norm_final = make_norm(norm, hidden_size)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))
        self.linear_cls = nn.Linear(hidden_size, class_token_dim) if class_token_dim else None

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))

    def forward_with_class_token(self, x: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        """(patch outputs of tokens 1.., the class token's prediction from token 0): REG's final layer."""
        if self.linear_cls is None:
            raise ValueError("this final layer has no class-token output (class_token_dim unset)")
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        h = modulate(self.norm_final(x), shift, scale)
        return self.linear(h[:, 1:]), self.linear_cls(h[:, 0])


class DiTBlocks(nn.ModuleList):
    """The transformer blocks: an ``nn.ModuleList`` whose items type-check as :class:`DiTBlock`."""

    # Declarations for the type checker only: at run time the methods are ModuleList's own, so
    # state-dict keys, FSDP wrapping and torch.compile's ModuleList fast paths are unchanged.
    if TYPE_CHECKING:

        def __iter__(self) -> Iterator[DiTBlock]: ...

        @overload
        def __getitem__(self, idx: slice) -> DiTBlocks: ...

        @overload
        def __getitem__(self, idx: int) -> DiTBlock: ...

        def __getitem__(self, idx: Union[int, slice]) -> Union[DiTBlock, DiTBlocks]: ...


# --------------------------------------------------------------------------------------
# The network
# --------------------------------------------------------------------------------------


AttentionBackend = Literal["auto", "flash", "efficient", "cudnn", "math"]


def attention_kernel(backend: AttentionBackend) -> contextlib.AbstractContextManager[Any]:
    """A context forcing the SDPA kernel of the attention (``auto``: PyTorch chooses)."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    return sdpa_kernel(kinds[backend])


def resolve_checkpoint_blocks(spec: CheckpointSpec, depth: int) -> tuple[int, ...]:
    """Turn an activation-checkpointing setting into the sorted indices of the blocks to recompute.

    ``None``/``"none"``: no block; ``"all"``: every block; ``"half"``: the first half;
    ``"first:N"`` or an int N: the first N blocks; ``"every:K"``: blocks 0, K, 2K, ...;
    a sequence of ints: exactly those blocks.
    """
    if spec is None or (isinstance(spec, str) and spec.lower() in ("none", "")):
        return ()
    if isinstance(spec, bool):
        return tuple(range(depth)) if spec else ()
    if isinstance(spec, int):
        if not 0 <= spec <= depth:
            raise ValueError(f"activation_checkpointing={spec}: the model has {depth} blocks, choose 0..{depth}")
        return tuple(range(spec))
    if isinstance(spec, str):
        s = spec.lower().strip()
        if s == "all":
            return tuple(range(depth))
        if s == "half":
            return tuple(range(depth // 2))
        kind, _, arg = s.partition(":")
        if kind in ("first", "every") and arg.isdigit():
            n = int(arg)
            if kind == "first":
                return resolve_checkpoint_blocks(n, depth)
            if n < 1:
                raise ValueError(f"activation_checkpointing='{spec}': K must be >= 1")
            return tuple(range(0, depth, n))
        raise ValueError(
            f"activation_checkpointing='{spec}' is not understood: use 'none', 'all', 'half', "
            "'first:N', 'every:K', an int N or a list of block indices"
        )
    indices = sorted({int(i) for i in spec})
    bad = [i for i in indices if not 0 <= i < depth]
    if bad:
        raise ValueError(f"activation_checkpointing blocks {bad} out of range: the model has blocks 0..{depth - 1}")
    return tuple(indices)


class DiT(nn.Module):
    """Class-conditional Diffusion Transformer over latents of shape (N, in_channels, input_size, input_size).

    ``forward(x, t, y)`` returns (N, out_channels, H, W) where out_channels = 2 * in_channels
    with ``learn_sigma`` (epsilon, then the variance interpolation value). ``attn_dim`` (the
    width of q, k, v; default ``hidden_size``) is set only by head-pruned models. ``norm``, ``mlp``,
    ``pos_embed`` and ``wo_shift`` choose the block's parts (the defaults: DiT's; ``"rmsnorm"``,
    ``"swiglu"``, ``"rope"``: LightningDiT's). ``class_token_dim``: REG's class token of that width
    (``forward(..., class_token=...)``; unset: none, the network and its state dict are DiT's).
    """

    _compiled: bool  # set once compiled in place (``DiTModule.configure_model``), absent before

    def __init__(
        self,
        input_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        class_dropout_prob: float = 0.1,
        num_classes: int = 1000,
        learn_sigma: bool = True,
        qk_norm: bool = False,
        activation_checkpointing: CheckpointSpec = None,
        attn_dim: Optional[int] = None,
        norm: NormKind = "layernorm",
        mlp: MlpKind = "gelu",
        pos_embed: PosEmbedKind = "sincos",
        wo_shift: bool = False,
        class_token_dim: Optional[int] = None,
    ) -> None:
        super().__init__()
        check_block_options(norm=norm, mlp=mlp, pos_embed=pos_embed)
        if class_token_dim is not None and class_token_dim < 1:
            raise ValueError(f"class_token_dim must be positive (the encoder's width), got {class_token_dim}")
        if class_token_dim and pos_embed == "rope":
            raise ValueError(
                "REG's class token has no grid position, and rope rotates every token by its grid position: "
                "use pos_embed sincos with the class token (REG's SiT), or turn the class token off"
            )
        if input_size % patch_size:
            raise ValueError(
                f"patch_size {patch_size} does not divide the latent size {input_size}: "
                f"choose a patch size among {[p for p in (1, 2, 4, 8, 16) if input_size % p == 0]}"
            )
        self.input_size = input_size
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.hidden_size = hidden_size
        self.depth = depth
        self.num_heads = num_heads
        self.attn_dim = attn_dim  # None: hidden_size
        self.mlp_ratio = mlp_ratio
        self.num_classes = num_classes
        self.learn_sigma = learn_sigma
        self.class_dropout_prob = class_dropout_prob
        self.norm_kind, self.mlp_kind, self.pos_embed_kind, self.wo_shift = norm, mlp, pos_embed, wo_shift
        self.class_token_dim = class_token_dim or None

        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        # REG: the class token enters first in the sequence, with no position embedding (a zero row in REG)
        self.cls_embedder = ClassTokenEmbedder(class_token_dim, hidden_size) if class_token_dim else None
        num_patches = self.x_embedder.num_patches
        # Fixed, not trained, but a Parameter (not a buffer) because released checkpoints hold it.
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, hidden_size), requires_grad=False)
        # LightningDiT's rope rotates q and k in every block and keeps the sin-cos embedding too
        self.feat_rope: Optional[RotaryEmbedding2D] = None
        if pos_embed == "rope":
            self.feat_rope = RotaryEmbedding2D((attn_dim or hidden_size) // num_heads, self.x_embedder.grid_size)
        self.blocks = DiTBlocks(
            [
                DiTBlock(
                    hidden_size,
                    num_heads,
                    mlp_ratio=mlp_ratio,
                    qk_norm=qk_norm,
                    attn_dim=attn_dim,
                    norm=norm,
                    mlp=mlp,
                    wo_shift=wo_shift,
                )
                for _ in range(depth)
            ]
        )
        self.final_layer = FinalLayer(
            hidden_size, patch_size, self.out_channels, norm=norm, class_token_dim=self.class_token_dim
        )
        self.checkpoint_blocks: tuple[int, ...] = ()
        self.set_activation_checkpointing(activation_checkpointing)
        self.initialize_weights()

    # ---- set-up -------------------------------------------------------------------
    def initialize_weights(self) -> None:
        """The paper's initialisation; the adaLN and output layers start at zero (adaLN-Zero)."""

        def _basic_init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

        self.apply(_basic_init)
        pos = sincos_2d(self.hidden_size, self.x_embedder.grid_size)
        self.pos_embed.data.copy_(torch.from_numpy(pos).float().unsqueeze(0))
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))  # like a Linear over the flattened patch
        if self.x_embedder.proj.bias is None:  # PatchEmbed builds its Conv2d with bias=True
            raise RuntimeError("DiT's patch embedding has no bias")
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(cast(nn.Linear, self.t_embedder.mlp[0]).weight, std=0.02)
        nn.init.normal_(cast(nn.Linear, self.t_embedder.mlp[2]).weight, std=0.02)
        for block in self.blocks:
            nn.init.zeros_(cast(nn.Linear, block.adaLN_modulation[-1]).weight)
            nn.init.zeros_(cast(nn.Linear, block.adaLN_modulation[-1]).bias)
        nn.init.zeros_(cast(nn.Linear, self.final_layer.adaLN_modulation[-1]).weight)
        nn.init.zeros_(cast(nn.Linear, self.final_layer.adaLN_modulation[-1]).bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)
        if self.final_layer.linear_cls is not None:  # REG zeroes the class token's output too
            nn.init.zeros_(self.final_layer.linear_cls.weight)
            nn.init.zeros_(self.final_layer.linear_cls.bias)

    def set_activation_checkpointing(self, spec: CheckpointSpec) -> None:
        """Choose which blocks recompute their activations in the backward pass."""
        self.checkpoint_blocks = resolve_checkpoint_blocks(spec, self.depth)

    # ---- forward --------------------------------------------------------------------
    def unpatchify(self, x: Tensor) -> Tensor:
        """(N, T, p*p*C) -> (N, C, H, W)."""
        c, p = self.out_channels, self.patch_size
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(x.shape[0], h, w, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], c, h * p, w * p)

    @overload
    def forward(
        self,
        x: Tensor,
        t: Tensor,
        y: Tensor,
        force_drop_ids: Optional[Tensor] = None,
        hidden_at: None = None,
        class_token: None = None,
    ) -> Tensor: ...
    @overload
    def forward(
        self,
        x: Tensor,
        t: Tensor,
        y: Tensor,
        force_drop_ids: Optional[Tensor] = None,
        *,
        hidden_at: int,
        class_token: None = None,
    ) -> tuple[Tensor, Tensor]: ...
    @overload
    def forward(
        self,
        x: Tensor,
        t: Tensor,
        y: Tensor,
        force_drop_ids: Optional[Tensor] = None,
        hidden_at: None = None,
        *,
        class_token: Tensor,
    ) -> tuple[Tensor, Tensor]: ...
    @overload
    def forward(
        self,
        x: Tensor,
        t: Tensor,
        y: Tensor,
        force_drop_ids: Optional[Tensor] = None,
        *,
        hidden_at: int,
        class_token: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]: ...
    def forward(
        self,
        x: Tensor,
        t: Tensor,
        y: Tensor,
        force_drop_ids: Optional[Tensor] = None,
        hidden_at: Optional[int] = None,
        class_token: Optional[Tensor] = None,
    ) -> Union[Tensor, tuple[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]:
        """x: (N, C, H, W) latents, t: (N,) timesteps, y: (N,) labels (``num_classes`` = null).

        ``hidden_at=k``: also return the hidden tokens (N, T, hidden) after block k (1-based; REPA's
        alignment depth), as ``(output, hidden)``. ``class_token`` (N, class_token_dim): REG's noisy
        class token, which a network with ``class_token_dim`` needs; it returns ``(output,
        class_token_prediction)``, or ``(output, hidden, class_token_prediction)`` with ``hidden_at``,
        the hidden tokens then (N, 1 + T, hidden), the class token's first (as REG aligns them)."""
        x = self.x_embedder(x) + self.pos_embed
        if (class_token is None) != (self.cls_embedder is None):
            raise ValueError(
                "this DiT was built with REG's class token (class_token_dim): pass class_token"
                if self.cls_embedder is not None
                else "class_token given, but this DiT has no class-token input: build it with class_token_dim"
            )
        if self.cls_embedder is not None and class_token is not None:
            x = torch.cat([self.cls_embedder(class_token.to(x.dtype)), x], dim=1)
        c = self.t_embedder(t) + self.y_embedder(y, self.training, force_drop_ids)
        recompute = self.checkpoint_blocks if (self.training and torch.is_grad_enabled()) else ()
        hidden: Optional[Tensor] = None
        rope = self.feat_rope.tables() if self.feat_rope is not None else None
        for i, block in enumerate(self.blocks):
            if i in recompute:
                # Non-reentrant: works with DDP, torch.compile and inputs that need no grad.
                x = checkpoint(block, x, c, rope, use_reentrant=False)
            else:
                x = block(x, c, rope)
            if i + 1 == hidden_at:
                hidden = x
        if hidden_at is not None and hidden is None:
            raise ValueError(f"hidden_at={hidden_at}: the DiT has blocks 1..{len(self.blocks)}")
        if class_token is None:
            out = self.unpatchify(self.final_layer(x, c))
            return out if hidden is None else (out, hidden)
        patches, token = self.final_layer.forward_with_class_token(x, c)
        out = self.unpatchify(patches)
        return (out, token) if hidden is None else (out, hidden, token)

    def forward_with_cfg(
        self, x: Tensor, t: Tensor, y: Tensor, cfg_scale: float, guide_channels: Optional[int] = None
    ) -> Tensor:
        """Classifier-free guidance on a doubled batch: ``x = [z, z]``, ``y = [labels, null]``.

        ``eps = uncond + s * (cond - uncond)`` on the first ``guide_channels`` output channels
        (default: every epsilon channel, the correct form). ``guide_channels=3`` reproduces
        the reference implementation, whose published FIDs were computed that way. The other
        channels (the variance output) pass through unguided.
        """
        n_eps = self.in_channels if guide_channels is None else guide_channels
        if not 0 < n_eps <= self.in_channels:
            raise ValueError(f"guide_channels must be in 1..{self.in_channels}, got {guide_channels}")
        half = x[: len(x) // 2]
        out = self.forward(torch.cat([half, half], dim=0), t, y)
        eps, rest = out[:, :n_eps], out[:, n_eps:]
        cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
        half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
        return torch.cat([torch.cat([half_eps, half_eps], dim=0), rest], dim=1)


# --------------------------------------------------------------------------------------
# The model family
# --------------------------------------------------------------------------------------

# Sizes of the paper (Table 1); the name's suffix is the patch size.
_SIZES = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}
DIT_CONFIGS: dict[str, dict[str, int]] = {
    f"DiT-{size}/{p}": {"depth": d, "hidden_size": h, "num_heads": n, "patch_size": p}
    for size, (d, h, n) in _SIZES.items()
    for p in (2, 4, 8)
}


# LightningDiT's sizes (github.com/hustvl/LightningDiT, models/lightningdit.py) with its published block:
# RMSNorm, SwiGLU and rope (configs/lightningdit_xl_vavae_f16d32.yaml; no QK-norm, adaLN with shifts).
_LIGHTNING_SIZES = {"B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16), "1p0B": (24, 1536, 24)}
_LIGHTNING_SIZES["1p6B"] = (28, 1792, 28)
LIGHTNING_BLOCK: dict[str, Any] = {"norm": "rmsnorm", "mlp": "swiglu", "pos_embed": "rope"}
LIGHTNINGDIT_CONFIGS: dict[str, dict[str, Any]] = {
    f"LightningDiT-{size}/{p}": {"depth": d, "hidden_size": h, "num_heads": n, "patch_size": p, **LIGHTNING_BLOCK}
    for size, (d, h, n) in _LIGHTNING_SIZES.items()
    for p in (1, 2)
    if (size, p) != ("L", 1)  # LightningDiT registers no L/1
}


def dit_config(name: str) -> dict[str, Any]:
    """Depth, hidden size, heads and patch size of a named configuration (e.g. ``"DiT-XL/2"``), and
    the block options of a LightningDiT (``"LightningDiT-XL/1"``: RMSNorm, SwiGLU, rope)."""
    key = name.strip()
    if "/" not in key and key.count("-") == 2:  # accept the file-name spelling "DiT-XL-2"
        head, _, patch = key.rpartition("-")
        key = f"{head}/{patch}"
    named = {**DIT_CONFIGS, **LIGHTNINGDIT_CONFIGS}
    if key not in named:
        raise ValueError(f"unknown DiT model '{name}': choose one of {', '.join(named)} or 'custom'")
    return dict(named[key])


def build_dit(name: str = "DiT-XL/2", **overrides: Any) -> DiT:
    """Build a named DiT (``"DiT-S/2"``...), or ``"custom"`` from explicit sizes; any keyword
    of :class:`DiT` overrides the named size (e.g. ``input_size=64`` for 512px images)."""
    kwargs: dict[str, Any] = {} if name == "custom" else dit_config(name)
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return DiT(**kwargs)
