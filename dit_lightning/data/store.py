"""The on-disk latent store: sharded, memory-mapped, written atomically (format: docs/data.md).

Layout of a store directory::

    plan.json                 settings fixed before the first shard is written (StoreSpec)
    shards/shard-00000.npy    (n_k, F, K, C, H, W) float16, or uint16 holding bfloat16 bits
    shards/shard-00000.labels.npy   (n_k,) int32 class labels
    shards/shard-00000.json   commit record of the shard: written last, so its presence
                              (with matching file sizes) is what makes the shard count
    NAME.json                 (optional) a named feature set the store holds (FeatureSpec): what
                              made it (the caller's record) and its shape
    shards/shard-00000.NAME.npy     (optional) (n_k, F, T, D) float16 features of each sample and
                              flip, committed by the NAME entry of the shard's commit record
    labels.npy, sources.txt, report.jsonl   written by finalize_store()
    meta.json                 written last by finalize_store(); a store without it is incomplete

``F`` is 2 with flips (index 0: the image, 1: its horizontal flip) and 1 without;
``K`` is 2 for the "moments" variant (0: posterior mean, 1: log-variance) and 1 for "sample".
Values are stored raw (the VAE's own latents); readers apply the store's latent transform
(``latent_transform``, :mod:`dit_lightning.latents`; a store without one: ``scale_factor``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Optional, Union

import numpy as np

from ..atomic import make_directory, save_npy, write_bytes, write_json
from ..hashing import file_sha256
from ..latents import ChannelMoments, LatentTransform, legacy_transform, stats_indices

FORMAT_NAME = "dit-lightning-latent-store"
FORMAT_VERSION = 2  # the newest version written; readers take every one of READ_VERSIONS
# Version 2 marks a store whose latents are not ``raw x scale_factor`` (per-channel statistics, or a
# shift): readers of version 1 ignore the latent_transform record and would misread them, so they
# refuse it. Every other store (a plain scale, pixels) is still written as version 1, as before.
READ_VERSIONS = (1, 2)
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
# Feature arrays are always float16: half the bytes of float32, and features of O(1..10) lie far
# inside its range.
FEATURES_NP_DTYPE = np.dtype("<f2")


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
    # the latent transform's record (dit_lightning.latents); None: a store from before it (read by
    # vae / scale_factor). In plan.json a channel_stats plan has no statistics; meta.json has them.
    latent_transform: Optional[Mapping[str, Any]] = dataclasses.field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.dtype not in _NP_DTYPES:
            raise ValueError(f"storage dtype must be 'float16' or 'bfloat16', got {self.dtype!r}")
        if self.variant not in ("moments", "sample"):
            raise ValueError(f"variant must be 'moments' or 'sample', got {self.variant!r}")
        if len(self.latent_shape) != 3 or min(self.latent_shape) < 1:
            raise ValueError(f"latent_shape must be (C, H, W) with positive sizes, got {self.latent_shape}")
        if self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {self.shard_size}")
        if self.latent_transform is not None:
            object.__setattr__(self, "latent_transform", LatentTransform.from_record(self.latent_transform).record())

    @property
    def transform(self) -> LatentTransform:
        """The latent transform readers apply (a store without a record: ``pixels`` for a pixel store,
        else ``scale`` with its ``scale_factor``)."""
        if self.latent_transform is not None:
            return LatentTransform.from_record(self.latent_transform)
        return legacy_transform(self.vae, self.scale_factor)

    @property
    def format_version(self) -> int:
        """The store format version this spec is written with: 2 when the latents are not the VAE's
        ``x scale_factor`` (``channel_stats``, or a ``scale`` with a shift), which a reader of
        version 1 would misread; else 1, byte for byte the files such readers read right."""
        t = self.transform
        return 2 if t.kind == "channel_stats" or (t.kind == "scale" and t.shift) else 1

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
        if self.latent_transform is None:
            del d["latent_transform"]  # a store from before transforms were recorded reads the same
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StoreSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["latent_shape"] = tuple(int(v) for v in kw["latent_shape"])
        kw["class_names"] = tuple(str(v) for v in kw["class_names"])
        kw["extra"] = tuple(sorted(dict(kw.get("extra") or {}).items()))
        return cls(**kw)


# --------------------------------------------------------------------------------------
# Feature sets: named per-shard arrays beside the data, opaque to the store
# --------------------------------------------------------------------------------------

_FEATURE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# Names a feature set cannot take: they would collide with the store's own files or with the keys
# of meta.json and of a shard's commit record, where each set has an entry under its name.
_RESERVED_NAMES = frozenset(
    {"labels", "plan", "meta", "sources", "report", "format", "format_version", "count", "num_classes"}
    | {"num_flips", "num_moments", "sample_shape", "num_skipped", "num_converted", "shards", "labels_file"}
    | {"labels_dtype", "shard", "items", "data_file", "data_bytes", "data_sha256", "labels_bytes"}
    | {f.name for f in dataclasses.fields(StoreSpec)}
)
_FEATURE_FIELDS = ("tokens", "dim", "dtype", "key")


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """A named set of per-shard feature arrays a store holds beside its data: float16
    ``(n_k, F, tokens, dim)`` per shard, one ``tokens x dim`` row per sample and flip (flip 1: of
    the mirrored sample).

    The store keeps them without knowing what they are. ``source`` is the caller's record of what
    made them, written as given and never interpreted here; ``key`` a short hash the caller computes
    of everything that makes two sets interchangeable: each shard's commit record carries it, so a
    file written with other settings never counts. Saved as ``NAME.json`` (the ``source`` fields,
    ``tokens``, ``dim``, ``dtype``, ``key``) and repeated as ``meta.json``'s ``NAME`` entry once every
    shard has its file.
    """

    name: str
    source: Mapping[str, Any]
    tokens: int
    dim: int
    key: str
    dtype: str = "float16"

    def __post_init__(self) -> None:
        if not _FEATURE_NAME.match(self.name) or self.name in _RESERVED_NAMES:
            raise ValueError(
                f"feature set name {self.name!r}: use lower-case letters, digits and '_' (a letter first), and "
                f"none of the store's own names ({', '.join(sorted(_RESERVED_NAMES))})"
            )
        clash = sorted(set(_FEATURE_FIELDS) & set(self.source))
        if clash:
            raise ValueError(f"feature set {self.name!r}: its source may not hold the store's fields {clash}")
        if self.tokens < 1 or self.dim < 1:
            raise ValueError(
                f"feature set {self.name!r}: tokens and dim must be positive, got {self.tokens}x{self.dim}"
            )
        if self.dtype != "float16" or not self.key:
            raise ValueError(f"feature set {self.name!r}: dtype must be 'float16' and key set (got {self.dtype!r})")
        object.__setattr__(self, "source", dict(self.source))

    @property
    def plan_file(self) -> str:
        """Its record in the store's directory: ``NAME.json``."""
        return f"{self.name}.json"

    def describe(self) -> str:
        """The source in words, long values cut: what made the features."""
        parts = []
        for k, v in self.source.items():
            text = str(v)
            parts.append(f"{k} {text[:12] + '...' if len(text) > 40 else text}")
        return ", ".join(parts) or "no source recorded"

    def to_json(self) -> dict[str, Any]:
        return {**self.source, "tokens": self.tokens, "dim": self.dim, "dtype": self.dtype, "key": self.key}

    @classmethod
    def from_json(cls, name: str, d: Mapping[str, Any]) -> FeatureSpec:
        source = {k: v for k, v in d.items() if k not in _FEATURE_FIELDS}
        return cls(name, source, int(d["tokens"]), int(d["dim"]), str(d["key"]), str(d.get("dtype", "float16")))


# The caller's remedy for a broken file of a feature set, after "delete FILE and ": e.g. the command
# that computes it again. Called with the store's path, its settings and the feature set.
FeaturesFix = Callable[[str, StoreSpec, FeatureSpec], str]


def _features_fix(
    fixes: Mapping[str, FeaturesFix], root: str, spec: StoreSpec, features: FeatureSpec, fname: str
) -> str:
    fix = fixes.get(features.name)
    if fix is not None:
        return f"delete {fname} and {fix(root, spec, features)}"
    return (
        f"delete {fname} and rerun what computed the store's {features.name} features ({features.describe()}) to "
        "compute it again"
    )


def load_features_plan(root: PathLike, name: str) -> Optional[FeatureSpec]:
    """The feature set ``name`` planned in the store at ``root`` (``NAME.json``), or None."""
    path = os.path.join(os.fspath(root), f"{name}.json")
    fix = f"delete it and the shards/*.{name}.npy files, and compute the features again"
    try:
        d = read_json_file(path, fix)
    except FileNotFoundError:
        return None
    try:
        return FeatureSpec.from_json(name, d)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise StoreError(f"{path} is not a feature set's record ({type(e).__name__}: {e}); {fix}") from None


def write_features_plan(root: PathLike, features: FeatureSpec) -> FeatureSpec:
    """Create ``NAME.json``, or return the one there (the ranks of one extraction race to write it),
    which must have the same key. Whether an existing set was made by the same thing is the caller's
    question, asked before: only it knows what its ``source`` means."""
    root = os.fspath(root)
    old = load_features_plan(root, features.name)
    if old is not None:
        if (old.key, old.tokens, old.dim) != (features.key, features.tokens, features.dim):
            raise StoreError(
                f"{root} already holds {features.name} features of other settings ({features.plan_file}: "
                f"{old.tokens}x{old.dim}, key {old.key}; asked: {features.tokens}x{features.dim}, key "
                f"{features.key}). Features of two settings are never mixed: delete {features.plan_file} and "
                f"shards/*.{features.name}.npy in the store to replace them"
            )
        return old
    make_directory(os.path.join(root, SHARD_DIR))
    write_json(os.path.join(root, features.plan_file), features.to_json(), indent=1)
    return features


def shard_stem(k: int) -> str:
    return f"shard-{k:05d}"


def _shard_paths(root: str, k: int) -> tuple[str, str, str]:
    base = os.path.join(root, SHARD_DIR, shard_stem(k))
    return base + ".npy", base + ".labels.npy", base + ".json"


def data_path(root: PathLike, k: int) -> str:
    """The data file (latents, or pixels) of shard ``k``."""
    return _shard_paths(os.fspath(root), k)[0]


def features_path(root: PathLike, k: int, name: str) -> str:
    """The file of feature set ``name`` of shard ``k``."""
    return os.path.join(os.fspath(root), SHARD_DIR, f"{shard_stem(k)}.{name}.npy")


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
                "Resume with the original settings, choose another --output, or replace it with --overwrite true."
            )
        return old
    make_directory(os.path.join(root, SHARD_DIR))
    write_json(path, {"format": FORMAT_NAME, "format_version": spec.format_version, **spec.to_json()}, indent=1)
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


def read_json_file(path: str, fix: str) -> Any:
    """A JSON file of a store; a truncated or corrupt one raises :class:`StoreError` naming the
    file and ``fix`` (a missing one raises ``FileNotFoundError``)."""
    try:
        with open(path) as f:
            return json.load(f)
    except UnicodeDecodeError as e:
        raise StoreError(f"{path} is not a JSON file ({e}); {fix}") from None
    except json.JSONDecodeError as e:
        size = os.path.getsize(path)
        state = "empty" if size == 0 else f"truncated or corrupt ({e.msg} at line {e.lineno} column {e.colno})"
        raise StoreError(f"{path} is {state}; {fix}") from None


def _refinalize(root: PathLike) -> str:
    return (
        f"write it again from the shards with `dit-lightning extract --output {os.fspath(root)} --finalize_only true`"
    )


def load_plan(root: PathLike) -> StoreSpec:
    """Read ``plan.json``."""
    path = os.path.join(os.fspath(root), PLAN_FILE)
    try:
        d = read_json_file(path, "delete the store directory and extract it again")
    except FileNotFoundError:
        raise StoreError(f"{root} has no {PLAN_FILE}: not a latent store (or extraction never started)") from None
    if not isinstance(d, dict):
        raise StoreError(f"{path} is not a {FORMAT_NAME} file")
    _check_format(d, path)
    return StoreSpec.from_json(d)


def _check_format(d: dict[str, Any], path: str) -> None:
    if d.get("format") != FORMAT_NAME:
        raise StoreError(f"{path} is not a {FORMAT_NAME} file (format={d.get('format')!r})")
    if d.get("format_version") not in READ_VERSIONS:
        readable = " and ".join(str(v) for v in READ_VERSIONS)
        raise StoreError(
            f"{path} has format_version {d.get('format_version')}, this code reads versions {readable}: "
            "re-extract the store or use the matching dit-lightning version"
        )


# --------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------


def write_shard(
    root: PathLike,
    k: int,
    spec: StoreSpec,
    data: np.ndarray,
    labels: np.ndarray,
    sources: Sequence[str],
    report: Sequence[dict[str, Any]] = (),
    after_data_hook: Any = None,
    features: Sequence[tuple[FeatureSpec, np.ndarray]] = (),
) -> dict[str, Any]:
    """Atomically write shard ``k``: data, labels, feature sets, then its commit record.

    ``data`` is (n, F, K, C, H, W) in the storage dtype (uint16 bits for bfloat16), ``labels``
    (n,), ``sources`` the n input names, ``report`` the skipped/converted inputs of the shard,
    ``features`` (feature set, its (n, F, T, D) float16 values) pairs.
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
        "data_sha256": file_sha256(data_path),
        "labels_file": os.path.basename(labels_path),
        "labels_bytes": os.path.getsize(labels_path),
        "sources": list(sources),
        "report": list(report),
    }
    for fs, values in features:
        record[fs.name] = _save_features(root, k, spec, fs, values, n)
    write_json(record_path, record, indent=1)
    return record


def _save_features(
    root: str, k: int, spec: StoreSpec, features: FeatureSpec, values: np.ndarray, n: int
) -> dict[str, Any]:
    """Write shard ``k``'s file of a feature set; its entry for the commit record."""
    expected = (n, spec.num_flips, features.tokens, features.dim)
    if tuple(values.shape) != expected or values.dtype != FEATURES_NP_DTYPE:
        raise ValueError(
            f"shard {k}: {features.name} features {tuple(values.shape)} {values.dtype}, expected {expected} "
            f"{FEATURES_NP_DTYPE}"
        )
    if n and not np.isfinite(values).all():
        raise StoreError(
            f"shard {k}: the {features.name} features computed for it hold non-finite values (NaN, inf, or beyond "
            f"float16's range), so nothing was written: check what computes them ({features.describe()})"
        )
    path = features_path(root, k, features.name)
    save_npy(path, values)
    return {
        "file": os.path.basename(path),
        "bytes": os.path.getsize(path),
        "sha256": file_sha256(path),
        "key": features.key,
    }


def write_features(
    root: PathLike,
    k: int,
    spec: StoreSpec,
    features: FeatureSpec,
    values: np.ndarray,
    after_data_hook: Any = None,
    also: Sequence[tuple[FeatureSpec, np.ndarray]] = (),
) -> dict[str, Any]:
    """Add a feature set's values to the committed shard ``k``: its file, then the shard's commit
    record rewritten (atomically) with the set's entry. Until that rewrite the file does not count,
    so a kill in between only costs its recomputation. ``also``: more (feature set, values) pairs
    committed by the same rewrite (sets computed together count together)."""
    root = os.fspath(root)
    record = read_shard_record(root, k)
    if record is None:
        raise IncompleteStoreError(f"shard {k} of {root} is not written: features are added to committed shards only")
    n = int(record["count"])
    entries = {fs.name: _save_features(root, k, spec, fs, v, n) for fs, v in [(features, values), *also]}
    if after_data_hook is not None:
        after_data_hook()  # test hook: simulate a crash between the features and the commit record
    record = {**record, **entries}
    write_json(_shard_paths(root, k)[2], record, indent=1)
    return record


def _entry(record: Optional[Mapping[str, Any]], name: str) -> dict[str, Any]:
    """A commit record's entry of feature set ``name``, {} when it has none."""
    entry = (record or {}).get(name)
    return entry if isinstance(entry, dict) else {}


def _features_done(root: str, record: Optional[dict[str, Any]], features: FeatureSpec) -> bool:
    """Whether a commit record commits a file of ``features`` (its key) that is on disk whole."""
    entry = _entry(record, features.name)
    if entry.get("key") != features.key:
        return False
    try:
        return os.path.getsize(os.path.join(root, SHARD_DIR, str(entry["file"]))) == int(entry["bytes"])
    except (OSError, KeyError, TypeError, ValueError):
        return False


def features_status(
    root: PathLike, features: FeatureSpec, spec: Optional[StoreSpec] = None
) -> tuple[list[int], list[int]]:
    """(done, missing) shard ids for the feature set ``features``, among the committed shards."""
    root = os.fspath(root)
    spec = spec or load_plan(root)
    done: list[int] = []
    missing: list[int] = []
    for k in range(spec.num_shards):
        rec = read_shard_record(root, k)
        if rec is not None:
            (done if _features_done(root, rec, features) else missing).append(k)
    return done, missing


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
        shard_labels = np.load(_shard_paths(root, k)[1])
        if len(shard_labels) and (shard_labels.min() < 0 or shard_labels.max() >= len(spec.class_names)):
            files = ", ".join(os.path.basename(f) for f in _shard_paths(root, k))
            raise StoreError(
                f"shard {k} of {root} holds labels outside the store's {len(spec.class_names)} classes: it is corrupt; "
                f"delete its files ({files} in {os.path.join(root, SHARD_DIR)}) and rerun the same "
                "`dit-lightning extract` command to rewrite it"
            )
        labels.append(shard_labels)
    all_labels = np.concatenate(labels).astype(np.int32) if labels else np.zeros(0, np.int32)
    save_npy(os.path.join(root, LABELS_FILE), all_labels)
    write_bytes(os.path.join(root, SOURCES_FILE), "".join(s + "\n" for r in records for s in r["sources"]).encode())
    report = [e for r in records for e in r["report"]]
    write_bytes(os.path.join(root, REPORT_FILE), "".join(json.dumps(e, sort_keys=True) + "\n" for e in report).encode())
    count = int(sum(r["count"] for r in records))
    # A feature set counts only when every shard has it (a features pass still running, or killed,
    # leaves the store as it was: usable, without that set). Its name is the key of its entries.
    complete: list[FeatureSpec] = []
    for name in sorted({n for r in records for n, e in r.items() if isinstance(e, dict) and "key" in e}):
        features = load_features_plan(root, name)
        if features is not None and all(_features_done(root, r, features) for r in records):
            complete.append(features)
    meta = {
        "format": FORMAT_NAME,
        "format_version": spec.format_version,
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
    if not spec.transform.measured:
        # measured from the committed shards, before the index exists: an incomplete store has none
        meta["latent_transform"] = measure_transform(root, spec, records).record()
    for features in complete:
        meta[features.name] = features.to_json()
        for entry, r in zip(meta["shards"], records):
            entry[f"{features.name}_file"] = f"{SHARD_DIR}/{r[features.name]['file']}"
            entry[f"{features.name}_bytes"] = r[features.name]["bytes"]
    write_json(os.path.join(root, META_FILE), meta, indent=1)
    return meta


def measure_transform(root: PathLike, spec: StoreSpec, records: Sequence[Mapping[str, Any]]) -> LatentTransform:
    """The planned ``channel_stats`` transform of a store with its statistics measured over the
    committed shards by LightningDiT's rule (:func:`~dit_lightning.latents.stats_indices`: every
    sample up to 10,000, else a seeded 10,000; unbiased std), on the unflipped posterior means (the
    stored sample of a ``sample`` store): deterministic, so a resumed or refinalised store gets the
    same numbers."""
    import torch

    from .rng import to_float32

    root = os.fspath(root)
    counts = [int(r["count"]) for r in records]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    chosen = np.asarray(stats_indices(int(offsets[-1])), dtype=np.int64)
    if len(chosen) < 1:
        raise StoreError(f"{root}: no sample to measure the latents' channel statistics on")
    moments = ChannelMoments()
    for k in range(len(records)):
        rows = chosen[(chosen >= offsets[k]) & (chosen < offsets[k + 1])] - offsets[k]
        if not len(rows):
            continue
        data = np.load(data_path(root, k), mmap_mode="r")
        for start in range(0, len(rows), 1024):
            part = np.ascontiguousarray(data[rows[start : start + 1024], 0, 0])
            moments.update(torch.from_numpy(to_float32(part)))  # bfloat16 bits (uint16) too
        del data
    mean, std = moments.result()
    planned = spec.transform
    return LatentTransform.channel_stats(mean, std, planned.multiplier, samples=len(chosen))


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

    ``fixes``: by feature set name, the caller's remedy for a broken file of that set (what computes
    it again), which the messages of :meth:`verify` and of opening give; without one they name what
    the set's record says made it.
    """

    def __init__(self, path: PathLike, fixes: Optional[Mapping[str, FeaturesFix]] = None) -> None:
        self.path = os.fspath(path)
        self._fixes: dict[str, FeaturesFix] = dict(fixes or {})
        meta_path = os.path.join(self.path, META_FILE)
        if not os.path.exists(meta_path):
            self._explain_missing_meta()
        meta = read_json_file(meta_path, _refinalize(self.path))
        if not isinstance(meta, dict):
            raise StoreError(f"{meta_path} is not a {FORMAT_NAME} index; {_refinalize(self.path)}")
        _check_format(meta, meta_path)
        self.meta: dict[str, Any] = meta
        try:
            self.spec = StoreSpec.from_json(meta)
            shards = meta["shards"]
            counts = np.array([int(s["count"]) for s in shards], dtype=np.int64)
            self._files = [os.path.join(self.path, s["file"]) for s in shards]
            # The feature sets every shard has: each shard entry names their files ("NAME_file").
            names = sorted(n[: -len("_file")] for n in (shards[0] if shards else {}) if n.endswith("_file"))
            self.features: dict[str, FeatureSpec] = {n: FeatureSpec.from_json(n, meta[n]) for n in names}
            self._feature_files = {n: [os.path.join(self.path, s[f"{n}_file"]) for s in shards] for n in names}
        except (KeyError, TypeError, ValueError) as e:
            problem = f"{type(e).__name__}: {e}"
            raise StoreError(f"{meta_path} is not a complete index ({problem}); {_refinalize(path)}") from None
        self._sample_shape = self.spec.sample_shape
        self._counts = counts
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if int(self.offsets[-1]) != int(meta["count"]):
            raise StoreError(
                f"{meta_path}: shard counts add up to {int(self.offsets[-1])}, but count is {meta['count']}; "
                f"the metadata is corrupt: {_refinalize(self.path)}"
            )
        for fname, n, entry in zip(self._files, counts, shards):
            self._validate_shard(fname, int(n), entry.get("bytes"))
        for name, features in self.features.items():
            for fname, n, entry in zip(self._feature_files[name], counts, shards):
                expected = (int(n), self.num_flips, features.tokens, features.dim)
                fix = self._features_fix(name, fname)
                what = f"{name} features file"
                _check_npy(
                    fname, what, expected, "(count, flips, T, D)", FEATURES_NP_DTYPE, entry.get(f"{name}_bytes"), fix
                )
        labels_path = os.path.join(self.path, meta.get("labels_file", LABELS_FILE))
        try:
            labels = np.load(labels_path)
        except (OSError, ValueError) as e:
            raise StoreError(f"cannot read {labels_path} ({e}); {_refinalize(self.path)}") from None
        if labels.shape != (len(self),):
            raise StoreError(
                f"{labels_path} holds {labels.shape} labels for {len(self)} samples; {_refinalize(self.path)}"
            )
        bad = np.flatnonzero((labels < 0) | (labels >= self.num_classes)) if len(labels) else labels[:0]
        if len(bad):
            raise StoreError(
                f"{labels_path} holds {len(bad)} labels outside the store's {self.num_classes} classes (sample "
                f"{int(bad[0])}: label {int(labels[bad[0]])}): the file is corrupt; {_refinalize(self.path)}"
            )
        self.labels: np.ndarray = labels.astype(np.int64)
        self._maps: dict[int, np.ndarray] = {}
        self._feature_maps: dict[str, dict[int, np.ndarray]] = {n: {} for n in self.features}

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
                f"{self.path}: all shards are written but the store was not finalised; {_refinalize(self.path)}"
            )
        raise StoreError(f"{self.path} has no {META_FILE}: not a latent store")

    @staticmethod
    def _shard_fix(fname: str) -> str:
        return (
            f"delete {fname} and its .json/.labels.npy siblings and rerun the extraction to rewrite it "
            f"(the other shards are kept), then finalize"
        )

    def _validate_shard(self, fname: str, n: int, recorded_bytes: Optional[int] = None) -> None:
        fix = self._shard_fix(fname)
        expected = (n, *self._sample_shape)
        _check_npy(
            fname, "shard", expected, "(count, flips, moments, C, H, W)", self.spec.np_dtype, recorded_bytes, fix
        )

    def _features_fix(self, name: str, fname: str) -> str:
        return _features_fix(self._fixes, self.path, self.spec, self.features[name], fname)

    def shard_record(self, k: int) -> dict[str, Any]:
        """The commit record (``shards/shard-KKKKK.json``) of shard ``k``: checksums, sources, report."""
        path = os.path.splitext(self._files[k])[0] + ".json"
        fix = self._shard_fix(self._files[k])
        try:
            record = read_json_file(path, fix)
        except FileNotFoundError:
            raise StoreError(
                f"{path}, the commit record of shard {k}, is missing: the shard is not committed; {fix}"
            ) from None
        if not isinstance(record, dict):
            raise StoreError(f"{path} is not a commit record; {fix}")
        return record

    def _record_problems(self, k: int) -> tuple[dict[str, Any], list[str]]:
        """Shard ``k``'s commit record ({} when unreadable) and what in it disagrees with the index."""
        fname = self._files[k]
        try:
            record = self.shard_record(k)
        except StoreError as e:
            return {}, [str(e)]
        problems = []
        n, size = int(self._counts[k]), os.path.getsize(fname)
        if record.get("count") != n or record.get("data_bytes") != size:
            problems.append(
                f"the commit record of shard {k} records {record.get('count')} samples in {record.get('data_bytes')} "
                f"bytes, the index and {fname} {n} in {size}: it does not commit that file; {self._shard_fix(fname)}"
            )
        for name, features in self.features.items():
            entry = _entry(record, name)
            ffile = self._feature_files[name][k]
            if entry.get("key") != features.key or entry.get("bytes") != os.path.getsize(ffile):
                problems.append(
                    f"{name} features file {ffile}: the commit record of shard {k} does not commit it (key "
                    f"{entry.get('key')}, {entry.get('bytes')} bytes; the index: key {features.key}, the file "
                    f"{os.path.getsize(ffile)} bytes); {self._features_fix(name, ffile)}"
                )
        return record, problems

    def check_records(self, shards: Optional[Iterable[int]] = None) -> list[str]:
        """What in the commit records of ``shards`` (default all) disagrees with the index: a record
        missing or unreadable, another count or size of the data, a feature set's file not committed
        (another key or size). Cheap: reads the records, not the data; :meth:`verify` includes it."""
        return [p for k in (range(self.num_shards) if shards is None else shards) for p in self._record_problems(k)[1]]

    def verify(self, checksums: bool = True, values: bool = True, shards: Optional[Iterable[int]] = None) -> list[str]:
        """Problems of the shards ``shards`` (default all) beyond what opening checks (sizes):
        commit records that disagree with the index (:meth:`check_records`), data that changed since
        it was written (sha256 against the commit record, with ``checksums``) and non-finite values
        (NaN / inf, with ``values``), of the data and of every feature set. Reads the data once."""
        problems: list[str] = []
        for k in range(self.num_shards) if shards is None else shards:
            fname = self._files[k]
            fix = self._shard_fix(fname)
            record, found = self._record_problems(k)
            problems += found
            problem = _check_file(fname, "shard", record.get("data_sha256") if checksums else None, fix)
            if problem is None and values:
                problem = _nonfinite_problem(fname, "shard", self._map(k), self.spec.dtype, self.num_flips, fix)
            if problem:
                problems.append(problem)
            for name, features in self.features.items():
                ffile, what = self._feature_files[name][k], f"{name} features file"
                ffix = self._features_fix(name, ffile)
                entry = _entry(record, name)
                if record and entry.get("key") != features.key:
                    continue  # said above: the record does not commit this file, so its checksum is not known
                problem = _check_file(ffile, what, entry.get("sha256") if checksums else None, ffix)
                if problem is None and values:
                    problem = _nonfinite_problem(
                        ffile, what, self._feature_map(name, k), "float16", self.num_flips, ffix
                    )
                if problem:
                    problems.append(problem)
        return problems

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
    def transform(self) -> LatentTransform:
        """The latent transform its readers apply (raw latents -> the model's)."""
        return self.spec.transform

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

    def _first_map(self) -> None:
        if not self._maps and not any(self._feature_maps.values()):
            _raise_nofile_limit(len(self._files) * (1 + len(self.features)))

    def _map(self, k: int) -> np.ndarray:
        arr = self._maps.get(k)
        if arr is None:
            self._first_map()
            mm = np.load(self._files[k], mmap_mode="r")
            # plain ndarray view: avoids np.memmap's per-slice bookkeeping in the hot loop
            arr = np.asarray(mm).reshape(-1, *self._sample_shape[1:])  # (n*F, K, C, H, W)
            self._maps[k] = arr
        return arr

    def _feature_map(self, name: str, k: int) -> np.ndarray:
        maps = self._feature_maps[name]
        arr = maps.get(k)
        if arr is None:
            self._first_map()
            features = self.features[name]
            arr = np.asarray(np.load(self._feature_files[name][k], mmap_mode="r"))
            maps[k] = arr = arr.reshape(-1, features.tokens, features.dim)  # (n*F, T, D)
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
        return self._gather(self._map, self._sample_shape[1:], self.spec.np_dtype, indices, flip, out)

    def read_features(
        self,
        name: str,
        indices: Union[np.ndarray, Sequence[int]],
        flip: Union[None, int, np.ndarray] = None,
        out: Optional[np.ndarray] = None,
    ) -> np.ndarray:
        """Feature set ``name`` of ``indices``, float16: (B, F, T, D) with ``flip=None``, (B, T, D) for
        one flip per sample (an int or a (B,) array), read like :meth:`read`. Flip 1 holds the
        features of the mirrored sample (the one flip 1 of :meth:`read` holds)."""
        features = self.features.get(name)
        if features is None:
            raise StoreError(
                f"{self.path} holds no {name} features (its index lists {sorted(self.features) or 'none'}): "
                "compute them into the store first (a set counts once every shard has it)"
            )
        rows = (features.tokens, features.dim)
        return self._gather(lambda k: self._feature_map(name, k), rows, FEATURES_NP_DTYPE, indices, flip, out)

    def _gather(
        self,
        rows_of: Callable[[int], np.ndarray],
        row_shape: tuple[int, ...],
        dtype: np.dtype,
        indices: Union[np.ndarray, Sequence[int]],
        flip: Union[None, int, np.ndarray],
        out: Optional[np.ndarray],
    ) -> np.ndarray:
        """Rows of ``indices`` (and flips) from per-shard arrays ``rows_of(k)`` of (n*F, *row_shape)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        B = len(idx)
        F = self.num_flips
        if B and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"indices outside [0, {len(self)})")
        if flip is None:
            rows = idx * F
            per = F  # consecutive rows to take per sample
            shape: tuple[int, ...] = (B, F, *row_shape)
        else:
            f = np.broadcast_to(np.asarray(flip, dtype=np.int64), (B,))
            if B and (f.min() < 0 or f.max() >= F):
                raise IndexError(f"flip ids must be in [0, {F})")
            rows = idx * F + f
            per = 1
            shape = (B, *row_shape)
        if out is None:
            out = np.empty(shape, dtype)
        elif out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous {shape} {dtype}")
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
        flat = buf.reshape(B * per, *row_shape)
        # shard boundaries within the sorted batch
        bounds = np.searchsorted(sidx, self.offsets)
        nz = np.nonzero(bounds[1:] > bounds[:-1])[0]
        for k in nz:
            a, b = int(bounds[k]), int(bounds[k + 1])
            local = srows[a:b] - self.offsets[k] * F
            if per > 1:
                local = (local[:, None] + np.arange(per)).reshape(-1)
            # mode="clip": bounds were checked above, and "raise" would buffer a second copy
            np.take(rows_of(int(k)), local, axis=0, out=flat[a * per : b * per], mode="clip")
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
        for maps in self._feature_maps.values():
            maps.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = {}
        state["_feature_maps"] = {n: {} for n in self.features}
        return state

    def __repr__(self) -> str:
        return (
            f"LatentStore({self.path!r}, n={len(self)}, latent_shape={self.latent_shape}, "
            f"variant={self.variant!r}, dtype={self.dtype!r}, flips={self.flips}, classes={self.num_classes}"
            + "".join(f", {n}={f.tokens}x{f.dim}" for n, f in self.features.items())
            + ")"
        )


def _check_npy(
    fname: str,
    what: str,
    expected: tuple[int, ...],
    axes: str,
    dtype: np.dtype,
    recorded_bytes: Optional[int],
    fix: str,
) -> None:
    """Raise :class:`StoreError` unless ``fname`` is a whole C-order .npy of ``expected`` ``dtype``."""
    if not os.path.exists(fname):
        raise StoreError(f"{what} {fname} is missing; {fix}")
    try:
        shape, got, fortran, offset = _npy_header(fname)
    except (OSError, ValueError) as e:
        raise StoreError(f"{what} {fname} has an unreadable header ({e}); {fix}") from None
    if shape != expected:
        raise StoreError(f"{what} {fname} has shape {shape}, the metadata expects {expected} {axes}; {fix}")
    if got != dtype or fortran:
        raise StoreError(f"{what} {fname} has dtype {got} (fortran={fortran}), expected {dtype}; {fix}")
    size = os.path.getsize(fname)
    want = offset + int(np.prod(expected)) * got.itemsize
    if size != want:
        raise StoreError(f"{what} {fname} is truncated or padded: {size} bytes, expected {want}; {fix}")
    if recorded_bytes is not None and int(recorded_bytes) != size:
        raise StoreError(f"{what} {fname} has {size} bytes, the index records {recorded_bytes}; {fix}")


def _check_file(fname: str, what: str, want_sha256: Optional[str], fix: str) -> Optional[str]:
    """The problem of a file whose sha256 is not the one its commit record took, or None."""
    if not want_sha256:
        return None
    got = file_sha256(fname)
    if got == want_sha256:
        return None
    return (
        f"{what} {fname} changed since it was written (sha256 {got[:12]}..., the commit record has "
        f"{want_sha256[:12]}...): corrupted on disk or edited; {fix}"
    )


def _nonfinite_problem(fname: str, what: str, rows: np.ndarray, dtype: str, flips: int, fix: str) -> Optional[str]:
    bad = _nonfinite(rows, dtype)
    if not bad:
        return None
    count, first = bad
    return (
        f"{what} {fname} holds {count} non-finite values (NaN or inf; the first in its sample {first // flips}): "
        f"training on it gives a NaN loss; {fix}"
    )


def _nonfinite(rows: np.ndarray, dtype: str, chunk: int = 4096) -> Optional[tuple[int, int]]:
    """(count, first row) of the non-finite values of stored rows (n, ...), or None."""
    count, first = 0, -1
    for a in range(0, len(rows), chunk):
        block = np.asarray(rows[a : a + chunk])
        if dtype == "bfloat16":  # the uint16 bits of bfloat16: exponent all ones is inf or NaN
            bad = (block & np.uint16(0x7F80)) == np.uint16(0x7F80)
        else:
            bad = ~np.isfinite(block)
        n = int(bad.sum())
        if n:
            count += n
            if first < 0:
                first = a + int(np.nonzero(bad.reshape(len(block), -1).any(axis=1))[0][0])
    return (count, first) if count else None


def verify_store(
    path: PathLike, checksums: bool = True, values: bool = True, fixes: Optional[Mapping[str, FeaturesFix]] = None
) -> list[str]:
    """Everything wrong with the store at ``path``: what opening it finds (missing, truncated or
    resized files, a corrupt index), then the commit records, checksums and non-finite values (see
    :meth:`LatentStore.verify`; ``fixes`` as there). An empty list: the store is as it was written."""
    try:
        store = LatentStore(path, fixes)
    except StoreError as e:
        return [str(e)]
    return store.verify(checksums=checksums, values=values)


def store_info(path: PathLike) -> dict[str, Any]:
    """Metadata of the store at ``path`` (meta.json) without validating the shards."""
    return read_json_file(os.path.join(os.fspath(path), META_FILE), _refinalize(path))


# Names a store directory may hold: its files, the shards directory, and temporaries of atomic writes.
_STORE_FILES = {META_FILE, PLAN_FILE, LABELS_FILE, SOURCES_FILE, REPORT_FILE}
_SHARD_FILE = re.compile(r"^shard-\d{5,}(\.npy|\.json|\.[a-z][a-z0-9_]*\.npy)$")  # .labels.npy, .NAME.npy
_TEMPORARY = re.compile(r"^\..+\.tmp$")


def _is_features_record(root: str, name: str) -> bool:
    """Whether ``root/name`` is a feature set's record (``NAME.json``): a readable one, or a damaged
    one whose shard files are there."""
    stem, ext = os.path.splitext(name)
    if ext != ".json" or not _FEATURE_NAME.match(stem) or stem in _RESERVED_NAMES:
        return False
    try:
        return load_features_plan(root, stem) is not None
    except StoreError:
        shard_dir = os.path.join(root, SHARD_DIR)
        return os.path.isdir(shard_dir) and any(n.endswith(f".{stem}.npy") for n in os.listdir(shard_dir))


def foreign_entries(root: PathLike) -> list[str]:
    """The entries of directory ``root`` that a latent store does not have (besides temporaries)."""
    root = os.fspath(root)
    foreign = []
    for name in sorted(os.listdir(root)):
        full = os.path.join(root, name)
        if name == SHARD_DIR and os.path.isdir(full) and not os.path.islink(full):
            foreign += [
                os.path.join(SHARD_DIR, n)
                for n in sorted(os.listdir(full))
                if not (_SHARD_FILE.match(n) or _TEMPORARY.match(n)) or not os.path.isfile(os.path.join(full, n))
            ]
        elif not (
            (name in _STORE_FILES or _TEMPORARY.match(name) or _is_features_record(root, name)) and os.path.isfile(full)
        ):
            foreign.append(name)
    return foreign


def check_removable_store(root: PathLike, option: str = "--output") -> None:
    """Raise :class:`StoreError` unless ``root`` is provably a store this project wrote (its
    ``plan.json`` or ``meta.json`` says so) holding nothing but a store's files: the only
    directories ``overwrite`` may delete."""
    root = os.path.abspath(os.fspath(root))
    if not os.path.isdir(root) or os.path.islink(root):
        raise StoreError(f"{option} {root} is not a directory; nothing was deleted")
    markers = [os.path.join(root, n) for n in (PLAN_FILE, META_FILE)]
    marker = next((m for m in markers if os.path.isfile(m)), None)
    formatted = False
    if marker is not None:
        try:
            with open(marker) as f:
                formatted = json.load(f).get("format") == FORMAT_NAME
        except (OSError, ValueError, AttributeError):
            formatted = False
    if not formatted:
        raise StoreError(
            f"{option} {root} exists and is not a latent store ({PLAN_FILE} / {META_FILE} of {FORMAT_NAME} "
            "missing): overwrite only ever replaces a store this tool wrote. Nothing was deleted; choose another "
            f"{option} or empty the directory yourself"
        )
    foreign = foreign_entries(root)
    if foreign:
        listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise StoreError(
            f"{option} {root} is a latent store but also holds other files ({listed}): overwrite would delete them. "
            f"Nothing was deleted; move them out, or choose another {option}"
        )


def remove_store(root: PathLike, option: str = "--output") -> None:
    """Delete the store at ``root`` (after :func:`check_removable_store`): its files one by one,
    then the emptied directories; never anything else."""
    check_removable_store(root, option)
    root = os.path.abspath(os.fspath(root))
    meta = os.path.join(root, META_FILE)
    if os.path.exists(meta):  # the index first: never a store that looks complete with parts missing
        os.unlink(meta)
    shard_dir = os.path.join(root, SHARD_DIR)
    if os.path.isdir(shard_dir):
        for name in os.listdir(shard_dir):
            os.unlink(os.path.join(shard_dir, name))
        os.rmdir(shard_dir)
    for name in os.listdir(root):
        os.unlink(os.path.join(root, name))
    os.rmdir(root)


def contains(parent: PathLike, child: PathLike) -> bool:
    """True when ``child`` is ``parent`` or lies inside it (symbolic links resolved)."""
    p, c = os.path.realpath(os.fspath(parent)), os.path.realpath(os.fspath(child))
    return c == p or c.startswith(p.rstrip(os.sep) + os.sep)


def iter_chunks(n: int, size: int) -> Iterable[tuple[int, int]]:
    """[start, stop) ranges of ``size`` covering ``range(n)``."""
    for s in range(0, n, size):
        yield s, min(n, s + size)
