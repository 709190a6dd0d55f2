"""The sample grid: a section of the CLI (``--sample_grid.*``) that switches off and is sized from the
command line, sampled with its options, and never costing more than ``max_cost`` of the training so far.
No training here: the CLI is stopped at ``Trainer.fit``, the callback drives a stand-in module."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch

from dit_lightning.callbacks import SampleGrid
from dit_lightning.cli import main
from tests.helpers.cli import DEMO


def grids_of_fit(args: list[str], store: str, tmp_path, monkeypatch) -> list[SampleGrid]:
    """The SampleGrid callbacks of the Trainer that ``dit-lightning fit --config demo ARGS`` builds."""
    seen: list[SampleGrid] = []

    def fit(trainer: L.Trainer, *a, **k) -> None:
        seen.extend(c for c in trainer.callbacks if isinstance(c, SampleGrid))  # type: ignore[attr-defined]

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(L.Trainer, "fit", fit)
    small = ["--model.depth", "1", "--model.hidden_size", "32", "--trainer.logger", "false"]
    main(["fit", "--config", DEMO, "--data.path", store, *small, *args])
    return seen


def test_the_grid_switches_off_and_follows_its_options_from_the_command_line(store, tmp_path, monkeypatch):
    sized = ["--sample_grid.per_class", "3", "--sample_grid.num_steps", "7", "--sample_grid.max_cost", "null"]
    (grid,) = grids_of_fit(sized, store, tmp_path, monkeypatch)
    assert (grid.enabled, grid.per_class, grid.num_steps, grid.max_cost) == (True, 3, 7, None)
    assert (grid.every_n_steps, grid.cfg_scale, grid.upscale) == (500, 2.0, 4)  # the rest: the demo's
    assert grids_of_fit(["--sample_grid.enabled", "false"], store, tmp_path, monkeypatch) == []


class StandIn(torch.nn.Module):
    """What SampleGrid calls of a DiTModule: ``sample`` (recorded) and ``decode``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []
        self.model = SimpleNamespace(num_classes=10)

    def sample(self, labels, **options) -> torch.Tensor:
        self.calls.append({"labels": list(labels), **options})
        return torch.zeros(len(labels), 1, 8, 8)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.clamp(0, 1)


def test_the_grid_samples_with_its_options_and_caps_its_cost(capsys):
    module = StandIn()
    trainer = SimpleNamespace(is_global_zero=True, global_step=0, accumulate_grad_batches=1, loggers=[])
    grid = SampleGrid(every_n_steps=10, classes=[1, 2, 3], per_class=4, num_steps=50, cfg_scale=2.0)
    image = grid.render(trainer, module)  # no training seen: num_steps
    # a grid at the end of a long run samples for minutes: a log file says so when it starts and ends
    start, end = capsys.readouterr().out.splitlines()
    assert start == "sample grid at step 0: 12 images (3 classes x 4), 50 sampling steps: sampling..."
    assert end.startswith("sample grid at step 0: 12 images (3 classes x 4), 50 sampling steps: done in ")
    assert module.calls[-1]["labels"] == [1] * 4 + [2] * 4 + [3] * 4 and module.calls[-1]["num_steps"] == 50
    assert image.shape == (3, 3 * 9 + 1, 4 * 9 + 1)  # 3 rows of 4 images, 8 px and 1 px of padding
    # after 10 steps of 16 images: 3 x 16 x 10 = 480 evaluations trained, 12 images x 2 (guidance) per
    # sampling step: a quarter of the training buys 5 steps
    batch = {"x": torch.zeros(16, 1, 8, 8), "y": torch.zeros(16, dtype=torch.long)}
    trainer.global_step = 10
    grid.on_train_batch_end(trainer, module, None, batch, 0)
    assert grid.sampling_steps(trainer, 12) == 5 and module.calls[-1]["num_steps"] == 5 and len(module.calls) == 2
    grid.on_fit_end(trainer, module)  # the grid of this step exists: not sampled again
    assert len(module.calls) == 2
    trainer.accumulate_grad_batches = 2  # 32 images per optimiser step
    assert grid.sampling_steps(trainer, 12) == 10
    trainer.global_step = 1000
    assert grid.sampling_steps(trainer, 12) == 50  # a long run: all of num_steps
    trainer.global_step = 1
    assert grid.sampling_steps(trainer, 12) == 2  # never fewer than two (DDPM's least)
    assert SampleGrid(num_steps=50, max_cost=None, cfg_scale=2.0).sampling_steps(trainer, 12) == 50
    off = SampleGrid(every_n_steps=1, enabled=False)
    off.on_train_batch_end(trainer, module, None, batch, 0)
    off.on_fit_end(trainer, module)
    assert len(module.calls) == 2 and off.output_locations(trainer, "fit") == []
    with pytest.raises(ValueError, match="max_cost"):
        SampleGrid(max_cost=0)


def test_the_grid_of_a_flow_model_samples_with_the_models_sampler():
    from dit_lightning.module import DiTModule
    from tests.helpers.training import TINY_MODULE

    module = DiTModule(**TINY_MODULE, objective="flow")
    trainer = SimpleNamespace(is_global_zero=True, global_step=0, accumulate_grad_batches=1, loggers=[])
    image = SampleGrid(classes=[1, 2], per_class=2, num_steps=3).render(trainer, module)  # sde-euler, the module's
    assert image.shape == (3, 2 * 9 + 1, 2 * 9 + 1) and torch.isfinite(image).all()
    with pytest.raises(ValueError, match="does not sample a model trained with objective flow"):
        SampleGrid(classes=[1], per_class=1, num_steps=3, sampler="ddpm").render(trainer, module)
