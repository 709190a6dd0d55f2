"""LatentDataModule: batched, distributed-aware, resumable loading of a latent store.

How batches are made (see docs/data.md):

* Epoch ``e`` uses the permutation ``default_rng([seed, e]).permutation`` of the train split;
  micro-step ``s`` takes the global slice ``perm[s*b*W : (s+1)*b*W]`` (``b`` the micro-batch,
  ``W`` the world size) and rank ``r`` its ``r``-th chunk of ``b``. So the samples of one
  optimizer step are the same whatever ``W`` and the accumulation, and the union over ranks
  of a step is what one process sees with a ``W``-times larger micro-batch.
* The augmentation of sample ``i`` in epoch ``e`` (flip bit, posterior noise) is a pure
  function of ``(seed, e, i)`` (counter-based RNG, ``rng.py``), so it does not depend on rank,
  worker, batch or resume either.
* A sampler in the main process yields one index array per micro-batch; a worker reads the
  whole batch with one sorted fancy-index per shard and augments it vectorised. The sampler
  subclasses ``DistributedSampler`` so Lightning (use_distributed_sampler=True) leaves it alone
  instead of injecting its own; epochs reach it through Lightning's ``set_epoch`` call.
* The train DataLoader is stateful (``state_dict``/``load_state_dict``, which Lightning saves
  in checkpoints): resuming mid-epoch skips the micro-batches already trained on, so the run
  continues with exactly the batches it would have seen.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Optional, Union

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from . import store as st
from .digits import digits_spec, prepare_digits
from .extract import (
    PIXEL_VAE,
    REPA_CLASS_TOKEN,
    REPA_FEATURES,
    REPA_FIXES,
    Channels,
    extract_latents,
    pixel_store_mismatch,
    pixel_store_spec,
    unfinished_repa_features,
)
from .rng import NoiseKernel, flip_bits, to_float32

if TYPE_CHECKING:
    from lightning.pytorch.utilities.parsing import AttributeDict


class BatchRequest(NamedTuple):
    """What the sampler hands a worker: the (sorted) global indices of one micro-batch, its
    epoch, and (with worker processes) the slot of the shared output pool to write into."""

    indices: np.ndarray
    epoch: int
    slot: int = -1


class LatentBatchDataset(Dataset):
    """Map-style dataset whose items are whole batches: ``dataset[BatchRequest]`` -> batch dict.

    ``train=True``: random flip (when the store has flips and ``random_flip``) and a fresh
    posterior sample (variant "moments" and ``sample_posterior``), both keyed by
    (seed, epoch, index). ``train=False``: posterior mean, unflipped image.
    ``repa`` (and a store with REPA features): the batch also holds ``repa``, the encoder's
    features of the very flip ``x`` holds, float32 (B, T, D), and, when the store holds the
    encoder's class token too, ``repa_class_token``, float32 (B, D), of the same flip.
    """

    def __init__(
        self,
        store: Union[st.LatentStore, str],
        train: bool = True,
        seed: int = 0,
        random_flip: bool = True,
        sample_posterior: bool = True,
        repa: bool = True,
    ) -> None:
        self.store = store if isinstance(store, st.LatentStore) else st.LatentStore(store)
        self.repa_shape: Optional[tuple[int, int]] = None  # (T, D) when batches carry features
        self.class_token_dim: Optional[int] = None  # D when they carry the class token too
        features = self.store.features.get(REPA_FEATURES)
        if repa and features is not None:
            self.repa_shape = (features.tokens, features.dim)
            token = self.store.features.get(REPA_CLASS_TOKEN)
            self.class_token_dim = token.dim if token is not None else None
        self.train, self.seed = train, int(seed)
        self.random_flip = random_flip and train and self.store.num_flips > 1
        self.sample_posterior = sample_posterior and train and self.store.variant == "moments"
        # the store's latent transform, model = a * raw + b per channel; a plain scale (b = 0, one a)
        # is fused into the posterior kernel, anything else applied after it
        transform = self.store.transform
        a, b = transform.coefficients(self.store.latent_shape[0])
        self.scale = a[0] if len(set(a)) == 1 and not any(b) else 1.0
        self._affine: Optional[tuple[np.ndarray, np.ndarray]] = None
        if self.scale == 1.0 and (set(a) != {1.0} or any(b)):
            self._affine = (np.asarray(a, np.float32)[:, None], np.asarray(b, np.float32)[:, None])
        self._kernel: Optional[NoiseKernel] = None
        # (slots, micro_batch * (C*H*W + T*D + D)) float32 in shared memory, set by BatchDataLoader: x
        # first, the REPA features from column ``pool_repa_offset`` on, the class tokens from
        # ``pool_token_offset`` on
        self.pool: Optional[torch.Tensor] = None
        self.pool_repa_offset = 0
        self.pool_token_offset = 0

    def __len__(self) -> int:
        return len(self.store)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_kernel"] = None  # buffers are rebuilt in each worker
        return state

    @property
    def sample_numel(self) -> int:
        return int(np.prod(self.store.latent_shape))

    @property
    def repa_numel(self) -> int:
        """Feature values per sample in a batch (T*D), 0 without features."""
        return int(np.prod(self.repa_shape)) if self.repa_shape is not None else 0

    @property
    def token_numel(self) -> int:
        """Class-token values per sample in a batch (D), 0 without them."""
        return self.class_token_dim or 0

    def __getitem__(self, request: Union[BatchRequest, np.ndarray]) -> dict[str, Any]:
        if not isinstance(request, BatchRequest):
            request = BatchRequest(np.asarray(request, dtype=np.int64).reshape(-1), 0)
        if request.slot >= 0 and self.pool is not None:
            # Worker process: write x into the shared pool and send back only the slot and the
            # small arrays. Torch's default path would allocate a fresh shared-memory segment
            # and pass its file descriptor over a socket for every tensor of every batch, which
            # costs more CPU than computing the batch.
            B = len(request.indices)
            row = self.pool[request.slot].numpy()
            out = row[: B * self.sample_numel].reshape(B, -1)
            off = self.pool_repa_offset
            out_repa = row[off : off + B * self.repa_numel].reshape(B, -1) if self.repa_shape else None
            off = self.pool_token_offset
            out_token = row[off : off + B * self.token_numel].reshape(B, -1) if self.class_token_dim else None
            x, y, idx, _, _ = self._compute(request.indices, request.epoch, out, out_repa, out_token)
            return {"slot": request.slot, "n": B, "y": y, "index": idx}
        return self.get_batch(request.indices, request.epoch)

    def _compute(
        self,
        indices: np.ndarray,
        epoch: int,
        out: Optional[np.ndarray] = None,
        out_repa: Optional[np.ndarray] = None,
        out_token: Optional[np.ndarray] = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray]]:
        idx = np.asarray(indices, dtype=np.int64)
        store = self.store
        B = len(idx)
        flip = flip_bits(self.seed, epoch, idx) if self.random_flip else 0
        raw = store.read(idx, flip=flip)  # (B, K, C, H, W) storage dtype
        repa = None
        if self.repa_shape is not None:
            # the features of the same flip as x: the encoder saw the image x was encoded from
            if out_repa is None:
                out_repa = np.empty((B, self.repa_numel), np.float32)
            np.copyto(out_repa.reshape(B, *self.repa_shape), store.read_features(REPA_FEATURES, idx, flip=flip))
            repa = out_repa
        token = None
        if self.class_token_dim is not None:  # the class token of the same flip, (B, 1, D) read as (B, D)
            if out_token is None:
                out_token = np.empty((B, self.class_token_dim), np.float32)
            np.copyto(out_token.reshape(B, 1, -1), store.read_features(REPA_CLASS_TOKEN, idx, flip=flip))
            token = out_token
        if out is None:
            out = np.empty((B, self.sample_numel), np.float32)
        if self.sample_posterior:
            if self._kernel is None:
                self._kernel = NoiseKernel(self.sample_numel)
            self._kernel.posterior_sample(
                raw[:, 0].reshape(B, -1), raw[:, 1].reshape(B, -1), self.seed, epoch, idx, self.scale, out=out
            )
        else:
            to_float32(raw[:, 0].reshape(B, -1), out=out)  # the mean (moments) or the stored sample
            if self.scale != 1.0:
                out *= np.float32(self.scale)
        if self._affine is not None:
            per_channel = out.reshape(B, self._affine[0].shape[0], -1)  # a view: (B, C, H*W)
            per_channel *= self._affine[0]
            per_channel += self._affine[1]
        return out, store.labels[idx], idx.copy(), repa, token

    def get_batch(self, indices: np.ndarray, epoch: int = 0) -> dict[str, torch.Tensor]:
        """Read and augment one batch (``indices`` preferably sorted: then no reordering copy)."""
        x, y, idx, repa, token = self._compute(indices, epoch)
        batch = {
            "x": torch.from_numpy(x.reshape(len(idx), *self.store.latent_shape)),
            "y": torch.from_numpy(y),
            "index": torch.from_numpy(idx),
        }
        if repa is not None and self.repa_shape is not None:
            batch["repa"] = torch.from_numpy(repa.reshape(len(idx), *self.repa_shape))
        if token is not None:
            batch["repa_class_token"] = torch.from_numpy(token)
        return batch


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The shuffle of epoch ``epoch``: a pure function of (seed, epoch)."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch), 0x5EED]).permutation(n)


class LatentBatchSampler(DistributedSampler):
    """Yields one ``BatchRequest`` per micro-batch of this rank (see the module docstring).

    It is a ``DistributedSampler`` subclass only so that Lightning does not replace it; it
    needs no process group (rank and world size are given).
    """

    def __init__(
        self,
        indices: np.ndarray,
        micro_batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        accumulate_grad_batches: int = 1,
    ) -> None:
        Sampler.__init__(self)
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside world size {num_replicas}")
        self.indices = np.asarray(indices, dtype=np.int64)
        self.micro_batch_size = int(micro_batch_size)
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.accumulate_grad_batches = int(accumulate_grad_batches)
        self.epoch = 0
        self.skip = 0  # micro-batches to skip at the start of the next iteration (resume)
        self.iter_epoch = 0  # epoch of the iteration in progress (or last started)
        # DistributedSampler's attribute (typed Dataset): this sampler reads no dataset.
        self.dataset = None  # type: ignore[assignment]
        self.num_slots = 0  # set by the DataLoader when it uses a shared output pool
        # DistributedSampler's bookkeeping names: samples per replica and over all replicas
        self.num_samples = len(self) * self.micro_batch_size
        self.total_size = self.num_samples * self.num_replicas

    @property
    def step_size(self) -> int:
        """Samples per micro-step over all ranks."""
        return self.micro_batch_size * self.num_replicas

    def __len__(self) -> int:
        n, g = len(self.indices), self.step_size
        if self.shuffle and self.drop_last:
            # whole optimizer steps only, so every step has exactly global_batch_size samples
            return (n // (g * self.accumulate_grad_batches)) * self.accumulate_grad_batches
        if self.drop_last:
            return n // g
        return -(-n // g)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All ranks' samples of an epoch in step order (length ``len(self) * step_size`` or less)."""
        if self.shuffle:
            order = self.indices[epoch_permutation(self.seed, epoch, len(self.indices))]
        else:
            order = self.indices
        need = len(self) * self.step_size
        if self.shuffle and need > len(order):
            order = np.resize(order, need)  # wrap around to fill the last step (drop_last=False)
        return order[:need] if self.shuffle or self.drop_last else order

    def rank_batch(self, order: np.ndarray, step: int) -> np.ndarray:
        """This rank's sorted indices of micro-step ``step``."""
        g, b, r, W = self.step_size, self.micro_batch_size, self.rank, self.num_replicas
        chunk = order[step * g : (step + 1) * g]
        if len(chunk) == g:
            part = chunk[r * b : (r + 1) * b]
        else:  # last, partial evaluation step: split it evenly; pad if fewer samples than ranks
            if len(chunk) < W:
                chunk = np.resize(np.concatenate([chunk, order]), W)
            part = np.array_split(chunk, W)[r]
        return np.sort(part)

    def __iter__(self) -> Iterator[BatchRequest]:
        epoch, start = self.epoch, self.skip
        self.iter_epoch, self.skip = epoch, 0
        order = self.epoch_order(epoch)
        steps, slots = len(self), self.num_slots
        # Requests are dispatched and returned in order, so slot = position % slots is free
        # again once the pool has more slots than batches in flight (see BatchDataLoader).
        return (
            BatchRequest(self.rank_batch(order, s), epoch, (s - start) % slots if slots else -1)
            for s in range(start, steps)
        )


def _identity(batch: Any) -> Any:
    return batch


class _CopyOut:
    """Iterator over a worker DataLoader that turns pool slots back into batch dicts.

    x is copied out of the slot at once (into pinned memory when pinning), so the slot can be
    reused and the batch stays valid however long the caller keeps it.
    """

    def __init__(
        self,
        it: Iterator[Any],
        pool: torch.Tensor,
        shape: tuple[int, ...],
        pin: bool,
        repa_shape: Optional[tuple[int, int]] = None,
        repa_offset: int = 0,
        token_dim: Optional[int] = None,
        token_offset: int = 0,
    ) -> None:
        self._it, self._shape, self._pin = it, shape, pin
        self._repa_shape, self._repa_offset = repa_shape, repa_offset
        self._token_dim, self._token_offset = token_dim, token_offset
        self._pool_np = pool.numpy()

    def __iter__(self) -> _CopyOut:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        r = next(self._it)
        if "slot" not in r:
            return r
        n = r["n"]
        x = torch.empty((n, *self._shape), dtype=torch.float32, pin_memory=self._pin)
        # numpy's copy is a plain single-threaded memcpy; torch's copy_ would wake its OpenMP
        # pool, whose spinning threads cost far more CPU than the copy on a busy host
        np.copyto(x.numpy().reshape(-1), self._pool_np[r["slot"], : x.numel()])
        y, idx = torch.from_numpy(r["y"]), torch.from_numpy(r["index"])
        if self._pin:
            y, idx = y.pin_memory(), idx.pin_memory()
        batch = {"x": x, "y": y, "index": idx}
        if self._repa_shape is not None:
            repa = torch.empty((n, *self._repa_shape), dtype=torch.float32, pin_memory=self._pin)
            a = self._repa_offset
            np.copyto(repa.numpy().reshape(-1), self._pool_np[r["slot"], a : a + repa.numel()])
            batch["repa"] = repa
        if self._token_dim is not None:
            token = torch.empty((n, self._token_dim), dtype=torch.float32, pin_memory=self._pin)
            a = self._token_offset
            np.copyto(token.numpy().reshape(-1), self._pool_np[r["slot"], a : a + token.numel()])
            batch["repa_class_token"] = token
        return batch

    def __getattr__(self, name: str) -> Any:
        if name == "_it":
            raise AttributeError(name)
        return getattr(self._it, name)  # e.g. _shutdown_workers for whoever looks for it


class BatchDataLoader(DataLoader):
    """DataLoader whose items are whole batches built by ``LatentBatchDataset`` (batch_size=None).

    With worker processes, batches travel through a pool of preallocated shared-memory slots
    (one per batch in flight, plus spare) instead of a new shared-memory segment per tensor.
    ``pin_memory`` pins the copied-out batch (only when CUDA is available).
    """

    def __init__(
        self,
        dataset: LatentBatchDataset,
        sampler: LatentBatchSampler,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        prefetch_factor: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        pin = bool(pin_memory and torch.cuda.is_available())
        super().__init__(
            dataset,
            batch_size=None,
            sampler=sampler,
            num_workers=num_workers,
            collate_fn=_identity,  # the dataset already returns finished batches
            pin_memory=pin and num_workers == 0,  # with workers, _CopyOut pins while copying
            persistent_workers=persistent_workers and num_workers > 0,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            **kwargs,
        )
        self._pin_out = pin

    def __iter__(self) -> Any:
        if self.num_workers == 0:
            return super().__iter__()
        ds: LatentBatchDataset = self.dataset  # type: ignore[assignment]
        sampler: LatentBatchSampler = self.sampler  # type: ignore[assignment]
        if not (self.persistent_workers and self._iterator is not None):
            # New workers are about to be started: give them a fresh pool. (Workers of an older,
            # abandoned iterator may still be writing into theirs.)
            slots = self.num_workers * (self.prefetch_factor or 2) + 2
            b = sampler.micro_batch_size
            ds.pool = torch.empty((slots, b * (ds.sample_numel + ds.repa_numel + ds.token_numel)), dtype=torch.float32)
            ds.pool.share_memory_()
            ds.pool_repa_offset = b * ds.sample_numel  # features after x (set before the workers start)
            ds.pool_token_offset = b * (ds.sample_numel + ds.repa_numel)  # class tokens after the features
            sampler.num_slots = slots
        it = super().__iter__()
        shape = tuple(ds.store.latent_shape)
        token = (ds.class_token_dim, ds.pool_token_offset)
        return _CopyOut(it, ds.pool, shape, self._pin_out, ds.repa_shape, ds.pool_repa_offset, *token)  # type: ignore[arg-type]


class LatentDataLoader(BatchDataLoader):
    """The training loader: a ``BatchDataLoader`` with Lightning's stateful-loader protocol.

    ``state_dict`` records the epoch and how many micro-batches the trainer has consumed in
    it (from ``progress_fn``; the sampler itself runs ahead because of prefetching);
    ``load_state_dict`` makes the next iteration skip exactly those.
    """

    def __init__(
        self,
        dataset: LatentBatchDataset,
        sampler: LatentBatchSampler,
        progress_fn: Optional[Callable[[], int]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, sampler, **kwargs)
        self._progress_fn = progress_fn

    def state_dict(self) -> dict[str, Any]:
        s: LatentBatchSampler = self.sampler  # type: ignore[assignment]
        consumed = 0
        if self._progress_fn is not None:
            try:
                consumed = int(self._progress_fn())
            except Exception:
                consumed = 0
        return {
            "epoch": s.iter_epoch,
            "consumed_batches": consumed,
            "seed": s.seed,
            "micro_batch_size": s.micro_batch_size,
            "num_replicas": s.num_replicas,
            "num_samples": len(s.indices),
            "batches_per_epoch": len(s),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s: LatentBatchSampler = self.sampler  # type: ignore[assignment]
        epoch, consumed = int(state.get("epoch", 0)), int(state.get("consumed_batches", 0))
        same_order = state.get("seed") == s.seed and state.get("num_samples") == len(s.indices)
        split = (state.get("micro_batch_size"), state.get("num_replicas"))
        if same_order and consumed and split != (s.micro_batch_size, s.num_replicas) and None not in split:
            # The same epoch order split differently (auto-fit changed the micro-batch, or the number of
            # devices changed): micro-step k holds samples [k * step, (k + 1) * step) of the order whatever
            # the split, so skip the same number of samples.
            samples = consumed * int(split[0]) * int(split[1])  # type: ignore[arg-type]
            consumed = samples // s.step_size if samples % s.step_size == 0 else -1
        if consumed >= len(s):
            epoch, consumed = epoch + 1, 0
        if not same_order or consumed < 0:
            if consumed:
                warnings.warn(
                    "the data settings changed since the checkpoint (seed, split, or a batch split that does not "
                    "line up with it): the resumed epoch restarts from its first batch",
                    stacklevel=2,
                )
            consumed = 0
        s.set_epoch(epoch)
        s.skip = consumed


def _resolve_val_count(val_size: Union[int, float], n: int) -> int:
    if isinstance(val_size, float) and 0.0 <= val_size < 1.0:
        v = int(round(val_size * n))
    elif isinstance(val_size, float) and not val_size.is_integer():
        raise ValueError(f"val_size must be a count or a fraction in [0, 1), got {val_size}")
    else:
        v = int(val_size)
    if v < 0 or v >= n:
        raise ValueError(f"val_size {val_size} must be >= 0 and leave training samples out of {n}")
    return v


def split_indices(n: int, val_size: Union[int, float], split_seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) sorted index arrays: the val split is a fixed seeded random subset.

    A random subset rather than the last samples, because stores are ordered by class.
    """
    v = _resolve_val_count(val_size, n)
    if v == 0:
        return np.arange(n, dtype=np.int64), np.zeros(0, np.int64)
    chosen = np.random.default_rng([int(split_seed), 0x5A1]).permutation(n)[:v]
    mask = np.zeros(n, bool)
    mask[chosen] = True
    return np.nonzero(~mask)[0].astype(np.int64), np.nonzero(mask)[0].astype(np.int64)


class LatentDataModule(L.LightningDataModule):
    """Loads a latent store (``dit-lightning extract``, or the digits demo) for DiT training.

    Batches are dicts ``{"x": float32 (B, C, H, W) scaled latents, "y": int64 (B,) labels,
    "index": int64 (B,) global sample indices}``, plus ``"repa"``: float32 (B, T, D), the REPA
    encoder's patch features of the very flip ``x`` holds, when the store has features
    (``extract --repa_encoder``; :attr:`repa_spec` says which encoder made them) and
    ``repa_features``; and ``"repa_class_token"``: float32 (B, D), the encoder's class token of
    the same flip (REG's target), when the store holds it too.

    Args:
        path: Store directory.
        global_batch_size: Samples per optimizer step over all devices; the per-device
            micro-batch is ``global_batch_size // (world_size * accumulate_grad_batches)``.
        val_size: Held-out samples: a count (int) or a fraction in (0, 1) (float); a fixed
            random subset drawn with ``split_seed``. 0: no validation data.
        val_batch_size: Per-device validation batch; default the training micro-batch.
        num_workers: DataLoader worker processes (each builds whole batches).
        pin_memory: Pin host memory (only takes effect when CUDA is available).
        persistent_workers: Keep workers across epochs (only when num_workers > 0).
        prefetch_factor: Batches prefetched per worker.
        seed: Seed of the shuffle and of the augmentation.
        split_seed: Seed of the train/val split (kept apart so changing ``seed`` keeps the split).
        random_flip: Pick the stored flip at random in training (stores with flips).
        sample_posterior: Draw z = mean + std * eps in training (variant "moments"); if False,
            training uses the posterior mean.
        prepare: "digits": build the digits demo store at ``path`` if it is missing (the CLI builds
            it only at the ``data.path`` of the config that asks for it, or with ``--data.prepare
            digits`` on the command line: a mistyped ``--data.path`` is refused, not filled with digits).
            "images": build a pixel store of the ImageFolder ``image_root`` at ``path`` if it is missing
            (``extract --vae none``: resumable; on rank 0, the others wait); a store at ``path`` made
            from another folder, size or channel count is refused.
        digits_size: Side of the digits images (multiple of 8) when ``prepare="digits"``.
        image_root: The ImageFolder (``root/<class>/<image>``) of ``prepare="images"``.
        image_size: Side of its ADM centre crop in pixels (``prepare="images"``; e.g. 28 for MNIST).
        image_channels: ``prepare="images"``: "auto" (1 when every image is stored grey, else 3), 1 or 3.
        drop_last: Drop the last incomplete optimizer step of each epoch; if False it is filled
            by wrapping around to the start of the epoch's permutation.
        predict_labels: Classes ``dit-lightning predict`` samples ("all", "random", "0-9", "1,5").
        predict_num_samples: Number of samples ``dit-lightning predict`` generates.
        verify_checksums: Before training, hash every shard and compare with the sha256 its commit
            record holds, and scan it for NaN / inf (reads the whole store once, split over the
            ranks). Opening a store always checks the files' sizes and its commit records against
            the index (an inconsistent store is refused); ``dit-lightning verify`` does all of
            this without training.
        repa_features: Add the store's REPA features to the batches (``batch["repa"]``, and
            ``batch["repa_class_token"]`` when it holds the encoder's class token) when it has
            them; False: leave them out (REPA then computes them online, or is off). With True, a
            REPA run on a store whose features pass stopped half-way is refused
            (:attr:`repa_unfinished`) rather than computing them online unawares.
    """

    def __init__(
        self,
        path: str,
        global_batch_size: int = 256,
        val_size: Union[int, float] = 0,
        val_batch_size: Optional[int] = None,
        num_workers: int = 4,
        pin_memory: bool = True,
        persistent_workers: bool = True,
        prefetch_factor: int = 2,
        seed: int = 0,
        split_seed: int = 0,
        random_flip: bool = True,
        sample_posterior: bool = True,
        prepare: Optional[Literal["digits", "images"]] = None,
        digits_size: int = 8,
        drop_last: bool = True,
        predict_labels: str = "all",
        predict_num_samples: int = 64,
        verify_checksums: bool = False,
        repa_features: bool = True,
        image_root: Optional[str] = None,
        image_size: Optional[int] = None,
        image_channels: Channels = "auto",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if prepare not in (None, "digits", "images"):
            raise ValueError(f"prepare must be None, 'digits' or 'images', got {prepare!r}")
        self.image_root, self.image_size, self.image_channels = image_root, image_size, image_channels
        self._check_images_settings(prepare)
        self.path = os.path.abspath(path)
        self.global_batch_size = int(global_batch_size)
        self.val_size = val_size
        self.val_batch_size = val_batch_size
        self.num_workers = int(num_workers)
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.seed, self.split_seed = int(seed), int(split_seed)
        self.random_flip, self.sample_posterior = random_flip, sample_posterior
        self.prepare, self.digits_size = prepare, int(digits_size)
        self.drop_last = drop_last
        self.repa_features = bool(repa_features)
        self._repa: Optional[st.FeatureSpec] = None  # the store's REPA features (known once it is opened)
        self._repa_token: Optional[st.FeatureSpec] = None  # and its encoder's class token
        self._repa_unfinished: Optional[str] = None  # why a features pass's features are not used
        # The store opened to read the spec (index and shard sizes checked), kept for setup().
        self._opened: Optional[st.LatentStore] = None
        self.spec = self._read_spec()  # eager: the index and shard sizes (or the digits constants)
        self.store: Optional[st.LatentStore] = None
        self._micro: Optional[int] = None
        self._world, self._rank, self._accum = 1, 0, 1
        self.train_indices: Optional[np.ndarray] = None
        self.val_indices: Optional[np.ndarray] = None

    if TYPE_CHECKING:

        @property
        def hparams(self) -> AttributeDict:
            """The ``__init__`` arguments saved by ``save_hyperparameters`` (always an ``AttributeDict`` here)."""

    def _read_spec(self) -> st.StoreSpec:
        meta_path = os.path.join(self.path, st.META_FILE)
        if os.path.exists(meta_path):
            self._opened = self._open()
            return self._opened.spec
        if self.prepare == "digits":
            return digits_spec(self.digits_size)
        if self.prepare == "images":
            assert self.image_root is not None and self.image_size is not None  # _check_images_settings
            return pixel_store_spec(self.image_root, self.image_size, self.image_channels, flips=self.random_flip)
        st.LatentStore(self.path)  # raises the explanatory error (missing / incomplete store)
        raise st.StoreError(f"no store at {self.path}")  # pragma: no cover

    def _open(self) -> st.LatentStore:
        """Open the store, validated as training needs it: the index and every file's size (a corrupt
        index or shard names its file), and the commit records against the index (cheap: no data read;
        ``verify`` also hashes and scans the data)."""
        store = st.LatentStore(self.path, REPA_FIXES)
        if self.prepare == "images":
            self._check_images_store(store.spec)
        problems = store.check_records()
        if problems:
            listed = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
            raise st.StoreError(
                f"the store at {self.path} is inconsistent, not trained on: {listed}. (`dit-lightning verify "
                f"{self.path}` lists every problem, checksums included.)"
            )
        self._repa = store.features.get(REPA_FEATURES)
        self._repa_token = store.features.get(REPA_CLASS_TOKEN)
        self._repa_unfinished = unfinished_repa_features(store) if self.repa_features else None
        return store

    # -- what the model links to ------------------------------------------------------

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the latents."""
        return tuple(self.spec.latent_shape)  # type: ignore[return-value]

    @property
    def num_classes(self) -> int:
        return len(self.spec.class_names)

    @property
    def class_names(self) -> list[str]:
        return list(self.spec.class_names)

    @property
    def scale_factor(self) -> float:
        return float(self.spec.scale_factor)

    @property
    def latent_transform(self) -> dict[str, Any]:
        """The record of the store's latent transform (linked to the model's ``latent_transform``)."""
        return self.spec.transform.record()

    @property
    def repa_spec(self) -> Optional[dict[str, Any]]:
        """The REPA encoder whose features the batches carry (``batch["repa"]``), or None (no features in
        the store, or ``repa_features=False``): ``encoder``, ``weights`` (file name), ``weights_sha256``,
        ``image_size``, ``tokens``, ``dim``, ``dtype``, ``key``, as ``meta.json`` records them; and
        ``class_token``, the record of the encoder's class token (``batch["repa_class_token"]``, the
        same fields; ``tokens`` 1) when the store holds it (REG's target), absent otherwise. Known
        from construction for an existing store; for a digits store built by ``prepare_data``, after
        ``setup``."""
        if not self.repa_features or self._repa is None:
            return None
        if self._repa_token is None:
            return self._repa.to_json()
        return {**self._repa.to_json(), "class_token": self._repa_token.to_json()}

    @property
    def repa_unfinished(self) -> Optional[str]:
        """Why the batches carry no REPA features though the store started computing them (its
        features pass stopped half-way), with the fixes; None otherwise, or with
        ``repa_features=False``. A REPA run refuses it rather than computing features online
        unawares."""
        return self._repa_unfinished

    @property
    def micro_batch_size(self) -> int:
        """Per-device batch of one forward (known after ``setup``; before, as for one device)."""
        return self._micro if self._micro is not None else self.global_batch_size

    def check_compatible(
        self, latent_shape: Optional[tuple[int, ...]] = None, num_classes: Optional[int] = None
    ) -> None:
        """Raise ValueError if a model with these latent shape / classes cannot train on this store."""
        st.check_compatible(self.spec, latent_shape, num_classes, where=f"the store at {self.path}")

    # -- Lightning hooks -------------------------------------------------------------

    def _check_images_settings(self, prepare: Optional[str]) -> None:
        """``prepare="images"`` needs its folder and size; they mean nothing without it."""
        if prepare != "images":
            given = [n for n in ("image_root", "image_size") if getattr(self, n) is not None]
            given += ["image_channels"] if self.image_channels != "auto" else []
            if given:
                raise ValueError(
                    f"data.{given[0]} is read only to build a pixel store from images: add --data.prepare images "
                    "(or leave it out to train on the store at data.path)"
                )
            return
        if not self.image_root or self.image_size is None:
            raise ValueError(
                "data.prepare images builds a pixel store of an image folder: give it --data.image_root DIR (the "
                "ImageFolder, DIR/<class>/<image>) and --data.image_size N (the side of the centre crop, e.g. 28)"
            )
        if not os.path.isdir(self.image_root):
            raise FileNotFoundError(f"--data.image_root {self.image_root} is not a directory of class folders")
        if self.image_size < 1:
            raise ValueError(f"--data.image_size must be a positive number of pixels, got {self.image_size}")
        if self.image_channels not in ("auto", 1, 3):
            raise ValueError(f"--data.image_channels must be auto, 1 or 3, got {self.image_channels!r}")

    def _check_images_store(self, spec: st.StoreSpec) -> None:
        """Refuse a store at ``path`` (whole, or planned by a preparation that stopped) that is not the
        pixel store of ``image_root`` at ``image_size``."""
        assert self.image_root is not None and self.image_size is not None
        why = pixel_store_mismatch(spec, self.image_root, self.image_size, self.image_channels, self.random_flip)
        if why is not None:
            raise st.StoreError(
                f"--data.path {self.path} holds another store than the pixels of --data.image_root "
                f"{self.image_root} at --data.image_size {self.image_size}: {why}. Point --data.path at a "
                f"directory of its own (one per folder and size, e.g. data/<name>_{self.image_size}px), or "
                f"delete {self.path} to make it again"
            )

    def _prepare_images(self) -> None:
        """The pixel store of ``image_root`` at ``path`` (``extract --vae none``, one process: resumable)."""
        assert self.image_root is not None and self.image_size is not None
        if os.path.exists(os.path.join(self.path, st.PLAN_FILE)):  # a preparation that stopped: resumed if it is ours
            self._check_images_store(st.load_plan(self.path))
        rank_zero_info(f"data.prepare images: writing the pixel store of {self.image_root} to {self.path}")
        done = extract_latents(
            self.image_root, self.path, vae=PIXEL_VAE, image_size=self.image_size, flips=self.random_flip,
            channels=self.image_channels, num_workers=self.num_workers, device="cpu", rank=0, world_size=1,
            progress=False,
        )  # fmt: skip
        skipped = f", {done['images_skipped']} skipped (listed in {done['report']})" if done["images_skipped"] else ""
        rank_zero_info(f"data.prepare images: {done['count']} images in {self.path}{skipped}")

    def prepare_data(self) -> None:
        if self.prepare == "digits" and not st.is_store(self.path):
            prepare_digits(self.path, size=self.digits_size)
        if self.prepare == "images" and not os.path.exists(os.path.join(self.path, st.META_FILE)):
            self._prepare_images()

    def _distributed(self) -> tuple[int, int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return int(trainer.world_size), int(trainer.global_rank), int(trainer.accumulate_grad_batches)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank(), 1
        return 1, 0, 1

    def setup(self, stage: Optional[str] = None) -> None:
        world, rank, accum = self._distributed()
        per_step = world * accum
        if self.global_batch_size % per_step:
            lo = (self.global_batch_size // per_step) * per_step
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not divisible by {world} device(s) x {accum} "
                f"accumulation step(s) = {per_step}; choose a global_batch_size that is a multiple of {per_step} "
                f"(e.g. {max(per_step, lo)} or {lo + per_step}), or change devices / accumulate_grad_batches"
            )
        self._world, self._rank, self._accum = world, rank, accum
        self._micro = self.global_batch_size // per_step
        if self.store is None:
            if self.prepare in ("digits", "images") and not os.path.exists(os.path.join(self.path, st.META_FILE)):
                self.prepare_data()  # notebook use without a trainer
            self.store = self._opened or self._open()
            self._opened = None
            self.spec = self.store.spec
            if self.hparams.get("verify_checksums"):
                self._verify(world, rank)
        self.train_indices, self.val_indices = split_indices(len(self.store), self.val_size, self.split_seed)
        n_train = len(self.train_indices)
        if self.drop_last and n_train < self.global_batch_size:
            raise ValueError(
                f"the train split has {n_train} samples, fewer than one global batch of {self.global_batch_size}: "
                "lower global_batch_size or set drop_last=False"
            )

    def _verify(self, world: int, rank: int) -> None:
        """``verify_checksums``: this rank checks shards k = rank (mod world); all ranks stop together."""
        assert self.store is not None
        problems = self.store.verify(checksums=True, values=True, shards=range(rank, self.store.num_shards, world))
        trainer = getattr(self, "trainer", None)
        ok = not problems
        if trainer is not None and world > 1:
            ok = trainer.strategy.reduce_boolean_decision(ok, all=True)
        if problems:
            listed = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
            raise st.StoreError(f"the store at {self.path} failed verification: {listed}")
        if not ok:
            raise st.StoreError(f"the store at {self.path} failed verification on another rank (see its message)")
        rank_zero_info(f"verified the checksums and values of the {self.store.num_shards} shards of {self.path}")

    def _loader_kwargs(self) -> dict[str, Any]:
        return {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers,
            "prefetch_factor": self.prefetch_factor,
        }

    def _ensure_setup(self) -> None:
        if self.store is None or self._micro is None:
            self.setup("fit")

    def train_sampler(self) -> LatentBatchSampler:
        self._ensure_setup()
        return LatentBatchSampler(
            self.train_indices,  # type: ignore[arg-type]
            self.micro_batch_size,
            num_replicas=self._world,
            rank=self._rank,
            shuffle=True,
            seed=self.seed,
            drop_last=self.drop_last,
            accumulate_grad_batches=self._accum,
        )

    def train_dataloader(self) -> LatentDataLoader:
        self._ensure_setup()
        dataset = LatentBatchDataset(
            self.store,  # type: ignore[arg-type]
            train=True,
            seed=self.seed,
            random_flip=self.random_flip,
            sample_posterior=self.sample_posterior,
            repa=self.repa_features,
        )
        return LatentDataLoader(
            dataset, self.train_sampler(), progress_fn=_trainer_progress(self), **self._loader_kwargs()
        )

    def val_dataloader(self) -> Union[DataLoader, list]:
        self._ensure_setup()
        if self.val_indices is None or len(self.val_indices) == 0:
            return []
        return self._held_out_loader(self.val_indices)

    def test_dataloader(self) -> DataLoader:
        """The held-out split of ``val_size`` items, for ``dit-lightning test``'s loss: the same items
        as validation (a store has one held-out split; training never sees it). The generation
        metrics (FID, digits accuracy) compare with the reference set of ``GenerationMetrics``."""
        self._ensure_setup()
        if self.val_indices is None or len(self.val_indices) == 0:
            raise ValueError(
                "`test` measures the held-out split, and this data module holds none out: set data.val_size "
                "(e.g. --data.val_size 1000, the same split as validation) and test again"
            )
        rank_zero_info(
            f"test: the loss on the held-out split ({len(self.val_indices)} items, data.val_size), the same items "
            "validation uses"
        )
        return self._held_out_loader(self.val_indices)

    def _held_out_loader(self, indices: np.ndarray) -> DataLoader:
        sampler = LatentBatchSampler(
            indices,
            self.val_batch_size or self.micro_batch_size,
            num_replicas=self._world,
            rank=self._rank,
            shuffle=False,
            drop_last=False,
        )
        dataset = LatentBatchDataset(self.store, train=False, repa=self.repa_features)  # type: ignore[arg-type]
        return BatchDataLoader(dataset, sampler, **self._loader_kwargs())

    def predict_dataloader(self) -> DataLoader:
        """Sample requests ``{"index", "y"}`` for ``DiTModule.predict_step`` (Lightning shards them over ranks)."""
        from ..sampling.labels import SampleRequests, parse_labels

        plan = parse_labels(self.hparams.predict_labels, self.num_classes, seed=self.seed)
        requests = SampleRequests(range(self.hparams.predict_num_samples), plan)
        return DataLoader(requests, batch_size=self.val_batch_size or self.global_batch_size, shuffle=False)


def _trainer_progress(dm: LatentDataModule) -> Callable[[], int]:
    ref = weakref.ref(dm)

    def consumed() -> int:
        d = ref()
        trainer = getattr(d, "trainer", None) if d is not None else None
        if trainer is None:
            return 0
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)

    return consumed
