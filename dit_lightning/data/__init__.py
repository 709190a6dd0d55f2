"""Data layer: the latent store, VAE extraction, the digits demo store and the DataModule.

Names are imported lazily so that, e.g., ``torchrun -m dit_lightning.data.extract`` or a
store reader does not pay for importing Lightning.
"""

# ruff: noqa: F401  (the TYPE_CHECKING imports name the lazy exports for type checkers)
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # static analysers and IDEs see the real names
    from .datamodule import (
        BatchRequest,
        LatentBatchDataset,
        LatentBatchSampler,
        LatentDataLoader,
        LatentDataModule,
        epoch_permutation,
        split_indices,
    )
    from .digits import digits_spec, prepare_digits
    from .extract import extract_latents
    from .preprocessing import BadImage, adm_center_crop, list_image_folder, load_rgb, preprocess
    from .rng import NoiseKernel
    from .store import (
        IncompleteStoreError,
        LatentStore,
        StoreError,
        StoreSpec,
        check_compatible,
        finalize_store,
        is_store,
        load_plan,
        shard_status,
        write_plan,
        write_shard,
    )

_EXPORTS = {
    "BatchRequest": "datamodule",
    "LatentBatchDataset": "datamodule",
    "LatentBatchSampler": "datamodule",
    "LatentDataLoader": "datamodule",
    "LatentDataModule": "datamodule",
    "epoch_permutation": "datamodule",
    "split_indices": "datamodule",
    "digits_spec": "digits",
    "prepare_digits": "digits",
    "extract_latents": "extract",
    "BadImage": "preprocessing",
    "adm_center_crop": "preprocessing",
    "list_image_folder": "preprocessing",
    "load_rgb": "preprocessing",
    "preprocess": "preprocessing",
    "IncompleteStoreError": "store",
    "LatentStore": "store",
    "StoreError": "store",
    "StoreSpec": "store",
    "check_compatible": "store",
    "finalize_store": "store",
    "is_store": "store",
    "load_plan": "store",
    "shard_status": "store",
    "write_plan": "store",
    "write_shard": "store",
    "NoiseKernel": "rng",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
