"""GPU specifications the planner and the throughput monitor need: usable memory, dense peak compute, memory bandwidth,
and the lookup of a ``torch.cuda.get_device_name()`` spelling in that one table.

Figures are vendor datasheet values for dense (non-sparse) tensor-core math with fp32
accumulation; ``usable_gib`` is what ``torch.cuda.get_device_properties(0).total_memory``
reports (a little less than the marketed size: ECC and the driver's reservation);
``link_gbs`` is a rough NCCL bus bandwidth inside one node (NVLink for SXM parts, PCIe for
the others; consumer cards have no P2P). They are approximations for planning, not promises.

The communication model (:mod:`.communication`) reads the links from :data:`INTERCONNECTS` instead:
each with its nominal per-direction bandwidth per GPU, the bandwidth a ring all-reduce achieves on it
(NCCL's "bus bandwidth", what the planner divides bytes by) and the source of both;
:data:`DEFAULT_INTERCONNECT` / :data:`DEFAULT_NETWORK` say which link each GPU of the table has
inside a node and between nodes when the run does not say.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Optional, Union

import torch

from ..precision import short_name


@dataclass(frozen=True)
class GPUSpec:
    """What a GPU model offers to a training step."""

    name: str
    memory_gb: float  # marketed size
    usable_gib: float  # what torch sees as total memory
    bf16_tflops: float  # dense bf16/fp16 tensor cores, fp32 accumulate (0: no bf16)
    fp16_tflops: float  # dense fp16 tensor cores, fp32 accumulate
    tf32_tflops: float  # dense TF32 tensor cores (fp32 matmuls with allow_tf32)
    fp32_tflops: float  # plain fp32 (CUDA cores)
    bandwidth_tbs: float  # memory bandwidth, TB/s
    link_gbs: float  # rough achievable NCCL all-reduce bus bandwidth between GPUs of one node, GB/s

    @property
    def supports_bf16(self) -> bool:
        return self.bf16_tflops > 0

    def dense_tflops(self, dtype: torch.dtype, tf32: bool = False) -> float:
        """Dense peak TFLOP/s for matmuls in ``dtype`` (fp32 on TF32 tensor cores with ``tf32``)."""
        if dtype == torch.bfloat16:
            return self.bf16_tflops
        if dtype == torch.float16:
            return self.fp16_tflops
        if dtype == torch.float32:
            return self.tf32_tflops if tf32 else self.fp32_tflops
        raise ValueError(f"no peak for {dtype} in the GPU table")

    def to_dict(self) -> dict:
        return asdict(self)


GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("rtx3090", 24, 23.7, 71, 71, 35.6, 35.6, 0.936, 12),
        GPUSpec("rtx4090", 24, 23.6, 165, 165, 82.6, 82.6, 1.008, 12),
        GPUSpec("rtx-a6000", 48, 47.5, 155, 155, 77.4, 38.7, 0.768, 12),
        GPUSpec("l4", 24, 22.0, 121, 121, 60, 30.3, 0.300, 12),
        GPUSpec("l40s", 48, 44.4, 362, 362, 183, 91.6, 0.864, 20),
        GPUSpec("v100-32gb", 32, 31.7, 0, 125, 15.7, 15.7, 0.900, 130),
        GPUSpec("a100-40gb", 40, 39.4, 312, 312, 156, 19.5, 1.555, 230),
        GPUSpec("a100-80gb", 80, 79.2, 312, 312, 156, 19.5, 2.039, 230),
        GPUSpec("h100-80gb", 80, 79.1, 989, 989, 494, 67, 3.35, 360),
        GPUSpec("h100-pcie", 80, 79.1, 756, 756, 378, 51, 2.0, 25),
        GPUSpec("h200", 141, 139.8, 989, 989, 494, 67, 4.8, 360),
        # Lower-clocked PCIe-card Hopper variants and the Grace-Hopper superchip's GPU.
        GPUSpec("h100-nvl", 94, 93.0, 836, 836, 418, 60, 3.9, 25),
        GPUSpec("h200-nvl", 141, 139.8, 836, 836, 418, 60, 4.8, 25),
        GPUSpec("gh200", 96, 95.0, 989, 989, 494, 67, 4.0, 360),
        GPUSpec("rtx3090-ti", 24, 23.7, 80, 80, 40, 40, 1.008, 12),
        # GeForce RTX 5090 (Blackwell GB202, 32 GB GDDR7): NVIDIA RTX Blackwell GPU Architecture whitepaper
        # (https://images.nvidia.com/aem-dam/Solutions/geforce/blackwell/nvidia-rtx-blackwell-gpu-architecture.pdf):
        # FP16/BF16 tensor with FP32 accumulate 209.5 dense (419 sparse), TF32 tensor 104.8, FP32 104.8 TFLOPS,
        # 1792 GB/s; PCIe 5.0 without P2P.
        GPUSpec("rtx5090", 32, 31.4, 209.5, 209.5, 104.8, 104.8, 1.792, 20),
    )
}


@dataclass(frozen=True)
class Interconnect:
    """A link between GPUs, per GPU and per direction (GB/s = 1e9 bytes/s)."""

    name: str
    nominal_gbs: float  # the specification's per-direction rate per GPU
    effective_gbs: float  # what a ring all-reduce reaches (NCCL bus bandwidth): the planner's figure
    between_nodes: bool
    description: str
    source: str  # where nominal_gbs comes from, and why effective_gbs is what it is


# PCIe: x16 lanes x transfer rate x 128b/130b coding (PCI-SIG PCIe 4.0 / 5.0 base specifications):
# 31.5 / 63 GB/s per direction. NCCL's all_reduce_perf reaches ~70% of it with P2P (TLP overheads, the
# switch); without P2P (GeForce cards: the driver refuses it) every byte is staged through a host bounce
# buffer and crosses PCIe twice: half of that again. NVLink: per-GPU totals of NVIDIA's datasheets are
# bidirectional (V100 300, A100 600, H100 900, B200 1800 GB/s): half per direction; NVIDIA's published
# NCCL bus bandwidths on DGX systems are ~80% of the per-direction rate. Between nodes: the line rate of
# one adapter per GPU (rail-optimised, as in DGX systems; fewer adapters: divide), InfiniBand at ~90%
# with GPUDirect RDMA, Ethernet (RoCE) at ~80%.
_PCIE = "PCI-SIG PCIe {v} base specification: {rate} GT/s x16, 128b/130b = {gbs} GB/s per direction"
INTERCONNECTS: dict[str, Interconnect] = {
    i.name: i
    for i in (
        Interconnect(
            "pcie4",
            31.5,
            11.0,
            False,
            "PCIe 4.0 x16 without peer-to-peer (through host memory)",
            _PCIE.format(v="4.0", rate=16, gbs=31.5) + "; 70% achieved, halved: each byte crosses PCIe twice",
        ),
        Interconnect(
            "pcie4-p2p",
            31.5,
            22.0,
            False,
            "PCIe 4.0 x16 with peer-to-peer",
            _PCIE.format(v="4.0", rate=16, gbs=31.5) + "; ~70% in NCCL's all_reduce_perf",
        ),
        Interconnect(
            "pcie5",
            63.0,
            22.0,
            False,
            "PCIe 5.0 x16 without peer-to-peer (through host memory)",
            _PCIE.format(v="5.0", rate=32, gbs=63) + "; 70% achieved, halved: each byte crosses PCIe twice",
        ),
        Interconnect(
            "pcie5-p2p",
            63.0,
            44.0,
            False,
            "PCIe 5.0 x16 with peer-to-peer",
            _PCIE.format(v="5.0", rate=32, gbs=63) + "; ~70% in NCCL's all_reduce_perf",
        ),
        Interconnect(
            "nvlink2",
            150.0,
            130.0,
            False,
            "NVLink 2 (V100 SXM2, 6 links)",
            "NVIDIA V100 datasheet: 300 GB/s NVLink (bidirectional); DGX-1 NCCL bus bandwidth ~130 GB/s",
        ),
        Interconnect(
            "nvlink3",
            300.0,
            230.0,
            False,
            "NVLink 3 (A100 SXM4, 12 links, NVSwitch)",
            "NVIDIA A100 datasheet: 600 GB/s NVLink (bidirectional); DGX A100 NCCL bus bandwidth ~230 GB/s",
        ),
        Interconnect(
            "nvlink4",
            450.0,
            360.0,
            False,
            "NVLink 4 (H100 / H200 SXM5, 18 links, NVSwitch)",
            "NVIDIA H100 datasheet: 900 GB/s NVLink (bidirectional); DGX H100 NCCL bus bandwidth ~360 GB/s",
        ),
        Interconnect(
            "nvlink5",
            900.0,
            720.0,
            False,
            "NVLink 5 (B200 / GB200, 18 links, NVSwitch)",
            "NVIDIA Blackwell datasheet: 1.8 TB/s NVLink (bidirectional); 80% achieved as for NVLink 3/4 (estimate)",
        ),
        Interconnect(
            "ib-hdr",
            25.0,
            22.5,
            True,
            "InfiniBand HDR, 200 Gb/s per GPU",
            "NVIDIA ConnectX-6 / InfiniBand HDR: 200 Gb/s line rate; ~90% with GPUDirect RDMA",
        ),
        Interconnect(
            "ib-ndr",
            50.0,
            45.0,
            True,
            "InfiniBand NDR, 400 Gb/s per GPU",
            "NVIDIA ConnectX-7 / InfiniBand NDR: 400 Gb/s line rate; ~90% with GPUDirect RDMA",
        ),
        Interconnect(
            "100gbe",
            12.5,
            10.0,
            True,
            "100 Gb Ethernet per node or GPU (RoCE)",
            "IEEE 802.3 100GBASE: 100 Gb/s line rate; ~80% with RoCE",
        ),
        Interconnect(
            "200gbe",
            25.0,
            20.0,
            True,
            "200 Gb Ethernet (RoCE)",
            "IEEE 802.3 200GBASE: 200 Gb/s line rate; ~80% with RoCE",
        ),
        Interconnect(
            "400gbe",
            50.0,
            40.0,
            True,
            "400 Gb Ethernet (RoCE)",
            "IEEE 802.3 400GBASE: 400 Gb/s line rate; ~80% with RoCE",
        ),
    )
}

# The link between the GPUs of one node for each GPU of the table: NVLink for SXM parts (and the
# Grace-Hopper superchip's NVLink switch systems), PCIe with peer-to-peer for data-centre and
# workstation PCIe cards, PCIe without it for GeForce cards (the driver disables P2P).
DEFAULT_INTERCONNECT: dict[str, str] = {
    "rtx3090": "pcie4",
    "rtx3090-ti": "pcie4",
    "rtx4090": "pcie4",
    "rtx5090": "pcie5",
    "rtx-a6000": "pcie4-p2p",
    "l4": "pcie4-p2p",
    "l40s": "pcie4-p2p",
    "v100-32gb": "nvlink2",
    "a100-40gb": "nvlink3",
    "a100-80gb": "nvlink3",
    "h100-80gb": "nvlink4",
    "h100-pcie": "pcie5-p2p",
    "h100-nvl": "pcie5-p2p",  # its NVLink bridge joins pairs only
    "h200-nvl": "pcie5-p2p",
    "h200": "nvlink4",
    "gh200": "nvlink4",
}
# Between nodes, where the run does not say: what the systems built around these GPUs ship with.
DEFAULT_NETWORK: dict[str, str] = {"a100-40gb": "ib-hdr", "a100-80gb": "ib-hdr", "v100-32gb": "100gbe"}
DEFAULT_NETWORK_FALLBACK = "ib-ndr"  # Hopper systems; consumer cards across nodes rarely have better than 100GbE
CONSUMER_NETWORK = "100gbe"


def interconnect(name: str) -> Interconnect:
    """A link of :data:`INTERCONNECTS` by name."""
    key = name.strip().lower()
    if key not in INTERCONNECTS:
        raise ValueError(f"unknown interconnect '{name}': choose one of {', '.join(INTERCONNECTS)}")
    return INTERCONNECTS[key]


def default_links(gpu: Optional[str]) -> tuple[str, str]:
    """(link inside a node, link between nodes) of a GPU of the table (PCIe 4.0 without P2P and
    100GbE for a GPU the table does not know)."""
    if gpu not in DEFAULT_INTERCONNECT:
        return "pcie4", CONSUMER_NETWORK
    intra = DEFAULT_INTERCONNECT[gpu]
    if gpu in DEFAULT_NETWORK:
        return intra, DEFAULT_NETWORK[gpu]
    return intra, CONSUMER_NETWORK if intra in ("pcie4", "pcie5") else DEFAULT_NETWORK_FALLBACK


_ALIASES = {
    "3090": "rtx3090",
    "4090": "rtx4090",
    "5090": "rtx5090",
    "a6000": "rtx-a6000",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "h100-sxm": "h100-80gb",
    "h100-sxm5": "h100-80gb",
    "v100": "v100-32gb",
}
# Names that stand for more than one entry of the table: refused with the choices, never guessed
# (an "A100" is a 40 GB or an 80 GB card, and the planner's answer differs).
_AMBIGUOUS = {
    "a100": ("a100-40gb", "a100-80gb"),
    "h100": ("h100-80gb", "h100-pcie", "h100-nvl"),
}


def gpu_names() -> str:
    """The GPU names of the table, comma-separated (for help texts and errors)."""
    return ", ".join(GPUS)


def gpu_spec(name: str) -> GPUSpec:
    """Look up a GPU by its name in the table (``rtx4090``, ``a100-80gb``, ``h200``...), a few
    aliases, or the name ``torch.cuda.get_device_name()`` prints (``NVIDIA H100 80GB HBM3``)."""
    key = name.strip().lower().replace("_", "-").replace(" ", "")
    key = _ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    if key in _AMBIGUOUS:
        choices = " or ".join(_AMBIGUOUS[key])
        raise ValueError(f"GPU '{name}' is ambiguous: say which one, {choices}")
    from_device = spec_for_device_name(name)
    if from_device is not None:
        return from_device
    raise ValueError(
        f"unknown GPU '{name}': choose one of {gpu_names()} (or the name torch.cuda.get_device_name() "
        "prints), 'auto' for this machine's GPU, or give memory_gib"
    )


# torch.cuda.get_device_name() spellings for the memory table (the peak-FLOP/s table below
# matches fewer names: cards it does not list are left to Lightning's MFU table). First hit wins.
_MEMORY_NAME_PATTERNS: list[tuple[str, str]] = [
    ("a100-40gb", r"\ba100\b.*\b40\s?gb\b"),  # "NVIDIA A100-PCIE-40GB", "A100-SXM4-40GB"
    ("rtx-a6000", r"\brtx a6000\b"),
    ("l40s", r"\bl40s\b"),
    ("l4", r"\bl4\b"),
    ("v100-32gb", r"\bv100\b"),  # "Tesla V100-SXM2-32GB" (the 16 GB part is not in the table)
]


def spec_for_device_name(device_name: str) -> Optional[GPUSpec]:
    """The table's entry for a ``torch.cuda.get_device_name()`` string, or None."""
    name = device_name.lower()
    if re.search(r"\bv100\b", name) and not re.search(r"32\s?gb", name):
        return None  # a 16 GB V100: not in the table (give memory_gib)
    for key, pattern in _MEMORY_NAME_PATTERNS:
        if re.search(pattern, name):
            return GPUS[key]
    peak_key = device_key(device_name)
    return GPUS[peak_key] if peak_key is not None else None


def local_gpu(index: int = 0) -> tuple[str, Optional[GPUSpec], float]:
    """(name, table entry or None, total GiB) of this machine's CUDA device ``index``."""
    if not torch.cuda.is_available():
        raise ValueError(
            "--gpu auto: no CUDA device is visible here; name the GPU (" + gpu_names() + ") or give memory_gib"
        )
    props = torch.cuda.get_device_properties(index)
    return props.name, spec_for_device_name(props.name), props.total_memory / 1024**3


# ---- peak FLOP/s by device name (MFU) -----------------------------------------------------
# NVIDIA datasheets print "with sparsity" figures, twice the dense ones: these are dense.

TFLOPS = 1e12

# FLOP/s per device, dense, by compute precision (precision.py's short names), from the table above.
# "tf32" is the rate of FP32 matmuls when TF32 tensor cores are allowed; "fp32" the rate without
# them; FP16/BF16 with FP32 accumulation.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    name: {
        "fp32": g.fp32_tflops * TFLOPS,
        "tf32": g.tf32_tflops * TFLOPS,
        "bf16": g.bf16_tflops * TFLOPS,
        "fp16": g.fp16_tflops * TFLOPS,
    }
    for name, g in GPUS.items()
}

# torch.cuda.get_device_name() spellings, matched in order on the lower-cased name (first hit
# wins, so the more specific patterns come first). Examples: "NVIDIA H200", "NVIDIA H100 80GB
# HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB", "NVIDIA A100
# 80GB PCIe", "NVIDIA L40S", "NVIDIA GeForce RTX 4090", "NVIDIA GH200 480GB".
_NAME_PATTERNS: list[tuple[str, str]] = [
    ("gh200", r"\bgh200\b"),
    ("h200-nvl", r"\bh200\b.*\bnvl"),
    ("h200", r"\bh200\b"),
    ("h100-nvl", r"\bh100\b.*\bnvl"),
    ("h100-pcie", r"\bh100\b.*\b(pcie|hbm2e)\b"),
    ("h100-80gb", r"\bh100\b"),  # "H100 80GB HBM3", "H100 SXM5 80GB"
    ("a100-80gb", r"\ba100\b"),  # 40 and 80 GB parts share one compute peak
    ("l40s", r"\bl40s\b"),  # not the L40 (half the tensor rate): Lightning's table covers it
    ("rtx4090", r"\brtx 4090\b(?!\s*d\b)"),  # the 4090 D has fewer SMs
    ("rtx5090", r"\brtx 5090\b(?!\s*d\b)"),  # the 5090 D's tensor rate is capped
    ("rtx3090-ti", r"\brtx 3090 ti\b"),
    ("rtx3090", r"\brtx 3090\b"),
]


def device_key(device_name: str) -> Optional[str]:
    """The :data:`PEAK_FLOPS` key of a ``torch.cuda.get_device_name()`` string, or None."""
    name = device_name.lower()
    for key, pattern in _NAME_PATTERNS:
        if re.search(pattern, name):
            return key
    return None


def tf32_enabled() -> bool:
    """Whether FP32 matmuls on CUDA may use TF32 tensor cores.

    Read from ``torch.backends.cuda.matmul.fp32_precision`` (torch >= 2.9: "tf32" or "ieee"),
    which reflects every way of setting it: the legacy ``allow_tf32`` flag,
    ``set_float32_matmul_precision("high")`` and the new per-backend API. The legacy getter
    ``torch.get_float32_matmul_precision()`` raises in torch 2.14 once only the new API was used,
    and can disagree with the new API after both were, so it is only the fallback ("none" means
    nothing was set for this backend).
    """
    setting = "none"
    try:
        setting = str(torch.backends.cuda.matmul.fp32_precision)
    except (AttributeError, RuntimeError):  # torch < 2.9
        pass
    if setting in ("tf32", "ieee"):
        return setting == "tf32"
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # mixed legacy and new settings: the matmul setting above is the one cuBLAS uses
        return False


def peak_flops_for(device_name: str, dtype: Union[torch.dtype, str], tf32: bool = False) -> Optional[float]:
    """Dense peak FLOP/s of one device for matmuls in ``dtype`` (``"tf32"`` accepted), from
    :data:`PEAK_FLOPS`; None when the device or dtype is not in the table."""
    key = device_key(device_name)
    if key is None:
        return None
    if isinstance(dtype, str):
        dkey = dtype
    else:
        try:
            dkey = short_name(dtype)  # the table's keys are precision.py's short names
        except ValueError:  # a dtype without one (int8: Transformer Engine's FP8)
            return None
        if dkey == "fp32" and tf32:
            dkey = "tf32"
    return PEAK_FLOPS[key].get(dkey)
