"""What a training step sends between GPUs, how long that takes on the link, and how much of it the
compute hides.

Bytes, per optimiser step and per device, counted from the network's tensors:

* **DDP** all-reduces every trainable gradient once per optimiser step (accumulation micro-batches run
  under ``no_sync``): the payload is the gradients in the reduction's format -- fp32 (``none``), 16 bits
  (``bf16`` / ``fp16``: half), or PowerSGD's ``(rows + cols) x r`` per matrix-shaped gradient (its matrix
  view ``(shape[0], -1)``, when that is at least 2x smaller, PyTorch's rule) plus every other gradient
  uncompressed, in fp32. A ring all-reduce sends ``2 (W - 1) / W`` times the payload from each device.
* **FSDP** (FSDP1 and FSDP2, one unit per block and one root unit) per *micro-batch*: an all-gather of
  every unit's parameters in the compute dtype in the forward, again for the blocks in the backward under
  FULL_SHARD / ``reshard_after_forward`` (the root unit stays gathered), and a reduce-scatter of the
  gradients in the reduce dtype; each sends ``(W - 1) / W`` of the full tensor. **HSDP** adds an
  all-reduce of each shard group's gradient shard across the replicas, over the network between nodes.

Time: bytes over the link's effective bandwidth (:data:`~.hardware.INTERCONNECTS`; between nodes the
slower of the node's link and the network). Hiding: DDP all-reduces each bucket while the backward
pass goes on, so during the last micro-batch's backward; what is left when the backward ends is
exposed, and the last bucket (the first layers' gradients, ready last) always is:
``exposed = max(0, comm - backward) + last bucket``. FSDP prefetches the next unit's gathers and
reduce-scatters the previous one's gradients during the micro-batch's forward and backward:
``exposed = max(0, comm - compute) + one unit's collectives`` per micro-batch (the first gather and the
last reduce-scatter wait). Not modelled: collective latency (~10-50 us each), PowerSGD's own
matmuls and orthogonalisation (small next to a DiT block), contention with the data loader.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from ..communication import POWERSGD_RANK, fsdp_reduce_dtype, parse_communication
from ..models.flops import DiTShape
from ..precision import itemsize
from .hardware import Interconnect, default_links, interconnect
from .memory import PlanOptions

DDP_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default, in bytes of the (fp32) gradients
POWERSGD_MIN_COMPRESSION = 2  # PowerSGDState's min_compression_rate default


def gradient_shapes(s: DiTShape, qk_norm: bool = False) -> dict[str, list[tuple[int, ...]]]:
    """The trainable tensors of a DiT by unit: ``root`` (embedders, final layer) and ``block`` (one
    block's). The fixed ``pos_embed`` is not trainable (it is gathered by FSDP, never reduced)."""
    d, p, m = s.hidden_size, s.patch_size, s.mlp_hidden
    root: list[tuple[int, ...]] = [
        (d, s.in_channels, p, p),
        (d,),  # patch embedding
        (d, s.frequency_embedding_size),
        (d,),
        (d, d),
        (d,),  # timestep MLP
        (s.num_classes + int(s.class_dropout_prob > 0), d),  # label table
        (2 * d, d),
        (2 * d,),
        (p * p * s.out_channels, d),
        (p * p * s.out_channels,),  # final layer
    ]
    rows = 2 * m if s.mlp == "swiglu" else m  # SwiGLU's w12 holds the gate's and the value's rows
    k = s.adaln_chunks
    block: list[tuple[int, ...]] = [
        (3 * d, d),
        (3 * d,),
        (d, d),
        (d,),
        (rows, d),
        (rows,),
        (d, m),
        (d,),
        (k * d, d),
        (k * d,),
    ]
    if s.norm == "rmsnorm":  # RMSNorm's gains: norm1, norm2 per block, the final norm at the root
        block += [(d,)] * 2
        root.append((d,))
    if qk_norm:
        head = s.qkv_dim // s.num_heads
        block += [(head,)] * (2 if s.norm == "rmsnorm" else 4)
    if s.class_token_dim:  # REG's class token: its entry (Linear, affine LayerNorm) and exit (Linear)
        c = s.class_token_dim
        root += [(d, c), (d,), (d,), (d,), (c, d), (c,)]
    return {"root": root, "block": block}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def powersgd_numel(shape: tuple[int, ...], rank: int) -> int:
    """Elements PowerSGD all-reduces for one gradient: ``(rows + cols) x r`` for the matrix view when
    that compresses at least 2x (PyTorch's ``_should_compress``), else the gradient itself."""
    n = shape[0]
    cols = _numel(shape) // n
    r = min(n, cols, rank)
    compressed = (n + cols) * r
    return compressed if compressed * POWERSGD_MIN_COMPRESSION < n * cols else n * cols


@dataclass
class CommunicationPlan:
    """One optimiser step's communication per device: bytes, time on the link, the part not hidden."""

    strategy: str
    communication: str
    world_size: int
    num_nodes: int
    link: str  # the interconnect the bytes cross (the slower one across nodes)
    link_gbs: float  # its effective bandwidth
    payload: dict[str, float] = field(default_factory=dict)  # bytes handed to each kind of collective
    bytes_sent: float = 0.0  # per device, ring algorithms
    network_bytes_sent: float = 0.0  # HSDP: of which across nodes
    seconds: float = 0.0  # all of it on the link
    hidden_s: float = 0.0
    exposed_s: float = 0.0  # added to the step
    per_micro_batch: bool = False  # FSDP: repeated for every micro-batch (included above)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def links(options: PlanOptions, gpu: Optional[str]) -> tuple[Interconnect, Interconnect]:
    """(inside a node, between nodes) for a run: its ``interconnect`` ("intra" or "intra+network"),
    else the GPU's defaults."""
    intra, network = default_links(gpu)
    if options.interconnect:
        first, _, second = options.interconnect.partition("+")
        intra, network = first or intra, second or network
    a, b = interconnect(intra), interconnect(network)
    if a.between_nodes:
        raise ValueError(f"interconnect '{a.name}' links nodes: give the link inside a node first ({intra}+{a.name})")
    if not b.between_nodes:
        raise ValueError(f"'{b.name}' links the GPUs of a node: give the network between nodes after the '+'")
    return a, b


def plan_communication(
    options: PlanOptions,
    gpu: Optional[str] = None,
    micro_s: float = 0.0,
    backward_share: float = 2 / 3,
) -> CommunicationPlan:
    """The communication of one optimiser step of ``options`` (unset settings as :func:`plan_memory`
    plans them) on ``gpu``'s links; ``micro_s`` (one micro-batch's compute) and ``backward_share`` (the
    backward's part of it) say how much of it can be hidden."""
    o = options.planned()
    assert o.precision is not None and o.accumulate_grad_batches is not None
    kind, named_rank = parse_communication(o.communication)
    rank = named_rank or POWERSGD_RANK
    world, nodes = o.world_size, max(1, o.num_nodes)
    intra, network = links(o, gpu)
    strategy = "fsdp" if o.sharded else "ddp"
    plan = CommunicationPlan(strategy, o.communication, world, nodes, intra.name, intra.effective_gbs)
    if world <= 1:
        return plan
    s = o.shape
    shapes = gradient_shapes(s, o.qk_norm)
    grads = shapes["root"] + shapes["block"] * s.depth
    n_micro = o.accumulate_grad_batches
    ring = (world - 1) / world
    link = intra if nodes == 1 else min(intra, network, key=lambda i: i.effective_gbs)
    plan.link, plan.link_gbs = link.name, link.effective_gbs
    bw = link.effective_gbs * 1e9
    if strategy == "ddp":
        if kind == "powersgd":
            elements = sum(powersgd_numel(g, rank) for g in grads)
            payload = 4.0 * elements  # the fp32 gradient buckets: P, Q and the uncompressed tensors
            plan.notes.append(f"PowerSGD rank {rank} after its warm-up (plain fp32 all-reduce until then)")
        else:
            payload = (2.0 if kind in ("bf16", "fp16") else 4.0) * sum(_numel(g) for g in grads)
        plan.payload = {"all_reduce": payload}
        plan.bytes_sent = 2 * ring * payload
        plan.seconds = plan.bytes_sent / bw
        grad_bytes = 4.0 * sum(_numel(g) for g in grads)
        last_bucket = plan.seconds * min(1.0, DDP_BUCKET_BYTES / grad_bytes)
        window = micro_s * backward_share  # only the last micro-batch's backward reduces
        plan.exposed_s = min(plan.seconds, max(0.0, plan.seconds - window) + last_bucket)
        if n_micro > 1:
            plan.notes.append(f"once per optimiser step: the {n_micro - 1} other micro-batches run under no_sync")
    else:
        param_bytes = itemsize(o.precision)  # the gathered weights are in the compute dtype
        reduce_bytes = itemsize(fsdp_reduce_dtype(o.communication))  # refuses PowerSGD
        root = sum(_numel(g) for g in shapes["root"]) + s.tokens * s.hidden_size  # + the fixed pos_embed
        block = sum(_numel(g) for g in shapes["block"])
        trainable = sum(_numel(g) for g in grads)
        regather = o.sharding == "FULL_SHARD"
        gather = param_bytes * (root + block * s.depth * (2 if regather else 1))
        scatter = reduce_bytes * trainable
        group = o.shard_group if o.shard_group and o.shard_group < world else world
        ring = (group - 1) / group
        payload_mb = {"all_gather": float(gather), "reduce_scatter": float(scatter)}
        sent_mb = ring * (gather + scatter)
        seconds_mb = sent_mb / (intra.effective_gbs * 1e9)
        net_mb = 0.0
        if group < world:  # HSDP: the shard's gradient all-reduced across world / group replicas
            replicas = world // group
            shard = scatter / group
            payload_mb["all_reduce"] = shard
            net_mb = 2 * (replicas - 1) / replicas * shard
            seconds_mb += net_mb / (network.effective_gbs * 1e9)
            plan.notes.append(f"HSDP: {replicas} replicas of {group}-GPU shard groups, {network.name} between them")
        plan.link, plan.link_gbs = intra.name, intra.effective_gbs
        plan.payload = {k: v * n_micro for k, v in payload_mb.items()}
        plan.bytes_sent = (sent_mb + net_mb) * n_micro
        plan.network_bytes_sent = net_mb * n_micro
        plan.seconds = seconds_mb * n_micro
        plan.per_micro_batch = True
        units = s.depth + 1
        exposed_mb = min(seconds_mb, max(0.0, seconds_mb - micro_s) + seconds_mb / units)
        plan.exposed_s = exposed_mb * n_micro
        if n_micro > 1:
            plan.notes.append(f"every micro-batch gathers and reduce-scatters again: x{n_micro}")
    plan.hidden_s = plan.seconds - plan.exposed_s
    return plan
