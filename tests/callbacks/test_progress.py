"""The run-level progress bar in a batch log (stdout not a terminal): ``predict`` and ``test`` print
the plain lines with an ETA that ``fit`` prints, counted in batches."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from dit_lightning.callbacks.progress import DiTProgressBar


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)

    def predict_step(self, batch, batch_idx):
        return self.net(batch.float()[:, None])

    def test_step(self, batch, batch_idx):
        self.log("test/x", self.net(batch.float()[:, None]).mean())


@pytest.mark.parametrize("stage", ["predict", "test"])
def test_predict_and_test_print_progress_lines_with_an_eta(stage, capsys):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[DiTProgressBar(every_percent=25)],  # plain: None, and pytest's stdout is no terminal
    )
    capsys.readouterr()
    getattr(trainer, stage)(Tiny(), DataLoader(torch.arange(8), batch_size=1))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"{stage}:")]
    assert lines[0] == f"{stage}: 8 batches"
    steps = [line for line in lines if line.startswith(f"{stage}: batch")]
    assert [line.split(" | ")[0] for line in steps] == [f"{stage}: batch {n}/8" for n in (2, 4, 6, 8)]
    assert all("ETA" in line and "elapsed" in line for line in steps) and "100.0%" in steps[-1]
    assert lines[-1].startswith(f"{stage}: done, 8 batches in")
