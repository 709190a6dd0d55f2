"""The ``dit-lightning`` command: LightningCLI for fit/validate/test/predict, plus tools.

``dit-lightning fit --config configs/demo.yaml`` trains; the tool commands (``extract``,
``prepare-digits``, ``export``...) are plain functions exposed through jsonargparse.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO

from .callbacks.config_logger import TensorBoardConfigLogger
from .callbacks.generation import GenerationMetrics
from .commands import TOOLS, tool
from .data import LatentDataModule
from .module import DiTModule
from .plugins import AtomicCheckpointIO


def _store_vae(data: LatentDataModule) -> str:
    return data.spec.vae


class DiTCLI(LightningCLI):
    """LightningCLI with the model's latent shape, classes and VAE linked to the data store,
    so a model and a store that do not match cannot be configured."""

    def add_arguments_to_parser(self, parser) -> None:
        # Subclass mode: DiTModule or a subclass (DistillationModule) chosen by model.class_path;
        # plain model arguments in a config mean DiTModule. Their arguments live under init_args.
        model = "model.init_args." if self.subclass_mode_model else "model."
        parser.link_arguments("data.latent_shape", model + "latent_shape", apply_on="instantiate")
        parser.link_arguments("data.num_classes", model + "num_classes", apply_on="instantiate")
        parser.link_arguments("data", model + "vae", compute_fn=_store_vae, apply_on="instantiate")
        if self.subclass_mode_model:
            parser.set_defaults({"model": {"class_path": "dit_lightning.module.DiTModule"}})
        # Always-on, configurable checkpointing: every N optimiser steps plus `last.ckpt`.
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.every_n_train_steps": 1000})
        parser.add_lightning_class_args(RichProgressBar, "progress_bar")
        # What `test` measures besides the held-out loss: FID / IS / KID or the digits metrics of
        # freshly sampled images (`evaluation.metrics`; off while the list is empty).
        parser.add_lightning_class_args(GenerationMetrics, "evaluation")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        # Atomic checkpoint writes unless the user configured their own CheckpointIO plugin.
        trainer_config = self._get(self.config_init, "trainer", default={})
        if trainer_config.get("enable_progress_bar") is False:  # the forced rich bar would clash with it
            parser = self._parser(self.subcommand)
            parser.callback_keys = [k for k in parser.callback_keys if k != "progress_bar"]
        plugins = kwargs.get("plugins") or trainer_config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs["plugins"] = plugins + [AtomicCheckpointIO()]
        return super().instantiate_trainer(**kwargs)


# Flags that read better without a value on the command line.
_FLAG_ALIASES = {"plan": {"--fit": "--fit=true", "--json": "--format=json"}}


def main(argv: Optional[list[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in TOOLS:
        from jsonargparse import CLI

        aliases = _FLAG_ALIASES.get(args[0], {})
        CLI(tool(args[0]), args=[aliases.get(a, a) for a in args[1:]], as_positional=False)
        return
    DiTCLI(
        DiTModule,
        LatentDataModule,
        subclass_mode_model=True,  # DiTModule or a subclass (dit_lightning.distill.DistillationModule)
        save_config_callback=TensorBoardConfigLogger,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={
            "description": "Train DiT with Lightning. Tools: " + ", ".join(TOOLS) + " (dit-lightning TOOL --help)."
        },
        args=argv,  # None: LightningCLI reads sys.argv itself
    )


if __name__ == "__main__":
    main()
