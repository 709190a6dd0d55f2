"""The ``dit-lightning`` command: LightningCLI for fit/validate/test/predict, plus tools.

``dit-lightning fit --config configs/demo.yaml`` trains; the tool commands (``extract``,
``prepare-digits``, ``export``...) are plain functions exposed through jsonargparse.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.cli import LightningCLI

from .checkpoint_io import AtomicCheckpointIO
from .data import LatentDataModule
from .module import DiTModule


class DiTCLI(LightningCLI):
    """LightningCLI with the model's latent shape, classes and VAE linked to the data store,
    so a model and a store that do not match cannot be configured."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.latent_shape", "model.latent_shape", apply_on="instantiate")
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.vae_name", "model.vae", apply_on="instantiate")
        # Always-on, configurable checkpointing: every N optimiser steps plus `last.ckpt`.
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.every_n_train_steps": 1000})
        parser.add_lightning_class_args(RichProgressBar, "progress_bar")


def _tools() -> dict[str, Callable]:
    from .data import extract_latents, prepare_digits
    from .export import export_checkpoint

    return {
        "extract": extract_latents,
        "prepare-digits": prepare_digits,
        "export": export_checkpoint,
    }


TOOL_NAMES = ("extract", "prepare-digits", "export")


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOL_NAMES:
        from jsonargparse import CLI

        CLI(_tools()[argv[0]], args=argv[1:], as_positional=False)
        return
    DiTCLI(
        DiTModule,
        LatentDataModule,
        trainer_defaults={"plugins": [AtomicCheckpointIO()]},
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": "Train DiT with Lightning. Tools: " + ", ".join(TOOL_NAMES) + " (dit-lightning TOOL --help)."},
        args=argv,
    )


if __name__ == "__main__":
    main()
