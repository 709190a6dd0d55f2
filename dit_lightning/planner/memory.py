"""Analytic peak-memory model of one DiT training step (forward, backward, optimiser, EMA).

Everything is counted from the architecture, tensor by tensor, in bytes per GPU:

* Static state: fp32 master weights, fp32 gradients, optimiser states, the fp32 EMA copy
  (divided by the world size where FSDP shards them), DDP's gradient buckets.
* Saved activations: the tensors autograd keeps for the backward pass, listed per DiT block
  in :func:`block_activation_terms` (read off the autograd graph of ``DiTBlock.forward``:
  LayerNorm inputs and outputs, modulate outputs, qkv, the SDPA output and logsumexp or the
  softmax matrix, MLP fc1/GELU outputs, gate inputs...). Under Lightning's ``*-mixed``
  precision the weights stay fp32 and autocast runs the matmuls in 16 bits: LayerNorm and the
  residual stream stay fp32, matmul inputs and outputs are 16-bit, and autocast keeps a 16-bit
  copy of every matmul weight alive for the backward pass.
* Transients: the gradient in flight through a block, the recomputed activations of a
  checkpointed block while its backward runs, the foreach-AdamW temporary.

The peak is the maximum over the phases of a step (end of forward, each block of the
backward pass, optimiser step), because activations are freed while gradients appear.
Validated against allocator-level measurements of real CPU training steps
(``tests/planner/test_memory.py``, ``docs/planner.md``).

The run is described by one object, :class:`PlanOptions` (the network, the batch per device and
every memory lever), which :func:`plan_memory`, :func:`~dit_lightning.planner.recommend`, auto-fit
and the ``plan`` command share. A new lever is a field there and its effect here, plus its flag
in ``commands/plan.py``; keyword calls (``plan_memory("DiT-XL/2", micro_batch=8)``) set fields.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional, TypeVar, Union

from ..models.dit import check_block_options, resolve_checkpoint_blocks
from ..models.flops import DiTShape, shape_of
from ..precision import TRAINING_PRECISIONS, TrainingPrecision, is_mixed, itemsize
from .hardware import INTERCONNECTS, GPUSpec, gpu_spec

Strategy = Literal["ddp", "fsdp"]
Sharding = Literal["FULL_SHARD", "SHARD_GRAD_OP"]
OptimizerName = Literal["adamw", "adamw8bit", "sgd"]
AttentionKind = Literal["auto", "flash", "math"]
DeviceKind = Literal["cuda", "cpu"]
# Recomputed blocks: a number N (the first N) or the model's own spelling: "none", "all", "half",
# "first:N", "every:K" (a list of block indices in Python).
CheckpointArg = Union[int, str]
CheckpointSetting = Union[CheckpointArg, Sequence[int]]
_T = TypeVar("_T")

GiB = 1024**3
MiB = 1024**2

# Tensors the hybrid diffusion loss saves for its backward, in units of one fp32 latent
# (N x C x H x W): counted from the autograd graph of GaussianDiffusion.training_losses.
LOSS_SAVED_LATENTS = 20
# Gradient bytes in flight through a block in the backward pass, in units of one fp32
# residual-stream tensor (N x T x D): the incoming residual gradient plus the one being
# produced (measured: 2.1-2.2 on CPU).
BACKWARD_TRANSIENT_TD = 2
# CUDA-side costs the caching allocator does not see (or sees only as reserved memory).
CUDA_CONTEXT_BYTES = 600 * MiB  # CUDA context + kernels (lazy loading), outside the allocator
NCCL_BYTES = 512 * MiB  # NCCL communicator buffers when world_size > 1
CUDA_WORKSPACE_BYTES = 64 * MiB  # cuBLAS/cuDNN workspaces, allocated through the allocator
FRAGMENTATION = 0.08  # reserved-but-unallocated memory as a fraction of the allocated peak

# What plan_memory plans where PlanOptions leaves a searched setting unset.
PLAN_DEFAULTS: dict[str, Any] = dict(
    micro_batch=32,
    accumulate_grad_batches=1,
    precision="bf16-mixed",
    activation_checkpointing="none",
    strategy="ddp",
    sharding="FULL_SHARD",
    ddp_gradient_as_bucket_view=False,  # Lightning's DDPStrategy (recommend plans DiTDDPStrategy's True)
)


@dataclass(frozen=True)
class PlanOptions:
    """A DiT training run as the planner sees it: the network, the batch per device and every
    memory lever. :func:`plan_memory`, :func:`~dit_lightning.planner.recommend`, auto-fit's
    :class:`~dit_lightning.autofit.FitProblem` and the ``plan`` command all take this one object.

    The settings ``recommend`` searches (``micro_batch``, ``accumulate_grad_batches``, ``precision``,
    ``activation_checkpointing``, ``strategy``, ``sharding``) may be left unset (None):
    :func:`plan_memory` then plans :data:`PLAN_DEFAULTS` (micro-batch 32, bf16-mixed, no block
    recomputed, DDP, FULL_SHARD, no accumulation) and ``recommend`` searches them; set, they are
    pinned. Build variants with :meth:`replace`. The ``plan`` command has a flag per field.

    Args:
        model: a registered name (DiT-XL/2...) or custom with depth / hidden_size / num_heads / patch_size.
        latent_size: latent side: 32 for 256px images, 64 for 512px.
        depth: override the named model's depth (or set it for custom).
        hidden_size: override the hidden size.
        num_heads: override the number of heads.
        patch_size: override the patch size.
        in_channels: latent channels (4 for the SD VAE).
        num_classes: number of classes (1000 for ImageNet).
        learn_sigma: the network predicts the variance too (twice the output channels).
        mlp_ratio: MLP width over the hidden size.
        qk_norm: the model's QK-norm (--model.qk_norm): LayerNorm of q and k, more saved tensors per block.
        norm: the block's norms (--model.norm): layernorm (DiT) or rmsnorm (LightningDiT); unset: the
            named model's.
        mlp: the feed-forward (--model.mlp): gelu (DiT) or swiglu (LightningDiT); unset: the named model's.
        pos_embed: sincos (DiT) or rope (LightningDiT's rotary q and k); unset: the named model's.
        wo_shift: adaLN without shifts (--model.wo_shift); unset: the named model's.
        class_token_dim: REG's class token of that width (a run with --model.repa.class_token_weight > 0:
            the encoder's width, 768 for DINOv2 ViT-B): one more token per sequence, its entry and exit
            projections; unset: none.
        micro_batch: per-GPU batch of one forward/backward (unset: 32 in plan mode; with --fit searched,
            set: pinned).
        accumulate_grad_batches: gradient accumulation; >1 keeps the gradients alive through the next
            forward (unset: 1 in plan mode; with --fit searched, set: pinned).
        precision: 32-true, 16-mixed or bf16-mixed: *-mixed keeps fp32 weights and autocasts (unset:
            bf16-mixed in plan mode; with --fit searched).
        activation_checkpointing: recomputed blocks, as the model takes them: none, all, half, first:N,
            every:K, a number N (the first N) or a list of block indices (unset: none in plan mode;
            with --fit searched).
        strategy: ddp (everything replicated) or fsdp (per-block units; unset: ddp in plan mode, with
            --fit searched).
        sharding: FSDP sharding: FULL_SHARD shards weights, gradients, optimizer and EMA;
            SHARD_GRAD_OP keeps full 16-bit weights during forward/backward (unset: FULL_SHARD in
            plan mode, with --fit searched).
        world_size: number of GPUs (data parallel), over all nodes.
        shard_group: FSDP hybrid sharding (HSDP): shard within groups of this many GPUs (a node's)
            and replicate across groups; unset: shard over all of them.
        ddp_gradient_as_bucket_view: DDP option that removes the bucket copy of the gradients
            (unset: false for plan mode, Lightning's DDPStrategy; true for --fit, whose answer names
            DiTDDPStrategy).
        optimizer: adamw (2 fp32 states), adamw8bit (bitsandbytes) or sgd (momentum).
        fused_optimizer: fused AdamW (no full-size temporary); unset: on CUDA, as the project's
            module does.
        ema: keep the fp32 EMA copy of the weights.
        attention: SDPA kernel family: auto is flash (O(T): PyTorch picks a flash,
            memory-efficient or cuDNN kernel); math materialises the T x T attention matrix.
        device: cuda (adds the CUDA context, workspaces and allocator headroom) or cpu (what the
            CPU allocator sees: used to validate the model).
        repa_projector_dim: REPA's projector width (--model.repa.projector_dim, 2048); unset: no REPA.
        repa_feature_dim: the REPA encoder's feature width (768 for DINOv2 ViT-B).
        repa_encoder_params: the REPA encoder's parameters when it runs online (86580480 for DINOv2
            ViT-B/14); 0: its features come from the store.
        communication: the gradient reduction (dit_lightning.communication): DDP none (fp32), bf16,
            fp16, powersgd or powersgd:R; FSDP none / bf16 / fp16 (its reduce_dtype); it prices the
            step's communication (:mod:`.communication`), not its memory.
        interconnect: the link between a node's GPUs (INTERCONNECT_NAMES), optionally +network between
            nodes (nvlink4+ib-ndr); unset: the GPU's own.
        num_nodes: the nodes the GPUs are spread over.
    """

    # the network
    model: str = "DiT-XL/2"
    latent_size: int = 32
    depth: Optional[int] = None
    hidden_size: Optional[int] = None
    num_heads: Optional[int] = None
    patch_size: Optional[int] = None
    in_channels: int = 4
    num_classes: int = 1000
    learn_sigma: bool = True
    mlp_ratio: float = 4.0
    qk_norm: bool = False
    norm: Optional[str] = None
    mlp: Optional[str] = None
    pos_embed: Optional[str] = None
    wo_shift: Optional[bool] = None
    class_token_dim: Optional[int] = None
    # the batch per device and the settings recommend searches (None: PLAN_DEFAULTS / searched)
    micro_batch: Optional[int] = None
    accumulate_grad_batches: Optional[int] = None
    precision: Optional[TrainingPrecision] = None
    activation_checkpointing: Optional[CheckpointSetting] = None
    strategy: Optional[Strategy] = None
    sharding: Optional[Sharding] = None
    # the layout and the other levers
    world_size: int = 1
    shard_group: Optional[int] = None
    ddp_gradient_as_bucket_view: Optional[bool] = None
    optimizer: OptimizerName = "adamw"
    fused_optimizer: Optional[bool] = None
    ema: bool = True
    attention: AttentionKind = "auto"
    device: DeviceKind = "cuda"
    # REPA (docs/recipes.md): the projector's width (None: no REPA), the encoder's feature width, and
    # the frozen encoder's parameters when it runs online (0: its features come from the store)
    repa_projector_dim: Optional[int] = None
    repa_feature_dim: int = 768
    repa_encoder_params: int = 0
    # communication (step time only)
    communication: str = "none"
    interconnect: Optional[str] = None
    num_nodes: int = 1

    @classmethod
    def of(cls, options: Union[PlanOptions, str, None] = None, **levers: Any) -> PlanOptions:
        """Options from options, a model name or nothing (the defaults), with ``levers`` (field
        names) changed: what the keyword calls ``plan_memory("DiT-XL/2", micro_batch=8)`` build."""
        if isinstance(options, PlanOptions):
            return options.replace(**levers) if levers else options
        if options is not None:
            levers = {"model": options, **levers}
        return cls(**levers)

    def replace(self, **changes: Any) -> PlanOptions:
        """These options with some fields changed."""
        return dataclasses.replace(self, **changes)

    def planned(self) -> PlanOptions:
        """These options with :data:`PLAN_DEFAULTS` for the settings left unset (what
        :func:`plan_memory` plans)."""
        return self.replace(**{k: v for k, v in PLAN_DEFAULTS.items() if getattr(self, k) is None})

    @property
    def shape(self) -> DiTShape:
        """The network's :class:`~dit_lightning.models.flops.DiTShape`."""
        check_block_options(
            **{k: v for k, v in (("norm", self.norm), ("mlp", self.mlp), ("pos_embed", self.pos_embed)) if v}
        )
        return shape_of(
            self.model,
            input_size=self.latent_size,
            depth=self.depth,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            patch_size=self.patch_size,
            in_channels=self.in_channels,
            num_classes=self.num_classes,
            learn_sigma=self.learn_sigma,
            mlp_ratio=self.mlp_ratio,
            norm=self.norm,
            mlp=self.mlp,
            pos_embed=self.pos_embed,
            wo_shift=self.wo_shift,
            class_token_dim=self.class_token_dim,
        )

    @property
    def sharded(self) -> bool:
        """FSDP over several ranks (FSDP on one device shards nothing)."""
        return self.strategy == "fsdp" and self.world_size > 1

    def param_counts(self) -> dict[str, int]:
        """The network's :func:`param_counts`."""
        return param_counts(self.shape, self.qk_norm)


# The help lists the interconnect table as it is (one source: hardware.py).
PlanOptions.__doc__ = (PlanOptions.__doc__ or "").replace("INTERCONNECT_NAMES", ", ".join(INTERCONNECTS))


@dataclass
class MemoryPlan:
    """Per-GPU peak memory of one training step, broken down, and whether it fits."""

    # --- the configuration -------------------------------------------------------------
    model: str
    depth: int
    hidden_size: int
    num_heads: int
    patch_size: int
    latent_size: int
    tokens: int
    parameters_count: int
    micro_batch: int
    precision: str
    attention: str
    device: str
    checkpointed_blocks: int
    strategy: str
    sharding: Optional[str]
    world_size: int
    optimizer: str
    fused_optimizer: bool
    ema: bool
    accumulate_grad_batches: int
    # --- the breakdown at the peak (bytes) ----------------------------------------------
    peak_phase: str
    parameters: int
    gradients: int
    optimizer_states: int
    ema_weights: int
    communication_buffers: int
    weight_copies_16bit: int
    activations: int
    temporaries: int
    peak_allocated: int  # comparable to torch.cuda.max_memory_allocated
    cuda_context: int
    allocator_headroom: int
    total: int  # what the device must hold
    budget: Optional[int] = None
    gpu: Optional[str] = None
    fits: Optional[bool] = None
    static: int = 0  # parameters + gradients + optimizer states + EMA (the state that sharding divides)
    phases: dict[str, int] = field(default_factory=dict)
    activations_per_block: dict[str, int] = field(default_factory=dict)
    assumptions: list[str] = field(default_factory=list)

    @property
    def headroom(self) -> Optional[int]:
        """Bytes left on the device (negative: over budget)."""
        return None if self.budget is None else self.budget - self.total

    def breakdown(self) -> dict[str, int]:
        """The terms of ``total`` (bytes)."""
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer states": self.optimizer_states,
            "EMA weights": self.ema_weights,
            "communication buffers": self.communication_buffers,
            "16-bit weight copies": self.weight_copies_16bit,
            "activations": self.activations,
            "temporaries": self.temporaries,
            "CUDA context": self.cuda_context,
            "allocator headroom": self.allocator_headroom,
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d["headroom"] = self.headroom
        d["total_gib"] = self.total / GiB
        d["peak_allocated_gib"] = self.peak_allocated / GiB
        return d

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


# --------------------------------------------------------------------------------------
# Parameter counts
# --------------------------------------------------------------------------------------


def qk_norm_param_count(s: DiTShape) -> int:
    """Parameters of one block's QK-norm: two LayerNorms (weight and bias) over a head's width, or
    two RMSNorms (a gain each) with ``norm: rmsnorm``."""
    return 2 * (1 if s.norm == "rmsnorm" else 2) * (s.qkv_dim // s.num_heads)


def block_param_count(s: DiTShape, qk_norm: bool = False) -> int:
    """Parameters of one DiT block (qkv, proj, the feed-forward, adaLN, RMSNorm's gains; the QK-norm's
    with ``qk_norm``)."""
    return block_matmul_param_count(s) + 2 * s.norm_params + (qk_norm_param_count(s) if qk_norm else 0)


def block_matmul_param_count(s: DiTShape) -> int:
    """Parameters of one block's matrix multiplications and their biases (what autocast casts)."""
    d, m, k = s.hidden_size, s.mlp_hidden, s.adaln_chunks
    mlp = (d * m + m) * (s.mlp_matrices - 1) + (m * d + d)  # GELU: fc1, fc2; SwiGLU: w12 (2m rows), w3
    return (d * 3 * d + 3 * d) + (d * d + d) + mlp + (d * k * d + k * d)


def param_counts(s: DiTShape, qk_norm: bool = False) -> dict[str, int]:
    """Parameter counts by role: totals, trainable, per block, and the groups that matter
    for memory (autocast casts matmul weights; the embedding table, pos_embed and the
    QK-norm's LayerNorms it does not)."""
    d, p = s.hidden_size, s.patch_size
    blk = block_param_count(s, qk_norm)
    patch = s.in_channels * p * p * d + d
    t_mlp = s.frequency_embedding_size * d + d + d * d + d
    y_table = (s.num_classes + int(s.class_dropout_prob > 0)) * d
    final_matmul = (d * 2 * d + 2 * d) + (d * p * p * s.out_channels + p * p * s.out_channels)
    token_in, token_out = s.class_token_params  # REG's class token: entry with the embedders, exit with the tail
    final_matmul += token_out
    final = final_matmul + s.norm_params
    token_matmul = token_in - 2 * d if token_in else 0  # its LayerNorm is not cast
    pos = s.tokens * d
    total = patch + t_mlp + y_table + token_in + s.depth * blk + final + pos
    return {
        "total": total,
        "trainable": total - pos,  # pos_embed is a fixed, requires_grad=False parameter
        "block": blk,
        "block_matmul": block_matmul_param_count(s),  # cast to 16 bits by autocast (norms are not)
        "head": patch + t_mlp + y_table + token_in,
        "tail": final,
        "pos_embed": pos,
        "matmul_nonblock": patch + t_mlp + token_matmul + final_matmul,  # cast to 16 bits by autocast
    }


# --------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------


def block_activation_terms(
    s: DiTShape,
    n: int,
    mixed: bool,
    attention: Literal["flash", "math"],
    device: str = "cuda",
    qk_norm: bool = False,
) -> dict[str, int]:
    """Bytes one (non-checkpointed) DiT block saves for backward, tensor by tensor.

    ``mixed``: autocast with a 16-bit dtype (matmul inputs/outputs 16-bit, LayerNorm fp32).
    ``flash`` (flash / memory-efficient / cuDNN / CPU-flash SDPA kernels) keeps q, k, v (views
    of the qkv output), the output and a logsumexp: O(T). ``math`` keeps the softmax matrix:
    O(T^2). PyTorch's CPU math path computes 16-bit attention in fp32, so there the attention
    tensors are fp32 even under autocast. ``qk_norm``: the LayerNorms of q and k add their
    statistics and outputs (:func:`qk_norm_terms`). LightningDiT's options (``s.norm``, ``s.mlp``,
    ``s.pos_embed``, ``s.wo_shift``) change their own tensors (:func:`lightning_block_terms`).
    """
    t, d, m, h = s.sequence, s.hidden_size, s.mlp_hidden, s.num_heads
    f, b = 4, (2 if mixed else 4)
    td, tm = n * t * d, n * t * m
    terms = {
        "block input (norm1)": td * f,
        "norm1 output (modulate)": td * f,
        "modulate1 output (qkv)": td * b,
    }
    if attention == "flash":
        terms["qkv output (q, k, v views)"] = 3 * td * b
        terms["attention output (proj input)"] = td * b
        terms["attention logsumexp"] = n * h * t * 4
    else:
        ab = 4 if (device == "cpu" or not mixed) else 2
        terms["scaled q, k and contiguous v"] = 3 * td * ab
        terms["softmax probabilities (T^2)"] = n * h * t * t * ab
        terms["attention output (proj input)"] = td * b
    terms.update(
        {
            "proj output (gate)": td * b,
            "residual (norm2)": td * f,
            "norm2 output (modulate)": td * f,
            "modulate2 output (fc1)": td * b,
            "fc1 output (GELU)": tm * b,
            "GELU output (fc2)": tm * b,
            "fc2 output (gate)": td * b,
            "LayerNorm mean/rstd": 2 * 2 * n * t * 4,
            # SiLU(c) for the adaLN linear, its 6D output (shift/scale/gate views), 1 + scale x2
            "adaLN (per sample)": n * d * 9 * b,
        }
    )
    if qk_norm:
        qk = rms_qk_norm_terms if s.norm == "rmsnorm" else qk_norm_terms
        terms.update(qk(s, n, mixed, attention, device))
    return lightning_block_terms(s, n, mixed, attention, terms)


def lightning_block_terms(
    s: DiTShape, n: int, mixed: bool, attention: Literal["flash", "math"], terms: dict[str, int]
) -> dict[str, int]:
    """DiT's block ``terms`` changed by LightningDiT's options, read off the autograd graph on CPU
    (``tests/planner/test_memory.py``; no CUDA device measured them: the same ops are assumed there).

    SwiGLU keeps ``w12``'s output (gate and value, 2m wide), SiLU(gate) and the product (``w3``'s
    input) instead of GELU's two m-wide tensors. RMSNorm computes in fp32 and keeps its rsqrt and the
    normalised tokens (its gain's input) instead of LayerNorm's mean and rstd. Rope makes new q and k
    that the flash kernels keep (the math path keeps its own scaled copies anyway), and under autocast
    16-bit copies of its tables. Without shifts adaLN's output is 4D, not 6D.
    """
    t, d, m = s.sequence, s.hidden_size, s.mlp_hidden
    b = 2 if mixed else 4
    td, tm = n * t * d, n * t * m
    terms = dict(terms)
    if s.mlp == "swiglu":
        del terms["fc1 output (GELU)"], terms["GELU output (fc2)"]
        terms["modulate2 output (w12)"] = terms.pop("modulate2 output (fc1)")
        terms["w12 output (gate and value)"] = 2 * tm * b
        terms["SiLU(gate) (product)"] = tm * b
        terms["gated product (w3)"] = tm * b
        terms["w3 output (gate)"] = terms.pop("fc2 output (gate)")
    if s.norm == "rmsnorm":
        del terms["LayerNorm mean/rstd"]
        terms["RMSNorm rsqrt"] = 2 * n * t * 4
        terms["RMSNorm normalised tokens (gain)"] = 2 * td * 4
    if s.pos_embed == "rope":
        if attention == "flash":
            terms["rope: rotated q, k (SDPA)"] = 2 * td * b
        if mixed:
            terms["rope: 16-bit cos / sin tables"] = 2 * 2 * t * (s.qkv_dim // s.num_heads) * 2
    if s.wo_shift:
        terms["adaLN (per sample)"] = n * d * (1 + 4 + 2) * b
    return terms


def rms_qk_norm_terms(
    s: DiTShape, n: int, mixed: bool, attention: Literal["flash", "math"], device: str
) -> dict[str, int]:
    """What a QK-norm of RMSNorms (``norm: rmsnorm``, LightningDiT's) adds to a block's saved tensors,
    read off the autograd graph on CPU: each keeps its rsqrt, the fp32 normalised q / k (under autocast
    the fp32 copy of its input instead), and the flash path its output (under autocast, 16-bit, and
    SDPA's copy of it); the math path keeps its normalised tensors, and in fp32 the qkv output through
    the norms' inputs."""
    t, d, h = s.sequence, s.hidden_size, s.num_heads
    b = 2 if mixed else 4
    td = n * t * d
    terms = {"QK-norm rsqrt": 2 * n * h * t * 4, "QK-norm fp32 q, k": 2 * td * 4}
    if attention == "flash":  # the gain's output; under autocast SDPA's 16-bit copy of it too
        terms["QK-norm outputs (gain, SDPA)"] = (2 if mixed else 1) * 2 * td * b
    elif mixed:
        terms["QK-norm outputs (gain)"] = 2 * td * b
    else:
        terms["qkv output (q, k views for the QK-norm)"] = 3 * td * b
    return terms


def qk_norm_terms(s: DiTShape, n: int, mixed: bool, attention: Literal["flash", "math"], device: str) -> dict[str, int]:
    """What the QK-norm (a LayerNorm of q and of k per head) adds to a block's saved tensors.

    Read off the autograd graph on CPU and on an H200 (``tests/planner/test_memory.py``): each
    LayerNorm keeps its mean and rstd; its input is a view of the qkv output, except under
    CUDA autocast, which runs LayerNorm in fp32 and so keeps an fp32 copy of q and k. The flash
    path saves the normalised q and k (16-bit under autocast); those kernels (not CUDA's
    memory-efficient one, which fp32 selects) return the output in q's per-head layout, so
    reshaping it for proj copies it. The math path scales its own copies of q and k (already
    counted) but now keeps the qkv output alive through the LayerNorms' inputs.
    """
    t, d, h = s.sequence, s.hidden_size, s.num_heads
    b = 2 if mixed else 4
    td = n * t * d
    terms = {"QK-norm mean/rstd": 2 * 2 * n * h * t * 4}
    cast_to_fp32 = mixed and device == "cuda"
    if cast_to_fp32:
        terms["QK-norm inputs (fp32 copies of q, k)"] = 2 * td * 4
    if attention == "flash":
        terms["QK-norm outputs (q, k for SDPA)"] = 2 * td * b
        if mixed or device == "cpu":
            terms["attention output copy (proj input)"] = td * b
    elif not cast_to_fp32:
        terms["qkv output (q, k views for the QK-norm)"] = 3 * td * b
    return terms


_LIGHTNING_ASSUMPTIONS = {
    "norm": "RMSNorm keeps its normalised tokens in fp32",
    "mlp": "SwiGLU keeps its 2m-wide w12 output, SiLU(gate) and the product",
    "pos_embed": "rope keeps rotated q and k",
    "wo_shift": "adaLN without shifts",
}
_DIT_BLOCK = (False, "layernorm", "gelu", "sincos")


def checkpointed_block_bytes(s: DiTShape, n: int) -> int:
    """A recomputed block keeps only its input (fp32 residual stream)."""
    return n * s.sequence * s.hidden_size * 4


def nonblock_activation_terms(s: DiTShape, n: int, mixed: bool) -> dict[str, int]:
    """Embedding, final layer and loss tensors saved for backward."""
    t, d = s.sequence, s.hidden_size
    f, b = 4, (2 if mixed else 4)
    latent = n * s.in_channels * s.input_size * s.input_size
    return {
        "patch-embed input": latent * b,
        "timestep/label embedding": n * (s.frequency_embedding_size * b + d * (f + b) + d * f),
        "final layer (norm, modulate, linear input)": n * t * d * (f + f + b) + n * d * 4 * b,
        "hybrid loss": LOSS_SAVED_LATENTS * latent * 4,
        # REG's class token: its noisy input and entry (Linear, LayerNorm in fp32 with its statistics),
        # the exit's output and its loss target
        **(
            {"class token (entry, exit, target)": n * (s.class_token_dim * (b + 4 + 4) + d * (b + f) + 2 * 4)}
            if s.class_token_dim
            else {}
        ),
        # RMSNorm's normalised tokens (its gain's input) and rsqrt
        **({"final RMSNorm": n * t * d * 4 + n * t * 4} if s.norm == "rmsnorm" else {}),
    }


# --------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------


def checkpointed_block_indices(spec: Union[CheckpointArg, Sequence[int], None], depth: int) -> tuple[int, ...]:
    """The blocks a checkpointing setting recomputes (as :class:`~dit_lightning.models.DiT` reads it;
    a number written as a string, "12", is the first 12)."""
    if isinstance(spec, str) and spec.strip().isdigit():
        spec = int(spec)
    return resolve_checkpoint_blocks(spec, depth)


def _optimizer_bytes(name: str, trainable: int) -> tuple[int, str]:
    if name == "adamw":
        return 8 * trainable, "AdamW: exp_avg and exp_avg_sq in fp32 (8 B/param)"
    if name == "adamw8bit":
        # bitsandbytes blockwise 8-bit states + one fp32 absmax per 2048-value block and state
        return 2 * trainable + 2 * 4 * (
            trainable // 2048 + 1
        ), "AdamW8bit: two 8-bit states + blockwise absmax (~2 B/param)"
    if name == "sgd":
        return 4 * trainable, "SGD with momentum: one fp32 buffer (4 B/param)"
    raise ValueError(f"unknown optimizer '{name}': adamw, adamw8bit or sgd")


def repa_costs(o: PlanOptions, micro_batch: int, mixed: bool) -> dict[str, int]:
    """What REPA adds to a step: the projector's parameters (trained, no EMA), its saved activations
    and the encoder features of a micro-batch, the online encoder's frozen fp32 weights, and the
    FLOPs per image of the projector (forward and backward) and of the online encoder (forward)."""
    if not o.repa_projector_dim:
        return dict(projector_params=0, activations=0, encoder_bytes=0, flops=0)
    d, p, z, t = o.shape.hidden_size, o.repa_projector_dim, o.repa_feature_dim, o.shape.sequence
    macs = d * p + p * p + p * z  # per token
    act = micro_batch * t * ((4 * p + z) * (2 if mixed else 4) + 4 * z)  # Linear/SiLU outputs + the fp32 features
    return dict(
        projector_params=macs + 2 * p + z,
        activations=act,
        encoder_bytes=4 * o.repa_encoder_params,
        # 2 FLOPs per MAC, x3 for forward + backward; a ViT encoder's forward ~ 2 x params FLOPs per token
        flops=6 * t * macs + 2 * o.repa_encoder_params * t,
    )


def _state_bytes(pc: dict[str, int], shards: int, optimizer: str, ema: bool) -> dict[str, int]:
    """fp32 weights, fp32 gradients, optimiser states and the fp32 EMA held between steps,
    each divided by the number of ranks that shard them (1: replicated)."""
    return {
        "params": 4 * pc["total"] // shards,
        "grads": 4 * pc["trainable"] // shards,
        "optimizer": _optimizer_bytes(optimizer, pc["trainable"])[0] // shards,
        "ema": (4 * pc["total"] // shards) if ema else 0,
    }


def _gathered_bytes(pc: dict[str, int], param_bytes: int, sharding: str) -> int:
    """Unsharded parameters FSDP holds during forward and backward, in the compute dtype."""
    if sharding == "FULL_SHARD":
        # the current and the prefetched block, and the root module (embeddings, final layer)
        return param_bytes * (2 * pc["block"] + pc["head"] + pc["tail"] + pc["pos_embed"])
    return param_bytes * pc["total"]  # SHARD_GRAD_OP: unsharded from forward until the end of backward


def state_per_device(
    model: str = "DiT-XL/2",
    world_size: int = 8,
    strategy: Strategy = "fsdp",
    sharding: Sharding = "FULL_SHARD",
    shard_group: Optional[int] = None,
    precision: TrainingPrecision = "bf16-mixed",
    optimizer: OptimizerName = "adamw",
    ema: bool = True,
    **levers: Any,
) -> dict[str, float]:
    """GiB per device of the state :func:`plan_memory` counts between steps (weights, gradients,
    optimiser states, EMA) and of the parameters FSDP gathers during a step, without activations.

    DDP replicates everything; FSDP FULL_SHARD / SHARD_GRAD_OP shard the state over the ranks
    (over ``shard_group`` ranks with hybrid sharding); SHARD_GRAD_OP keeps the whole model
    gathered, in the compute dtype, from the forward to the end of the backward. ``levers``: any
    other :class:`PlanOptions` field (the network's sizes...).
    """
    o = PlanOptions(
        model=model,
        world_size=world_size,
        strategy=strategy,
        sharding=sharding,
        shard_group=shard_group,
        precision=precision,
        optimizer=optimizer,
        ema=ema,
        **levers,
    )
    pc = o.param_counts()
    shards = (shard_group or world_size) if o.sharded else 1
    out = {k: v / GiB for k, v in _state_bytes(pc, shards, optimizer, ema).items()}
    out["gathered"] = _gathered_bytes(pc, itemsize(precision), sharding) / GiB if o.sharded else 0.0
    out["total"] = sum(out.values())
    return out


def _resolved(value: Optional[_T]) -> _T:
    """A setting :meth:`PlanOptions.planned` has filled in."""
    assert value is not None
    return value


def plan_memory(
    options: Union[PlanOptions, str, None] = None,
    *,
    gpu: Optional[str] = None,
    memory_gib: Optional[float] = None,
    **levers: Any,
) -> MemoryPlan:
    """Predict the per-GPU peak memory of one training step of a DiT.

    Args:
        options: the run (:class:`PlanOptions`), or a model name; the settings it leaves unset are
            :data:`PLAN_DEFAULTS`.
        gpu / memory_gib: the device budget (a GPU name from the table, or GiB).
        levers: :class:`PlanOptions` fields to set or change, by name:
            ``plan_memory("DiT-XL/2", micro_batch=32, precision="16-mixed", gpu="rtx4090")``.
    """
    o = PlanOptions.of(options, **levers).planned()
    shape = o.shape
    model, latent_size, world_size, device = o.model, o.latent_size, o.world_size, o.device
    micro_batch, accumulate_grad_batches = _resolved(o.micro_batch), _resolved(o.accumulate_grad_batches)
    precision, strategy, sharding = _resolved(o.precision), _resolved(o.strategy), _resolved(o.sharding)
    optimizer, ema, shard_group = o.optimizer, o.ema, o.shard_group
    ddp_gradient_as_bucket_view = _resolved(o.ddp_gradient_as_bucket_view)
    if latent_size % shape.patch_size:
        raise ValueError(f"patch size {shape.patch_size} does not divide latent size {latent_size}")
    if precision not in TRAINING_PRECISIONS:
        raise ValueError(f"precision must be {', '.join(TRAINING_PRECISIONS)}, got {precision!r}")
    if micro_batch < 1 or world_size < 1 or accumulate_grad_batches < 1:
        raise ValueError("micro_batch, world_size and accumulate_grad_batches must be >= 1")
    spec: Optional[GPUSpec] = gpu_spec(gpu) if gpu else None
    budget = int(memory_gib * GiB) if memory_gib is not None else (int(spec.usable_gib * GiB) if spec else None)

    n = micro_batch
    mixed = is_mixed(precision)
    attn: Literal["flash", "math"] = "flash" if o.attention == "auto" else o.attention
    recomputed = checkpointed_block_indices(o.activation_checkpointing, shape.depth)
    k = len(recomputed)
    fsdp = o.sharded
    ddp = strategy == "ddp" and world_size > 1
    if shard_group is not None and (shard_group < 1 or world_size % shard_group):
        raise ValueError(f"shard_group {shard_group} must divide world_size {world_size}")
    w = (shard_group or world_size) if fsdp else 1  # HSDP shards within groups of shard_group ranks
    fused = (device == "cuda") if o.fused_optimizer is None else bool(o.fused_optimizer)
    if optimizer != "adamw":
        fused = False

    pc = o.param_counts()
    p_all, p_train, p_blk = pc["total"], pc["trainable"], pc["block"]
    _, opt_note = _optimizer_bytes(optimizer, p_train)

    # ---- static state (sharded by FSDP) -------------------------------------------------
    state = _state_bytes(pc, w, optimizer, ema)
    params, grads_full, opt_states, ema_bytes = state["params"], state["grads"], state["optimizer"], state["ema"]
    repa = repa_costs(o, micro_batch, is_mixed(precision))
    if repa["projector_params"]:  # trained beside the DiT (sharded alike), no EMA; the online encoder replicated
        proj = _state_bytes(
            {"total": repa["projector_params"], "trainable": repa["projector_params"]}, w, optimizer, False
        )
        params += proj["params"] + repa["encoder_bytes"]
        grads_full += proj["grads"]
        opt_states += proj["optimizer"]
    g_blk = 4 * p_blk // w
    g_tail = 4 * pc["tail"] // w
    buckets = 4 * p_train if (ddp and not ddp_gradient_as_bucket_view) else 0
    pb = itemsize(precision)  # FSDP's unsharded parameter dtype (Lightning: param_dtype follows precision)
    working = _gathered_bytes(pc, pb, sharding) if fsdp else 0

    # ---- activations ----------------------------------------------------------------------
    blk_terms = block_activation_terms(shape, n, mixed, attn, device, o.qk_norm)
    a_full = sum(blk_terms.values())
    a_ckpt = checkpointed_block_bytes(shape, n)
    nb_terms = nonblock_activation_terms(shape, n, mixed)
    a_nonblock = sum(nb_terms.values()) + repa["activations"]  # REPA's projector: alive until its backward
    ckpt = set(recomputed)
    a_blocks = [a_ckpt if i in ckpt else a_full for i in range(shape.depth)]
    # autocast keeps 16-bit copies of matmul weights; FSDP's mixed precision replaces them
    w16_blk = 2 * pc["block_matmul"] if (mixed and not fsdp) else 0
    w16_nonblock = 2 * pc["matmul_nonblock"] if (mixed and not fsdp) else 0
    td = n * shape.sequence * shape.hidden_size
    trans_bwd = BACKWARD_TRANSIENT_TD * td * 4
    if attn == "math":
        # In the softmax backward the saved probabilities, their gradient and the logits'
        # gradient coexist (3 T x T tensors) while the block's other activations are mostly
        # freed: the block then holds ~3 T^2 + 2 TD instead of its saved set (measured on CPU
        # with T^2 from 0.5x to 1.5x of the rest of the block: within 5%, conservative).
        probs = blk_terms["softmax probabilities (T^2)"]
        trans_bwd = max(trans_bwd, 3 * probs + trans_bwd - a_full)
    fsdp_grad_unsharded = (pb * p_blk) if fsdp else 0
    persistent_grads = accumulate_grad_batches > 1

    static = params + grads_full + opt_states + ema_bytes
    base = params + opt_states + ema_bytes + buckets
    phases: dict[str, dict[str, int]] = {}

    # forward end: every saved activation and every 16-bit weight copy (autocast cache)
    phases["forward end"] = dict(
        gradients=grads_full if persistent_grads else 0,
        weights16=w16_nonblock + shape.depth * w16_blk,
        activations=sum(a_blocks) + a_nonblock,
        temporaries=0,
        working=working,
    )
    # backward through block i (last to first); linear in i, but cheap to enumerate
    for i in reversed(range(shape.depth)):
        done = shape.depth - 1 - i
        g = grads_full if persistent_grads else g_tail + done * g_blk
        if fsdp:
            g = grads_full
        w16 = w16_nonblock + sum(w16_blk for j in range(i + 1) if j not in ckpt) + (w16_blk if i in ckpt else 0)
        act = a_nonblock + sum(a_blocks[:i]) + a_full
        tmp = trans_bwd + fsdp_grad_unsharded
        phases[f"backward block {i}"] = dict(
            gradients=g, weights16=w16, activations=act, temporaries=tmp, working=working
        )
    # optimiser step: all gradients; foreach AdamW allocates one fp32 temporary per parameter
    opt_tmp = 0 if (fused or optimizer != "adamw") else 4 * p_train // w
    phases["optimizer step"] = dict(gradients=grads_full, weights16=0, activations=0, temporaries=opt_tmp, working=0)

    totals = {name: base + sum(v.values()) for name, v in phases.items()}
    peak_name = max(totals, key=totals.__getitem__)
    at = phases[peak_name]
    peak = totals[peak_name]

    if device == "cuda":
        peak += CUDA_WORKSPACE_BYTES
        context = CUDA_CONTEXT_BYTES + (NCCL_BYTES if world_size > 1 else 0)
        frag = int(FRAGMENTATION * peak)
    else:
        context = frag = 0
    total = peak + context + frag

    assumptions = [
        f"attention: {attn} ({'O(T) logsumexp' if attn == 'flash' else 'O(T^2) softmax matrix'})",
        "precision: fp32 master weights; "
        + ("autocast to 16 bits, LayerNorm and residual stream in fp32" if mixed else "fp32 everywhere"),
        opt_note
        + (
            " (fused: no temporary)"
            if fused
            else (" (foreach: one fp32 temporary per parameter in the step)" if optimizer == "adamw" else "")
        ),
        "EMA: fp32 copy of all weights" + (" (sharded)" if fsdp else "") if ema else "no EMA",
        f"activation checkpointing: {k} of {shape.depth} blocks keep only their input"
        + (
            f" (blocks {', '.join(map(str, recomputed))})"
            if 0 < k < shape.depth and recomputed != tuple(range(k))
            else ""
        ),
        "gradients set to None between steps (zero_grad(set_to_none=True))"
        + ("; kept alive across accumulated micro-batches" if persistent_grads else ""),
    ]
    if o.qk_norm:
        assumptions.insert(
            1,
            (
                "QK-norm: each block also keeps the RMSNorm'd q and k, their fp32 forms and rsqrt"
                if shape.norm == "rmsnorm"
                else "QK-norm: each block also keeps the LayerNorm'd q and k and their statistics"
                + (" (LayerNorm in fp32 under CUDA autocast)" if mixed and device == "cuda" else "")
            ),
        )
    lightning = [label for key, label in _LIGHTNING_ASSUMPTIONS.items() if getattr(shape, key) not in _DIT_BLOCK]
    if lightning:
        assumptions.insert(
            1,
            "LightningDiT's block: " + "; ".join(lightning) + " (saved tensors measured on CPU; CUDA assumed the same)",
        )
    if shape.class_token_dim:
        assumptions.append(
            f"REG's class token ({shape.class_token_dim} wide): every block runs 1 + {shape.tokens} tokens; its entry "
            "and exit projections with the embedders and the final layer"
        )
    if repa["projector_params"]:
        assumptions.append(
            f"REPA: projector {repa['projector_params']:,} parameters (trained, no EMA), its activations and the "
            "features of the micro-batch"
            + (
                f"; the encoder online ({o.repa_encoder_params:,} frozen fp32 parameters, its forward outside the peak)"
                if o.repa_encoder_params
                else "; encoder features precomputed in the store"
            )
        )
    if ddp:
        assumptions.append(
            "DDP: gradient buckets are a second fp32 copy of the gradients"
            + (" (bucket view: none)" if ddp_gradient_as_bucket_view else "")
        )
    if fsdp:
        assumptions.append(
            f"FSDP {sharding} (DiTFSDPStrategy: one unit per DiT block and per DiT), param_dtype "
            f"{'bf16/fp16' if mixed else 'fp32'} "
            "(Lightning's FSDP precision); the EMA sharded like the model"
        )
    if device == "cuda":
        assumptions.append(
            f"CUDA: +{CUDA_WORKSPACE_BYTES // MiB} MiB workspaces (allocated), +{CUDA_CONTEXT_BYTES // MiB} MiB context"
            + (f", +{NCCL_BYTES // MiB} MiB NCCL" if world_size > 1 else "")
            + f", +{FRAGMENTATION:.0%} allocator fragmentation headroom"
        )

    return MemoryPlan(
        model=model,
        depth=shape.depth,
        hidden_size=shape.hidden_size,
        num_heads=shape.num_heads,
        patch_size=shape.patch_size,
        latent_size=latent_size,
        tokens=shape.tokens,
        parameters_count=p_all,
        micro_batch=n,
        precision=precision,
        attention=attn,
        device=device,
        checkpointed_blocks=k,
        strategy=strategy if world_size > 1 else ("single device" if strategy == "ddp" else strategy),
        sharding=sharding if fsdp else None,
        world_size=world_size,
        optimizer=optimizer,
        fused_optimizer=fused,
        ema=ema,
        accumulate_grad_batches=accumulate_grad_batches,
        peak_phase=peak_name,
        parameters=params + at["working"],
        gradients=at["gradients"],
        optimizer_states=opt_states,
        ema_weights=ema_bytes,
        communication_buffers=buckets,
        weight_copies_16bit=at["weights16"],
        activations=at["activations"],
        temporaries=at["temporaries"] + (CUDA_WORKSPACE_BYTES if device == "cuda" else 0),
        peak_allocated=peak,
        cuda_context=context,
        allocator_headroom=frag,
        total=total,
        budget=budget,
        gpu=spec.name if spec else None,
        fits=None if budget is None else total <= budget,
        static=static,
        phases={
            k_: v
            for k_, v in totals.items()
            if not k_.startswith("backward block")
            or k_ in (peak_name, f"backward block {shape.depth - 1}", "backward block 0")
        },
        activations_per_block=blk_terms,
        assumptions=assumptions,
    )
