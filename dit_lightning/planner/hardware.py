"""GPU specifications the planner and the throughput monitor need: usable memory, dense peak compute, memory bandwidth.

Figures are vendor datasheet values for dense (non-sparse) tensor-core math with fp32
accumulation; ``usable_gib`` is what ``torch.cuda.get_device_properties(0).total_memory``
reports (a little less than the marketed size: ECC and the driver's reservation);
``link_gbs`` is a rough NCCL bus bandwidth inside one node (NVLink for SXM parts, PCIe for
the others; consumer cards have no P2P). They are approximations for planning, not promises.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
    )
}

_ALIASES = {
    "3090": "rtx3090",
    "4090": "rtx4090",
    "a6000": "rtx-a6000",
    "a100": "a100-80gb",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "v100": "v100-32gb",
}


def gpu_spec(name: str) -> GPUSpec:
    """Look up a GPU by name (``rtx4090``, ``a100-80gb``, ``h200``...; a few aliases work)."""
    key = name.strip().lower().replace("_", "-").replace(" ", "")
    key = _ALIASES.get(key, key)
    if key not in GPUS:
        raise ValueError(f"unknown GPU '{name}': choose one of {', '.join(GPUS)} or give memory_gib")
    return GPUS[key]
