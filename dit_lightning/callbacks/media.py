"""Images and text to whatever loggers the Trainer has (Lightning's loggers share scalars, not media).

TensorBoard gets ``add_image`` / ``add_text``, Weights & Biases ``log_image`` / ``log_text``, MLflow
image and text artifacts; any other logger with a directory (CSVLogger...) gets files in it
(``images/<tag>/step_<N>.png``, ``<tag>.txt``), so no logger loses them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger
from torch import Tensor

from ..atomic import write_text
from ..images import save_png


def _hwc_uint8(image: Tensor) -> Any:
    return (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()


def _file_dir(logger: Any) -> Optional[Path]:
    log_dir = getattr(logger, "log_dir", None)
    return Path(log_dir) if log_dir else None


def log_image(trainer: L.Trainer, tag: str, image: Tensor, step: int) -> None:
    """Log a (3, H, W) image in [0, 1] to every logger (call on rank 0)."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_image(tag, image, global_step=step)
        elif isinstance(logger, WandbLogger):
            logger.log_image(key=tag, images=[_hwc_uint8(image)], step=step)
        elif isinstance(logger, MLFlowLogger):
            logger.experiment.log_image(logger.run_id, _hwc_uint8(image), f"{tag}/step_{step:08d}.png")
        else:
            directory = _file_dir(logger)
            if directory is not None:
                save_png(image, directory / "images" / tag.replace("/", "_") / f"step_{step:08d}.png")


def log_text(
    trainer: L.Trainer, tag: str, text: str, step: int = 0, markdown: Optional[str] = None, to_files: bool = True
) -> None:
    """Log a text to every logger (call on rank 0); ``markdown`` is TensorBoard's rendering of it.
    ``to_files=False`` skips the loggers that only have a directory (the text is there already)."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(tag, markdown if markdown is not None else text, global_step=step)
            logger.experiment.flush()
        elif isinstance(logger, WandbLogger):
            logger.log_text(key=tag, columns=["text"], data=[[text]], step=step)
        elif isinstance(logger, MLFlowLogger):
            logger.experiment.log_text(logger.run_id, text, f"{tag}.txt")
        elif to_files:
            directory = _file_dir(logger)
            if directory is not None:
                write_text(directory / f"{tag.replace('/', '_')}.txt", text + "\n")
