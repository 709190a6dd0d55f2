"""The DiT model family (pure PyTorch)."""

from .config import ARCH_KEYS, build_from_config, mlp_ratio_for, model_config
from .dit import DIT_CONFIGS, DiT, DiTBlock, build_dit, dit_config, resolve_checkpoint_blocks, sincos_2d
from .flops import DiTShape, dit_macs, dit_params, shape_of, training_flops

__all__ = [
    "ARCH_KEYS",
    "build_from_config",
    "mlp_ratio_for",
    "model_config",
    "DIT_CONFIGS",
    "DiT",
    "DiTBlock",
    "DiTShape",
    "build_dit",
    "dit_config",
    "dit_macs",
    "dit_params",
    "resolve_checkpoint_blocks",
    "shape_of",
    "sincos_2d",
    "training_flops",
]
