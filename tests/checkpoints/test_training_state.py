"""Reading training checkpoints: a Lightning ``.ckpt`` file and the same checkpoint as a sharded
directory (``torch.distributed.checkpoint`` shards + Lightning's ``meta.pt``, the layout the FSDP
strategies write) give the same step, settings, callback states and weights, through the one reader
that ``--ckpt_path``, auto-fit's resume and ``FaultTolerance`` use; other checkpoints are named."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from dit_lightning.checkpoints import (
    NotATrainingCheckpointError,
    UnsafeCheckpointError,
    read_checkpoint,
    read_training_state,
)
from dit_lightning.module import DiTModule
from tests.helpers.training import TINY_MODULE as TINY
from tests.helpers.training import DictDataset, trainer

pytestmark = pytest.mark.usefixtures("one_thread")

RECORD = {"setting": {"micro_batch": 4, "accumulate_grad_batches": 2}, "backoffs": 1}


class Recorder(L.Callback):
    """Saves what auto-fit saves, under auto-fit's state key."""

    @property
    def state_key(self) -> str:
        return "AutoFit"

    def state_dict(self) -> dict[str, Any]:
        return RECORD


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(a Lightning checkpoint after 2 steps, the same checkpoint as a sharded directory)."""
    tmp = tmp_path_factory.mktemp("training_state")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = trainer(max_steps=2, default_root_dir=tmp, callbacks=[Recorder()])
        t.fit(DiTModule(**TINY, ema_decay=0.5), DataLoader(DictDataset(), batch_size=8))
        plain = tmp / "last.ckpt"
        t.save_checkpoint(plain)
    finally:
        torch.set_num_threads(before)
    return plain, shard(plain, tmp / "sharded.ckpt")


def shard(plain: Path, out: Path, key: str = "state_dict", meta: bool = True) -> Path:
    """``plain`` as ModelParallelStrategy (FSDP2) saves it: weights in DCP shards under ``key``
    (FSDPStrategy, FSDP1, uses "model"), everything else in meta.pt."""
    import torch.distributed.checkpoint as dcp

    ckpt = torch.load(plain, weights_only=True)
    weights = ckpt.pop("state_dict")
    ckpt.pop("optimizer_states")
    with pytest.warns(UserWarning):  # torch: "assuming the intent is to save in a single process"
        dcp.save({key: weights}, checkpoint_id=str(out), no_dist=True)
    if meta:
        torch.save(ckpt, out / "meta.pt")
    return out


def test_a_lightning_file_and_its_sharded_directory_read_the_same(trained):
    plain, sharded = trained
    a, b = read_training_state(plain), read_training_state(sharded)
    assert (a.sharded, b.sharded) == (False, True)
    assert a.step == b.step == 2 and a.epoch == b.epoch
    assert a.hyper_parameters == b.hyper_parameters and a.hyper_parameters["depth"] == TINY["depth"]
    assert a.callback_state("AutoFit") == b.callback_state("AutoFit") == RECORD and a.callback_state("Other") is None
    assert "state_dict" not in a.meta and "optimizer_states" not in a.meta and a.meta.keys() == b.meta.keys()
    wa, wb = a.state_dict(), b.state_dict()
    assert wa.keys() == wb.keys() and any(k.startswith("ema.") for k in wa)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert b.state_dict() is wb  # merged once


def test_fsdp1s_sharded_layout_holds_its_weights_under_model(trained, tmp_path):
    plain, _ = trained
    fsdp1 = shard(plain, tmp_path / "fsdp1.ckpt", key="model")
    weights = read_training_state(fsdp1).state_dict()
    assert weights.keys() == read_training_state(plain).state_dict().keys()
    assert read_checkpoint(fsdp1).model.keys() == read_checkpoint(plain).model.keys()


def test_what_is_not_a_training_checkpoint_is_named(trained, tmp_path):
    plain, sharded = trained
    ckpt = read_checkpoint(plain)
    raw, reference, bare = tmp_path / "raw.pt", tmp_path / "ref.pt", tmp_path / "bare.ckpt"
    torch.save(ckpt.ema, raw)
    torch.save({"model": ckpt.model, "ema": ckpt.ema, "args": {}}, reference)
    torch.save({"state_dict": torch.load(plain, weights_only=True)["state_dict"]}, bare)  # no Lightning bookkeeping
    shards_only = shard(plain, tmp_path / "shards-only", meta=False)
    for path, kind in [
        (raw, "a raw DiT checkpoint"),
        (reference, "a reference DiT checkpoint"),
        (bare, "Lightning-style weights without a training state"),
        (shards_only, "a sharded checkpoint directory without meta.pt"),
    ]:
        with pytest.raises(NotATrainingCheckpointError, match="not a Lightning training checkpoint") as e:
            read_training_state(path)
        assert kind in e.value.kind, (path, e.value.kind)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"is empty \(0 bytes\)"):
        read_training_state(empty)
    with pytest.raises(ValueError, match="is a directory but not a checkpoint"):
        read_training_state(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_training_state(tmp_path / "missing.ckpt")
    evil = Path(shard(plain, tmp_path / "evil.ckpt"))
    (evil / ".metadata").write_bytes(pickle.dumps(SimpleNamespace()))  # names a class outside DCP's metadata
    with pytest.raises(UnsafeCheckpointError, match="naming code"):
        read_training_state(evil)


def test_the_cli_auto_fit_and_fault_tolerance_read_sharded_checkpoints_too(trained, tmp_path):
    from dit_lightning.callbacks.autofit import _read_record
    from dit_lightning.callbacks.fault_tolerance import FaultTolerance
    from dit_lightning.lightning_cli import DiTCLI

    plain, sharded = trained
    for path in (plain, sharded):
        assert _read_record(str(path)) == (RECORD, 2)
        fake = SimpleNamespace(checkpoint_callback=SimpleNamespace(last_model_path=str(path)))
        assert f"{path} (step 2), was written before" in FaultTolerance()._last_good(fake)
        hparams = DiTCLI._checkpoint_hparams(DiTCLI._training_state(str(path)))
        assert hparams["depth"] == TINY["depth"] and "optimizer" not in hparams
    assert _read_record(str(tmp_path / "missing.ckpt")) == (None, 0)
    raw = tmp_path / "raw.pt"
    torch.save(read_checkpoint(plain).ema, raw)
    with pytest.raises(ValueError, match=f"--model.init_from {raw}"):
        DiTCLI._training_state(str(raw))
