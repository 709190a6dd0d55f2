"""DiT checkpoints in one place: read every format (raw, reference, Lightning, sharded, diffusers,
safetensors), tell the architecture by one rule, load strictly, save atomically, export and
consolidate; and the one reader of training checkpoints (step, settings, callback states, weights
of a Lightning file or a sharded directory: :func:`read_training_state`).

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
    recorded_vae,
    sit_output_layout,
)
from .diffusers_export import export_diffusers, export_safetensors
from .diffusers_format import (
    NotExpressibleError,
    PixelDecoder,
    diffusers_transformer_config,
    dit_config_from_diffusers,
    from_diffusers_state_dict,
    inexpressible,
    is_diffusers_checkpoint,
    name_table,
    to_diffusers_state_dict,
    use_reference_timestep_embedding,
)
from .export import ExportFormat, export_checkpoint, save_dit, to_reference_format
from .formats import (
    DiTCheckpoint,
    NonFiniteWeightsError,
    StateDict,
    Weights,
    check_finite,
    clean_state_dict,
    nonfinite_message,
    nonfinite_tensors,
    read_checkpoint,
    strip_prefix,
)
from .safe_load import UnsafeCheckpointError, UnsafeFileError
from .sharded import is_sharded_checkpoint, load_sharded_checkpoint, optimizer_by_index
from .training import NotATrainingCheckpointError, TrainingState, read_training_state

__all__ = [
    "DiTCheckpoint",
    "ExportFormat",
    "LoadedDiT",
    "NonFiniteWeightsError",
    "NotATrainingCheckpointError",
    "NotExpressibleError",
    "PixelDecoder",
    "StateDict",
    "TrainingState",
    "UnsafeCheckpointError",
    "UnsafeFileError",
    "Weights",
    "check_dit_weights",
    "check_finite",
    "clean_state_dict",
    "describe",
    "diffusers_transformer_config",
    "dit_config_from_diffusers",
    "dit_config_of",
    "export_checkpoint",
    "export_diffusers",
    "export_safetensors",
    "from_diffusers_state_dict",
    "inexpressible",
    "infer_dit_config",
    "is_diffusers_checkpoint",
    "is_sharded_checkpoint",
    "load_dit",
    "load_dit_weights",
    "load_sharded_checkpoint",
    "name_table",
    "nonfinite_message",
    "nonfinite_tensors",
    "optimizer_by_index",
    "read_checkpoint",
    "read_training_state",
    "recorded_vae",
    "save_dit",
    "sit_output_layout",
    "strip_prefix",
    "to_diffusers_state_dict",
    "to_reference_format",
    "use_reference_timestep_embedding",
]
