"""DiT checkpoints in one place: read every format (raw, reference, Lightning, sharded), tell the
architecture by one rule, load strictly, save atomically, export and consolidate.

Pure PyTorch: the Lightning side (atomic ``CheckpointIO``, resuming) lives in
:mod:`dit_lightning.plugins` and :class:`~dit_lightning.module.DiTModule`.
"""

from .architecture import (
    LoadedDiT,
    check_dit_weights,
    describe,
    dit_config_of,
    infer_dit_config,
    load_dit,
    load_dit_weights,
)
from .export import ExportFormat, export_checkpoint, save_dit, to_reference_format
from .formats import DiTCheckpoint, StateDict, Weights, clean_state_dict, read_checkpoint, strip_prefix
from .sharded import is_sharded_checkpoint, load_sharded_checkpoint, optimizer_by_index

__all__ = [
    "DiTCheckpoint",
    "ExportFormat",
    "LoadedDiT",
    "StateDict",
    "Weights",
    "check_dit_weights",
    "clean_state_dict",
    "describe",
    "dit_config_of",
    "export_checkpoint",
    "infer_dit_config",
    "is_sharded_checkpoint",
    "load_dit",
    "load_dit_weights",
    "load_sharded_checkpoint",
    "optimizer_by_index",
    "read_checkpoint",
    "save_dit",
    "strip_prefix",
    "to_reference_format",
]
