"""Save the resolved LightningCLI config next to the logs *and* show it in every logger."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.cli import SaveConfigCallback

from .media import log_text


def yaml_as_markdown(text: str) -> str:
    """TensorBoard renders text summaries as Markdown: indent by four spaces so the YAML shows as
    a code block (indentation and comments intact) instead of one reflowed paragraph."""
    return "\n".join("    " + line for line in text.rstrip().splitlines())


class ConfigLogger(SaveConfigCallback):
    """:class:`SaveConfigCallback` (writes the config YAML to the run's directory) that also logs the
    resolved config, after links and defaults, as the text ``config`` to every logger (TensorBoard's
    TEXT tab, a W&B table, an MLflow artifact). The model's ``save_hyperparameters`` fill the
    hyper-parameter views; this is the complete record (trainer, data, callbacks, optimiser)."""

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Called on rank 0 only (see SaveConfigCallback): no collectives here. Loggers that are only
        # a directory (CSVLogger) already have the YAML file in it.
        text = self.parser.dump(self.config, skip_none=False)
        log_text(trainer, "config", text, step=trainer.global_step, markdown=yaml_as_markdown(text), to_files=False)


TensorBoardConfigLogger = ConfigLogger  # the name of earlier versions
