"""The on-disk latent store: sharded, memory-mapped, written atomically (format: docs/data.md).

Layout of a store directory::

    plan.json                 settings fixed before the first shard is written (StoreSpec)
    shards/shard-00000.npy    (n_k, F, K, C, H, W) float16, or uint16 holding bfloat16 bits
    shards/shard-00000.labels.npy   (n_k,) int32 class labels
    shards/shard-00000.json   commit record of the shard: written last, so its presence
                              (with matching file sizes) is what makes the shard count
    labels.npy, sources.txt, report.jsonl   written by finalize_store()
    meta.json                 written last by finalize_store(); a store without it is incomplete

``F`` is 2 with flips (index 0: the image, 1: its horizontal flip) and 1 without;
``K`` is 2 for the "moments" variant (0: posterior mean, 1: log-variance) and 1 for "sample".
Values are stored unscaled; readers multiply by ``scale_factor``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
from collections.abc import Iterable, Sequence
from typing import Any, Literal, Optional, Union

import numpy as np

from ..atomic import save_npy, write_bytes, write_json

FORMAT_NAME = "dit-lightning-latent-store"
FORMAT_VERSION = 1
META_FILE = "meta.json"
PLAN_FILE = "plan.json"
LABELS_FILE = "labels.npy"
SOURCES_FILE = "sources.txt"
REPORT_FILE = "report.jsonl"
SHARD_DIR = "shards"

StorageDtype = Literal["float16", "bfloat16"]
Variant = Literal["moments", "sample"]
PathLike = Union[str, "os.PathLike[str]"]

# numpy has no bfloat16: its bits are stored as uint16 and viewed as torch.bfloat16 on read.
_NP_DTYPES = {"float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}


class StoreError(RuntimeError):
    """A store that cannot be used as it is; the message names the problem and the fix."""


class IncompleteStoreError(StoreError):
    """The store's extraction has not finished (shards missing or not finalised)."""


# --------------------------------------------------------------------------------------
# Settings of a store
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """Everything fixed before extraction starts (saved as plan.json, repeated in meta.json)."""

    latent_shape: tuple[int, int, int]
    dtype: StorageDtype
    variant: Variant
    flips: bool
    scale_factor: float
    vae: str
    image_size: int
    class_names: tuple[str, ...]
    source: str
    num_items: int  # planned inputs (image files); bad ones are skipped, so count <= num_items
    shard_size: int
    preprocessing: str = "adm-center-crop"
    fingerprint: str = ""  # hash of the input list, so a resume on other inputs is refused
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in _NP_DTYPES:
            raise ValueError(f"storage dtype must be 'float16' or 'bfloat16', got {self.dtype!r}")
        if self.variant not in ("moments", "sample"):
            raise ValueError(f"variant must be 'moments' or 'sample', got {self.variant!r}")
        if len(self.latent_shape) != 3 or min(self.latent_shape) < 1:
            raise ValueError(f"latent_shape must be (C, H, W) with positive sizes, got {self.latent_shape}")
        if self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {self.shard_size}")

    @property
    def num_flips(self) -> int:
        return 2 if self.flips else 1

    @property
    def num_moments(self) -> int:
        return 2 if self.variant == "moments" else 1

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one stored sample: (F, K, C, H, W)."""
        return (self.num_flips, self.num_moments, *self.latent_shape)

    @property
    def np_dtype(self) -> np.dtype:
        return _NP_DTYPES[self.dtype]

    @property
    def num_shards(self) -> int:
        return max(1, -(-self.num_items // self.shard_size))

    def shard_range(self, k: int) -> tuple[int, int]:
        """Input items [start, stop) covered by shard ``k``."""
        start = k * self.shard_size
        return start, min(self.num_items, start + self.shard_size)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["latent_shape"] = list(self.latent_shape)
        d["class_names"] = list(self.class_names)
        d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StoreSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["latent_shape"] = tuple(int(v) for v in kw["latent_shape"])
        kw["class_names"] = tuple(str(v) for v in kw["class_names"])
        kw["extra"] = tuple(sorted(dict(kw.get("extra") or {}).items()))
        return cls(**kw)


def shard_stem(k: int) -> str:
    return f"shard-{k:05d}"


def _shard_paths(root: str, k: int) -> tuple[str, str, str]:
    base = os.path.join(root, SHARD_DIR, shard_stem(k))
    return base + ".npy", base + ".labels.npy", base + ".json"


def write_plan(root: PathLike, spec: StoreSpec) -> StoreSpec:
    """Create ``plan.json`` or check that an existing one has the same settings.

    Every rank of a data-parallel extraction calls this with the same spec: the first
    writes, the others (and resumed runs) only compare.
    """
    root = os.fspath(root)
    path = os.path.join(root, PLAN_FILE)
    if os.path.exists(path):
        old = load_plan(root)
        if old.to_json() != spec.to_json():
            diff = {k: (v, spec.to_json()[k]) for k, v in old.to_json().items() if spec.to_json().get(k) != v}
            raise StoreError(
                f"{root} already holds a store planned with other settings ({_describe_diff(diff)}). "
                "Resume with the original settings, pick a new output directory, or pass overwrite=True."
            )
        return old
    os.makedirs(os.path.join(root, SHARD_DIR), exist_ok=True)
    write_json(path, {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **spec.to_json()}, indent=1)
    return spec


def _describe_diff(diff: dict[str, tuple[Any, Any]]) -> str:
    parts = []
    for k, (old, new) in diff.items():
        so, sn = repr(old), repr(new)
        if len(so) > 60 or len(sn) > 60:
            parts.append(f"{k} differs")
        else:
            parts.append(f"{k}: store has {so}, asked {sn}")
    return "; ".join(parts)


def load_plan(root: PathLike) -> StoreSpec:
    """Read ``plan.json``."""
    path = os.path.join(os.fspath(root), PLAN_FILE)
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise StoreError(f"{root} has no {PLAN_FILE}: not a latent store (or extraction never started)") from None
    _check_format(d, path)
    return StoreSpec.from_json(d)


def _check_format(d: dict[str, Any], path: str) -> None:
    if d.get("format") != FORMAT_NAME:
        raise StoreError(f"{path} is not a {FORMAT_NAME} file (format={d.get('format')!r})")
    if int(d.get("format_version", -1)) != FORMAT_VERSION:
        raise StoreError(
            f"{path} has format_version {d.get('format_version')}, this code reads version {FORMAT_VERSION}: "
            "re-extract the store or use the matching dit-lightning version"
        )


# --------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_shard(
    root: PathLike,
    k: int,
    spec: StoreSpec,
    data: np.ndarray,
    labels: np.ndarray,
    sources: Sequence[str],
    report: Sequence[dict[str, Any]] = (),
    after_data_hook: Any = None,
) -> dict[str, Any]:
    """Atomically write shard ``k``: data, labels, then its commit record.

    ``data`` is (n, F, K, C, H, W) in the storage dtype (uint16 bits for bfloat16), ``labels``
    (n,), ``sources`` the n input names, ``report`` the skipped/converted inputs of the shard.
    A crash before the commit record is written leaves a shard that does not count and is
    simply rewritten by the next run.
    """
    root = os.fspath(root)
    n = len(labels)
    expected = (n, *spec.sample_shape)
    if tuple(data.shape) != expected:
        raise ValueError(f"shard {k}: data shape {tuple(data.shape)} != expected {expected}")
    if data.dtype != spec.np_dtype:
        raise ValueError(f"shard {k}: data dtype {data.dtype} != storage dtype {spec.np_dtype} ({spec.dtype})")
    if len(sources) != n:
        raise ValueError(f"shard {k}: {len(sources)} sources for {n} samples")
    data_path, labels_path, record_path = _shard_paths(root, k)
    save_npy(data_path, data)
    if after_data_hook is not None:
        after_data_hook()  # test hook: simulate a crash between data and commit record
    save_npy(labels_path, np.asarray(labels, dtype=np.int32))
    record = {
        "shard": k,
        "count": n,
        "items": list(spec.shard_range(k)),
        "data_file": os.path.basename(data_path),
        "data_bytes": os.path.getsize(data_path),
        "data_sha256": _sha256(data_path),
        "labels_file": os.path.basename(labels_path),
        "labels_bytes": os.path.getsize(labels_path),
        "sources": list(sources),
        "report": list(report),
    }
    write_json(record_path, record, indent=1)
    return record


def read_shard_record(root: PathLike, k: int) -> Optional[dict[str, Any]]:
    """The commit record of shard ``k`` if the shard is complete on disk, else None."""
    data_path, labels_path, record_path = _shard_paths(os.fspath(root), k)
    try:
        with open(record_path) as f:
            rec = json.load(f)
        if os.path.getsize(data_path) != rec["data_bytes"] or os.path.getsize(labels_path) != rec["labels_bytes"]:
            return None
    except (OSError, ValueError, KeyError):
        return None
    return rec


def shard_status(root: PathLike, spec: Optional[StoreSpec] = None) -> tuple[list[int], list[int]]:
    """(done, missing) shard ids."""
    spec = spec or load_plan(root)
    done: list[int] = []
    missing: list[int] = []
    for k in range(spec.num_shards):
        (done if read_shard_record(root, k) is not None else missing).append(k)
    return done, missing


def finalize_store(root: PathLike) -> dict[str, Any]:
    """Write labels.npy, sources.txt, report.jsonl and finally meta.json once every shard exists.

    Deterministic: any process may call it, several may race, and a resumed run produces
    byte-identical files, because the content depends only on the shards.
    """
    root = os.fspath(root)
    spec = load_plan(root)
    records: list[dict[str, Any]] = []
    missing = []
    for k in range(spec.num_shards):
        rec = read_shard_record(root, k)
        if rec is None:
            missing.append(k)
        else:
            records.append(rec)
    if missing:
        raise IncompleteStoreError(
            f"{root}: {len(missing)} of {spec.num_shards} shards are missing or incomplete "
            f"(first: {missing[:5]}); rerun the extraction with the same arguments to finish them"
        )
    labels = []
    for k in range(spec.num_shards):
        labels.append(np.load(_shard_paths(root, k)[1]))
    all_labels = np.concatenate(labels).astype(np.int32) if labels else np.zeros(0, np.int32)
    save_npy(os.path.join(root, LABELS_FILE), all_labels)
    write_bytes(os.path.join(root, SOURCES_FILE), "".join(s + "\n" for r in records for s in r["sources"]).encode())
    report = [e for r in records for e in r["report"]]
    write_bytes(os.path.join(root, REPORT_FILE), "".join(json.dumps(e, sort_keys=True) + "\n" for e in report).encode())
    count = int(sum(r["count"] for r in records))
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        **spec.to_json(),
        "count": count,
        "num_classes": len(spec.class_names),
        "num_flips": spec.num_flips,
        "num_moments": spec.num_moments,
        "sample_shape": list(spec.sample_shape),
        "num_skipped": sum(1 for e in report if e.get("status") == "skipped"),
        "num_converted": sum(1 for e in report if e.get("status") == "converted"),
        "shards": [
            {"file": f"{SHARD_DIR}/{r['data_file']}", "count": r["count"], "bytes": r["data_bytes"]} for r in records
        ],
        "labels_file": LABELS_FILE,
        "labels_dtype": "int32",
    }
    write_json(os.path.join(root, META_FILE), meta, indent=1)
    return meta


def is_store(path: PathLike) -> bool:
    """True when ``path`` holds a complete, valid store."""
    try:
        LatentStore(path)
        return True
    except (StoreError, OSError, ValueError):
        return False


def check_compatible(
    spec: StoreSpec,
    latent_shape: Optional[Sequence[int]] = None,
    num_classes: Optional[int] = None,
    where: str = "the store",
) -> None:
    """Raise ValueError naming the mismatch and the fix when a model does not fit the store."""
    problems = []
    if latent_shape is not None and tuple(int(v) for v in latent_shape) != tuple(spec.latent_shape):
        c, h, w = spec.latent_shape
        problems.append(
            f"the model expects latents of shape {tuple(int(v) for v in latent_shape)} but {where} holds "
            f"{tuple(spec.latent_shape)} (image_size {spec.image_size}, VAE {spec.vae}): set the model's "
            f"in_channels={c} and input_size={h}, or extract a store with the matching image size / VAE"
        )
    if num_classes is not None and int(num_classes) != len(spec.class_names):
        problems.append(
            f"the model has num_classes={num_classes} but {where} has {len(spec.class_names)} classes: "
            f"set the model's num_classes={len(spec.class_names)} (or link it to data.num_classes)"
        )
    if problems:
        raise ValueError("; ".join(problems))


# --------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------


def _npy_header(path: str) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    """(shape, dtype, fortran_order, data offset) of a .npy file without reading its data."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        return tuple(shape), dtype, fortran, f.tell()


def _raise_nofile_limit(needed: int) -> None:
    # Each memory map keeps a duplicated file descriptor (CPython mmap): a store with
    # thousands of shards needs more than the common soft limit of 1024.
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = needed + 512
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(hard, want)
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ValueError, OSError):
        pass


class LatentStore:
    """Read-only view of a finalised store, validated up front, memory-mapped lazily.

    Pickling sends only the path and metadata (the maps are reopened in each worker).
    """

    def __init__(self, path: PathLike) -> None:
        self.path = os.fspath(path)
        meta_path = os.path.join(self.path, META_FILE)
        if not os.path.exists(meta_path):
            self._explain_missing_meta()
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except ValueError as e:
            raise StoreError(f"{meta_path} is not valid JSON ({e}); run finalize_store({self.path!r})") from None
        _check_format(meta, meta_path)
        self.meta: dict[str, Any] = meta
        self.spec = StoreSpec.from_json(meta)
        self._sample_shape = self.spec.sample_shape
        shards = meta["shards"]
        counts = np.array([int(s["count"]) for s in shards], dtype=np.int64)
        self._files = [os.path.join(self.path, s["file"]) for s in shards]
        self._counts = counts
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if int(self.offsets[-1]) != int(meta["count"]):
            raise StoreError(
                f"{meta_path}: shard counts add up to {int(self.offsets[-1])}, but count is {meta['count']}; "
                f"the metadata is corrupt: run finalize_store({self.path!r}) again"
            )
        for fname, n in zip(self._files, counts):
            self._validate_shard(fname, int(n))
        labels_path = os.path.join(self.path, meta.get("labels_file", LABELS_FILE))
        try:
            labels = np.load(labels_path)
        except (OSError, ValueError) as e:
            raise StoreError(f"cannot read {labels_path} ({e}); run finalize_store({self.path!r}) again") from None
        if labels.shape != (len(self),):
            raise StoreError(
                f"{labels_path} holds {labels.shape} labels for {len(self)} samples; "
                f"run finalize_store({self.path!r}) again"
            )
        if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise StoreError(f"{labels_path}: labels outside [0, {self.num_classes}); the store is corrupt")
        self.labels: np.ndarray = labels.astype(np.int64)
        self._maps: dict[int, np.ndarray] = {}

    def _explain_missing_meta(self) -> None:
        if not os.path.isdir(self.path):
            raise StoreError(
                f"no latent store at {self.path}: extract one with `dit-lightning extract` "
                "(or use prepare='digits' for the demo store)"
            )
        if os.path.exists(os.path.join(self.path, PLAN_FILE)):
            spec = load_plan(self.path)
            done, missing = shard_status(self.path, spec)
            if missing:
                raise IncompleteStoreError(
                    f"{self.path} is an incomplete store: {len(done)} of {spec.num_shards} shards written. "
                    "Rerun the same `dit-lightning extract` command (on all ranks) to resume it."
                )
            raise IncompleteStoreError(
                f"{self.path}: all shards are written but the store was not finalised; "
                f"run `dit-lightning extract ... --finalize_only true` or finalize_store({self.path!r})"
            )
        raise StoreError(f"{self.path} has no {META_FILE}: not a latent store")

    def _validate_shard(self, fname: str, n: int) -> None:
        fix = (
            f"delete {fname} and its .json/.labels.npy siblings and rerun the extraction to rewrite it "
            f"(the other shards are kept), then finalize"
        )
        if not os.path.exists(fname):
            raise StoreError(f"shard {fname} is missing; {fix}")
        try:
            shape, dtype, fortran, offset = _npy_header(fname)
        except (OSError, ValueError) as e:
            raise StoreError(f"shard {fname} has an unreadable header ({e}); {fix}") from None
        expected = (n, *self._sample_shape)
        if shape != expected:
            raise StoreError(
                f"shard {fname} has shape {shape}, the metadata expects {expected} "
                f"(count, flips, moments, C, H, W); {fix}"
            )
        if dtype != self.spec.np_dtype or fortran:
            raise StoreError(
                f"shard {fname} has dtype {dtype} (fortran={fortran}), expected {self.spec.np_dtype}; {fix}"
            )
        size = os.path.getsize(fname)
        want = offset + int(np.prod(expected)) * dtype.itemsize
        if size != want:
            raise StoreError(f"shard {fname} is truncated or padded: {size} bytes, expected {want}; {fix}")

    # -- metadata ------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return self.spec.latent_shape

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
    def variant(self) -> str:
        return self.spec.variant

    @property
    def flips(self) -> bool:
        return self.spec.flips

    @property
    def num_flips(self) -> int:
        return self.spec.num_flips

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def num_shards(self) -> int:
        return len(self._files)

    def check_compatible(self, latent_shape: Optional[Sequence[int]] = None, num_classes: Optional[int] = None) -> None:
        """Raise ValueError when a model expecting ``latent_shape``/``num_classes`` cannot use this store."""
        check_compatible(self.spec, latent_shape, num_classes, where=self.path)

    # -- reads ---------------------------------------------------------------------

    def _map(self, k: int) -> np.ndarray:
        arr = self._maps.get(k)
        if arr is None:
            if not self._maps:
                _raise_nofile_limit(len(self._files))
            mm = np.load(self._files[k], mmap_mode="r")
            # plain ndarray view: avoids np.memmap's per-slice bookkeeping in the hot loop
            arr = np.asarray(mm).reshape(-1, *self._sample_shape[1:])  # (n*F, K, C, H, W)
            self._maps[k] = arr
        return arr

    def read(
        self,
        indices: Union[np.ndarray, Sequence[int]],
        flip: Union[None, int, np.ndarray] = None,
        out: Optional[np.ndarray] = None,
    ) -> np.ndarray:
        """Raw stored values of ``indices`` in the storage dtype (uint16 bits for bfloat16).

        With ``flip=None`` the result is (B, F, K, C, H, W); with an int or a (B,) array of
        flip ids in [0, F) it is (B, K, C, H, W) and only the chosen flip is read. Rows come
        back in the order of ``indices``; the reads themselves are done in sorted order,
        shard by shard, which is what makes random batches fast on memory maps.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        B = len(idx)
        F = self.num_flips
        if B and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"indices outside [0, {len(self)})")
        if flip is None:
            rows = idx * F
            per = F  # consecutive rows to take per sample
            shape = (B, *self._sample_shape)
        else:
            f = np.broadcast_to(np.asarray(flip, dtype=np.int64), (B,))
            if B and (f.min() < 0 or f.max() >= F):
                raise IndexError(f"flip ids must be in [0, {F})")
            rows = idx * F + f
            per = 1
            shape = (B, *self._sample_shape[1:])
        if out is None:
            out = np.empty(shape, self.spec.np_dtype)
        elif out.shape != shape or out.dtype != self.spec.np_dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous {shape} {self.spec.np_dtype}")
        if B == 0:
            return out
        if np.all(idx[1:] >= idx[:-1]):
            order = None
            srows, sidx = rows, idx
            buf = out
        else:
            order = np.argsort(idx, kind="stable")
            srows, sidx = rows[order], idx[order]
            buf = np.empty_like(out)
        flat = buf.reshape(B * per, *self._sample_shape[1:])
        # shard boundaries within the sorted batch
        bounds = np.searchsorted(sidx, self.offsets)
        nz = np.nonzero(bounds[1:] > bounds[:-1])[0]
        for k in nz:
            a, b = int(bounds[k]), int(bounds[k + 1])
            local = srows[a:b] - self.offsets[k] * F
            if per > 1:
                local = (local[:, None] + np.arange(per)).reshape(-1)
            # mode="clip": bounds were checked above, and "raise" would buffer a second copy
            np.take(self._map(int(k)), local, axis=0, out=flat[a * per : b * per], mode="clip")
        if order is not None:
            out[order] = buf
        return out

    def read_labels(self, indices: Union[np.ndarray, Sequence[int]]) -> np.ndarray:
        """int64 class labels of ``indices``."""
        return self.labels[np.asarray(indices, dtype=np.int64)]

    def __getitem__(self, i: int) -> dict[str, Any]:
        """One sample as float32 numpy: ``values`` (F, K, C, H, W) unscaled, and ``label``."""
        from .rng import to_float32

        raw = self.read(np.array([int(i)]))[0]
        return {"values": to_float32(raw), "label": int(self.labels[int(i)]), "index": int(i)}

    def close(self) -> None:
        """Drop the memory maps (they are reopened on the next read)."""
        self._maps.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = {}
        return state

    def __repr__(self) -> str:
        return (
            f"LatentStore({self.path!r}, n={len(self)}, latent_shape={self.latent_shape}, "
            f"variant={self.variant!r}, dtype={self.dtype!r}, flips={self.flips}, classes={self.num_classes})"
        )


def store_info(path: PathLike) -> dict[str, Any]:
    """Metadata of the store at ``path`` (meta.json) without validating the shards."""
    with open(os.path.join(os.fspath(path), META_FILE)) as f:
        return json.load(f)


def iter_chunks(n: int, size: int) -> Iterable[tuple[int, int]]:
    """[start, stop) ranges of ``size`` covering ``range(n)``."""
    for s in range(0, n, size):
        yield s, min(n, s + size)
