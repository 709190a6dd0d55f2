"""Save the resolved LightningCLI config next to the logs *and* show it in TensorBoard."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import TensorBoardLogger


def yaml_as_markdown(text: str) -> str:
    """TensorBoard renders text summaries as Markdown: indent by four spaces so the YAML shows as
    a code block (indentation and comments intact) instead of one reflowed paragraph."""
    return "\n".join("    " + line for line in text.rstrip().splitlines())


class TensorBoardConfigLogger(SaveConfigCallback):
    """:class:`SaveConfigCallback` (writes ``config.yaml`` to the log dir) that also adds the
    resolved config, after links and defaults, as the text summary ``config`` of every
    TensorBoardLogger (TEXT tab). The model's own ``save_hyperparameters`` already fill the
    HPARAMS tab; this is the complete record (trainer, data, callbacks, optimiser)."""

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Called on rank 0 only (see SaveConfigCallback): no collectives here.
        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers:
            return
        text = self.parser.dump(self.config, skip_none=False)
        for logger in loggers:
            logger.experiment.add_text("config", yaml_as_markdown(text), global_step=0)
            logger.experiment.flush()
