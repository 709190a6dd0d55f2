"""LatentDataModule: batch format, augmentation purity, sharding by rank, resume, DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from dit_lightning.data.datamodule import (
    LatentBatchDataset,
    LatentBatchSampler,
    LatentDataModule,
    split_indices,
)
from dit_lightning.data.rng import NoiseKernel, flip_bits
from tests.helpers.data import make_random_store
from tests.helpers.ports import with_master_port

SHAPE = (4, 4, 4)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_random_store(
        str(tmp_path_factory.mktemp("dm") / "s"), n=100, latent_shape=SHAPE, num_classes=5, shard_size=32
    )


def _reference_x(store, idx, seed, epoch):
    """The documented train augmentation, written out sample by sample."""
    out = []
    for i in idx:
        f = flip_bits(seed, epoch, np.array([i]))[0]
        mean, logvar = store.read([i], flip=f)[0].astype(np.float32)
        eps = NoiseKernel(mean.size).normal(seed, epoch, np.array([i]))[0].reshape(mean.shape)
        out.append((mean + np.exp(0.5 * logvar) * eps) * store.scale_factor)
    return np.stack(out)


def test_properties_and_batch_format(store):
    dm = LatentDataModule(store.path, global_batch_size=16, val_size=20, num_workers=0, seed=3)
    assert dm.latent_shape == SHAPE and dm.num_classes == 5 and dm.scale_factor == pytest.approx(0.18215)
    dm.check_compatible(SHAPE, 5)
    with pytest.raises(ValueError, match="num_classes=1000"):
        dm.check_compatible(SHAPE, 1000)
    dm.setup("fit")
    assert dm.micro_batch_size == 16 and len(dm.train_indices) == 80 and len(dm.val_indices) == 20
    dl = dm.train_dataloader()
    assert len(dl) == 5
    batches = list(dl)
    b = batches[0]
    assert set(b) == {"x", "y", "index"}
    assert b["x"].shape == (16, *SHAPE) and b["x"].dtype == torch.float32
    assert b["y"].dtype == torch.int64 and b["index"].dtype == torch.int64
    idx = b["index"].numpy()
    np.testing.assert_array_equal(b["y"].numpy(), store.labels[idx])
    np.testing.assert_allclose(b["x"].numpy(), _reference_x(store, idx, 3, 0), rtol=1e-5, atol=1e-6)
    seen = np.concatenate([bb["index"].numpy() for bb in batches])
    assert sorted(seen) == sorted(dm.train_indices)  # one epoch = the train split once
    # validation: posterior mean of the unflipped image, fixed order
    v1, v2 = list(dm.val_dataloader()), list(dm.val_dataloader())
    vi = np.concatenate([v["index"].numpy() for v in v1])
    np.testing.assert_array_equal(vi, dm.val_indices)
    ref = store.read(vi, flip=0)[:, 0].astype(np.float32) * store.scale_factor
    np.testing.assert_allclose(np.concatenate([v["x"].numpy() for v in v1]), ref, rtol=1e-6)
    assert all(torch.equal(a["x"], c["x"]) for a, c in zip(v1, v2))


def test_augmentation_is_pure_in_seed_epoch_index(store):
    ds = LatentBatchDataset(store, train=True, seed=1)
    a = ds.get_batch(np.array([3, 40, 77]), epoch=2)["x"]
    b = ds.get_batch(np.array([40]), epoch=2)["x"]
    torch.testing.assert_close(a[1:2], b, rtol=0, atol=0)
    assert not torch.equal(a, ds.get_batch(np.array([3, 40, 77]), epoch=3)["x"])
    plain = LatentBatchDataset(store, train=True, seed=1, random_flip=False, sample_posterior=False)
    mean0 = store.read([40], flip=0)[:, 0].astype(np.float32) * store.scale_factor
    np.testing.assert_allclose(plain.get_batch(np.array([40]))["x"].numpy(), mean0, rtol=1e-6)


@pytest.mark.parametrize("world,accum", [(2, 1), (3, 2), (4, 1)])
def test_ranks_split_each_step_of_the_single_process_order(world, accum):
    idx = np.arange(5, 205)  # e.g. a train split
    b = 6
    single = LatentBatchSampler(idx, b * world, 1, 0, seed=9, accumulate_grad_batches=accum)
    ranks = [LatentBatchSampler(idx, b, world, r, seed=9, accumulate_grad_batches=accum) for r in range(world)]
    for epoch in (0, 1):
        for s in [single, *ranks]:
            s.set_epoch(epoch)
        ref = list(single)
        per_rank = [list(r) for r in ranks]
        assert all(len(p) == len(ref) == len(single) for p in per_rank)
        assert len(ref) % accum == 0  # whole optimizer steps only (drop_last)
        for step, req in enumerate(ref):
            parts = [p[step].indices for p in per_rank]
            assert all(len(x) == b for x in parts)
            np.testing.assert_array_equal(np.sort(np.concatenate(parts)), req.indices)
            assert all(p[step].epoch == epoch for p in per_rank)
        if epoch == 0:
            first = [r.indices for r in ref]
    assert not all(np.array_equal(x, r.indices) for x, r in zip(first, ref))  # reshuffled
    # drop_last=False fills the last step by wrapping around; validation order is fixed
    full = LatentBatchSampler(np.arange(10), 4, 1, 0, drop_last=False)
    got = np.concatenate([r.indices for r in full])
    assert len(full) == 3 and len(got) == 12 and set(got.tolist()) == set(range(10))
    val = [LatentBatchSampler(np.arange(7), 2, 2, r, shuffle=False, drop_last=False) for r in range(2)]
    parts = [np.concatenate([q.indices for q in v]) for v in val]
    assert sorted(np.concatenate(parts)) == list(range(7)) and len(val[0]) == len(val[1]) == 2


def test_indivisible_global_batch_is_refused(store):
    dm = LatentDataModule(store.path, global_batch_size=256, num_workers=0)
    dm.trainer = SimpleNamespace(world_size=3, accumulate_grad_batches=2, global_rank=0)
    with pytest.raises(ValueError, match=r"global_batch_size 256 is not divisible by 3 device\(s\) x 2 accumulation"):
        dm.setup("fit")
    dm.trainer = SimpleNamespace(world_size=2, accumulate_grad_batches=2, global_rank=1)
    with pytest.raises(ValueError, match="fewer than one global batch"):  # 100 samples < 256
        dm.setup("fit")
    dm = LatentDataModule(store.path, global_batch_size=16, num_workers=0)
    dm.trainer = SimpleNamespace(world_size=2, accumulate_grad_batches=2, global_rank=1)
    dm.setup("fit")
    assert dm.micro_batch_size == 4


def test_split_is_seeded_and_class_mixed():
    tr, va = split_indices(1000, 0.1)
    assert len(va) == 100 and len(tr) == 900 and not set(tr) & set(va)
    np.testing.assert_array_equal(va, split_indices(1000, 100)[1])
    assert va.max() > 500 and va.min() < 500  # not just the tail (stores are sorted by class)
    with pytest.raises(ValueError):
        split_indices(10, 10)


def test_workers_and_epochs_match_single_process(store):
    kw = dict(global_batch_size=16, val_size=0, seed=5)
    dm0 = LatentDataModule(store.path, num_workers=0, **kw)
    dm2 = LatentDataModule(store.path, num_workers=2, persistent_workers=True, **kw)
    dl0, dl2 = dm0.train_dataloader(), dm2.train_dataloader()
    for epoch in (0, 1):  # persistent workers: the epoch lives in the main-process sampler
        dl0.sampler.set_epoch(epoch)
        dl2.sampler.set_epoch(epoch)
        a, b = list(dl0), list(dl2)
        assert len(a) == len(b) == 6
        for x, y in zip(a, b):
            assert torch.equal(x["index"], y["index"]) and torch.equal(x["x"], y["x"])
    dl2._iterator._shutdown_workers()  # now, rather than at some later garbage collection


def test_digits_demo_from_a_fresh_path(tmp_path):
    path = str(tmp_path / "digits")
    dm = LatentDataModule(path, global_batch_size=32, val_size=97, prepare="digits", num_workers=0)
    assert dm.latent_shape == (1, 8, 8) and dm.num_classes == 10 and not os.path.exists(path)
    dm.prepare_data()
    dm.setup("fit")
    b = next(iter(dm.train_dataloader()))
    assert b["x"].shape == (32, 1, 8, 8) and b["x"].min() >= -1 and b["x"].max() <= 1
    raw = dm.store.read(b["index"].numpy())[:, 0, 0].astype(np.float32)  # no flip, no noise
    np.testing.assert_array_equal(b["x"].numpy(), raw)


class Recorder(L.LightningModule):
    """Records what each training step saw."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch["index"].tolist(), batch["x"].flatten(1).sum(1).tolist()))
        return (self.w * batch["x"].mean()).sum() + self.w.pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(path, ckpt_dir=None, ckpt_path=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = Recorder()
    dm = LatentDataModule(path, global_batch_size=8, num_workers=0, seed=2)
    cbs = (
        [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, filename="{step}")] if ckpt_dir else []
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(ckpt_dir),
        callbacks=cbs,
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model.seen


def test_resume_mid_epoch_continues_with_the_same_batches(tmp_path):
    path = make_random_store(str(tmp_path / "s"), n=48, latent_shape=(2, 2, 2), num_classes=3).path
    full = _fit(path, ckpt_dir=str(tmp_path / "ck"))
    assert len(full) == 12 and full[6][0] == 1  # 6 steps per epoch, 2 epochs
    for step in (4, 6):  # mid-epoch, and at the end of epoch 0 (saved on its last batch)
        resumed = _fit(path, ckpt_path=str(tmp_path / "ck" / f"step={step}.ckpt"))
        assert resumed == full[step:]


DDP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    import lightning as L
    import torch
    from dit_lightning.data.datamodule import LatentDataModule
    from dit_lightning.ranks import close_process_group

    class Save(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append((self.current_epoch, batch["index"].tolist(), batch["x"].flatten(1).sum(1).tolist()))
            return (self.w * batch["x"].mean()).sum() + self.w.pow(2).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_end(self):
            with open(os.path.join(sys.argv[2], f"rank{self.global_rank}.json"), "w") as f:
                json.dump(self.seen, f)

    warnings.simplefilter("ignore")
    dm = LatentDataModule(sys.argv[1], global_batch_size=16, num_workers=1, persistent_workers=True, seed=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_fork", max_epochs=2,
                        accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Save(), dm)
    close_process_group()  # before exit: gloo must not free a collective in a finalising interpreter
    """
)


def test_two_process_ddp_sees_the_single_process_batches(store, tmp_path):
    """2 gloo ranks (Lightning's DDP, use_distributed_sampler left on): per step, the union of
    the ranks' micro-batches is the single-process micro-batch of twice the size, with the
    same augmentation; two epochs with persistent workers reshuffle."""
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_SCRIPT)
    out = str(tmp_path / "ddp")
    os.makedirs(out)
    env = with_master_port({**os.environ, "PYTHONWARNINGS": "ignore"})
    r = subprocess.run(
        [sys.executable, str(script), store.path, out],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=str(tmp_path),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    seen = [json.load(open(os.path.join(out, f"rank{k}.json"))) for k in range(2)]
    # reference: one process, micro-batch 8 (= 16 / (1 device x 2 accumulation)), no trainer
    ref_sampler = LatentBatchSampler(np.arange(100), 8, 1, 0, seed=4, accumulate_grad_batches=2)
    ds = LatentBatchDataset(store, train=True, seed=4)
    assert len(seen[0]) == len(seen[1]) == 2 * len(ref_sampler) == 2 * 12  # 6 optimizer steps x 2
    for epoch in (0, 1):
        ref_sampler.set_epoch(epoch)
        for step, req in enumerate(ref_sampler):
            ref = ds.get_batch(req.indices, req.epoch)
            got = [seen[k][epoch * 12 + step] for k in range(2)]
            assert all(g[0] == epoch for g in got)
            union = sorted(got[0][1] + got[1][1])
            assert union == req.indices.tolist()
            sums = dict(zip(got[0][1] + got[1][1], got[0][2] + got[1][2]))
            np.testing.assert_allclose([sums[i] for i in union], ref["x"].flatten(1).sum(1).numpy(), rtol=1e-6)
