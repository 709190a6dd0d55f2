"""FID, IS and KID of generated samples (IS / KID through torchmetrics), offline-capable and cached.

Features come from one extractor pass per batch: the InceptionV3 of torchmetrics (torch-fidelity's
port of the TF 2015-12-05 graph, the network of published FIDs) loaded from a local weights
file, or any ``nn.Module`` mapping uint8 (N, 3, H, W) images to (N, D) features (tests, and
offline feature spaces). ``antialias=False`` keeps torchmetrics' TF1-compatible bilinear
resize, which is what makes numbers comparable with published FIDs.

Reference statistics (mean and covariance of the real features) are computed once per
(source, extractor) and cached as an ``.npz`` with ``mu`` / ``sigma`` -- the same keys as the
ADM reference batches (``VIRTUAL_imagenet256_labeled.npz``), which can be given directly.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import warnings
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..atomic import save_npz
from ..hashing import file_sha256

# What torchmetrics (through torch-fidelity) loads; the same converted TF weights are also
# published by pytorch-fid as pt_inception-2015-12-05-6726825d.pth (same state-dict keys).
INCEPTION_WEIGHTS_FILE = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_WEIGHTS_URL = (
    "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/weights-inception-2015-12-05-6726825d.pth"
)
PYTORCH_FID_WEIGHTS_FILE = "pt_inception-2015-12-05-6726825d.pth"
PYTORCH_FID_WEIGHTS_URL = (
    "https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/pt_inception-2015-12-05-6726825d.pth"
)
INCEPTION_ENV = "DIT_INCEPTION_WEIGHTS"
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_INCEPTION_SIZE = 299  # InceptionV3's input side
ASSUMED_REFERENCE_COUNT = 50_000  # for mu/sigma files that do not say how many images they summarise

Source = Union[str, os.PathLike]


class InceptionWeightsMissing(FileNotFoundError):
    """The Inception weights are needed but not on disk (and cannot be downloaded here)."""


def _hub_checkpoint_dir() -> Path:
    return Path(torch.hub.get_dir()) / "checkpoints"


def find_inception_weights(path: Optional[str] = None) -> str:
    """The InceptionV3 weights file: ``path``, ``$DIT_INCEPTION_WEIGHTS``, or torch hub's cache."""
    candidates = [path] if path else []
    if not path and os.environ.get(INCEPTION_ENV):
        candidates.append(os.environ[INCEPTION_ENV])
    if not path:
        candidates += [str(_hub_checkpoint_dir() / n) for n in (INCEPTION_WEIGHTS_FILE, PYTORCH_FID_WEIGHTS_FILE)]
    for c in candidates:
        if c and os.path.isfile(c):
            return c
    where = (
        f"'{path}' does not exist"
        if path
        else f"none given, ${INCEPTION_ENV} unset, nothing in {_hub_checkpoint_dir()}"
    )
    raise InceptionWeightsMissing(
        f"FID/IS/KID need the InceptionV3 weights file ({where}). On a machine with internet:\n"
        f"    wget {INCEPTION_WEIGHTS_URL}\n"
        f"(torch-fidelity's {INCEPTION_WEIGHTS_FILE}, ~92 MB; pytorch-fid's {PYTORCH_FID_WEIGHTS_FILE} from "
        f"{PYTORCH_FID_WEIGHTS_URL} holds the same weights), copy it here and pass it with "
        f"--inception_weights PATH (Python: inception_weights=PATH; or set {INCEPTION_ENV}=PATH, or put it in "
        f"{_hub_checkpoint_dir()})."
    )


# torch hub's convention: the name of a weights file ends with the first hex digits of its sha256
_HASH_IN_NAME = re.compile(r"-([0-9a-f]{8,64})\.pth?$")
_PUBLISHED_SHA256_PREFIX = "6726825d"  # of the published file, under both of its names


def _inception_layout() -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor of torch-fidelity's InceptionV3 (built on the meta device:
    nothing is allocated, and nothing is loaded into it)."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    class _Layout(FeatureExtractorInceptionV3):
        def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:  # the layout only
            return None

    with tempfile.TemporaryDirectory() as tmp:
        empty = os.path.join(tmp, "empty.pth")
        torch.save({}, empty)  # what the constructor reads: this empty dict, written here
        with torch.device("meta"):
            net = _Layout("inception-v3-compat", ["2048"], empty)
    return {k: tuple(v.shape) for k, v in net.state_dict().items()}


def _fix() -> str:
    return (
        f"download the published file (wget {INCEPTION_WEIGHTS_URL}) and pass it with --inception_weights "
        "(test: --evaluation.inception_weights)"
    )


def load_inception_state_dict(path: str) -> dict[str, Tensor]:
    """The InceptionV3 weights of ``path``, read without running code from the file, checked
    before any sampling (``evaluate``, ``test``) and before any third-party code sees them.

    ``torch.load(weights_only=True)`` accepts tensors and containers only; where the file name
    carries a published hash (``...-6726825d.pth``) the file's sha256 must start with it; and
    unless its sha256 is the published file's, every tensor of torch-fidelity's InceptionV3 must be
    there with its shape, and nothing else. Each refusal is one line naming the file and the fix.
    torch-fidelity (which unpickles with ``weights_only=False``) then reads a file written from
    the checked tensors.
    """
    sha256 = file_sha256(path)
    match = _HASH_IN_NAME.search(os.path.basename(path))
    if match and not sha256.startswith(match.group(1)):
        raise ValueError(
            f"the InceptionV3 weights file {path} is corrupt or not the published one: its sha256 ({sha256[:12]}...) "
            f"does not match the hash in its name ({match.group(1)}); {_fix()}"
        )
    from ..checkpoints.safe_load import unreadable_reason

    try:
        with warnings.catch_warnings():  # a pickle of another protocol is refused below, in one line
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"the InceptionV3 weights file {path} {unreadable_reason(path, e)}; {_fix()}") from None
    if not isinstance(state, dict) or not state or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(
            f"the InceptionV3 weights file {path} holds a {type(state).__name__}, not a state dict of tensors; {_fix()}"
        )
    if not sha256.startswith(_PUBLISHED_SHA256_PREFIX):
        layout = _inception_layout()
        missing = [k for k in layout if k not in state]
        unexpected = [k for k in state if k not in layout]
        wrong = [k for k in layout if k in state and tuple(state[k].shape) != layout[k]]
        if missing or unexpected or wrong:
            found = "; ".join(
                f"{what} {len(keys)} (e.g. '{keys[0]}')"
                for what, keys in (("missing", missing), ("unexpected", unexpected), ("of another shape", wrong))
                if keys
            )
            raise ValueError(
                f"the InceptionV3 weights file {path} is not the InceptionV3 of FID (torch-fidelity's 2015-12-05 "
                f"network, {len(layout)} tensors): tensors {found}; {_fix()}"
            )
    return state


class InceptionFeatures(nn.Module):
    """The InceptionV3 of published FIDs (torch-fidelity's port of the TF 2015-12-05 graph, which
    torchmetrics uses): pool features (2048) and, if asked, the unbiased logits (1008)
    concatenated, in one forward; uint8 (N, 3, H, W) in.

    The weights are checked by :func:`load_inception_state_dict` first. ``antialias=False`` (the
    default) resizes to 299 px like TensorFlow 1 (the published protocol); ``antialias=True``
    resizes with torch's antialiased bilinear filter (8-bit) first.
    """

    def __init__(self, weights_path: Optional[str] = None, logits: bool = False, antialias: bool = False) -> None:
        super().__init__()
        path = find_inception_weights(weights_path)
        state = load_inception_state_dict(path)
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        self.features = ["2048", "logits_unbiased"] if logits else ["2048"]
        with tempfile.TemporaryDirectory() as tmp:
            checked = os.path.join(tmp, "inception.pth")
            torch.save(state, checked)  # tensors only: torch-fidelity's unpickling of it runs no foreign code
            self.net = FeatureExtractorInceptionV3("inception-v3-compat", self.features, checked)
        self.weights_path = path
        self.antialias = antialias
        self.num_features = 2048 + (1008 if logits else 0)

    def forward(self, x: Tensor) -> Tensor:
        if self.antialias and x.shape[-2:] != (299, 299):
            size = (_INCEPTION_SIZE, _INCEPTION_SIZE)
            x = F.interpolate(x.float(), size=size, mode="bilinear", align_corners=False, antialias=True)
            x = x.round().clamp(0, 255).to(torch.uint8)
        return torch.cat([f.reshape(len(x), -1) for f in self.net(x)], dim=1)

    def identity(self) -> str:
        size = os.path.getsize(self.weights_path)
        return f"inception-v3-compat:{os.path.basename(self.weights_path)}:{size}:antialias={self.antialias}"


class _Columns(nn.Module):
    """Feeds precomputed features to a torchmetrics metric: takes columns [start, stop)."""

    def __init__(self, start: int, stop: int) -> None:
        super().__init__()
        self.start, self.stop = start, stop
        self.num_features = stop - start

    def forward(self, features: Tensor) -> Tensor:
        return features[:, self.start : self.stop]


def extractor_identity(extractor: nn.Module) -> str:
    """A cache key for a feature extractor: Inception's weights file, or class + parameter hash."""
    if isinstance(extractor, InceptionFeatures):
        return extractor.identity()
    h = hashlib.sha1(repr(extractor).encode())
    for name, t in extractor.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    cls = type(extractor)
    return f"{cls.__module__}.{cls.__qualname__}:{h.hexdigest()[:16]}"


# --------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------


@dataclass
class FeatureStats:
    """Mean and covariance of a set of features (float64), and how many there were."""

    mu: np.ndarray
    sigma: np.ndarray
    num_samples: int
    features: Optional[np.ndarray] = None  # kept for KID when asked

    @classmethod
    def from_features(cls, features: np.ndarray, keep: bool = False) -> FeatureStats:
        f = np.asarray(features, dtype=np.float64)
        if len(f) < 2:
            raise ValueError("statistics need at least 2 samples")
        return cls(f.mean(0), np.cov(f, rowvar=False), len(f), features.astype(np.float32) if keep else None)

    def save(self, path: Union[str, Path], meta: Optional[dict[str, Any]] = None) -> Path:
        """Atomic ``.npz`` with ``mu``, ``sigma`` (ADM's keys), ``num_samples`` and ``meta`` (JSON)."""
        arrays: dict[str, Any] = {"mu": self.mu, "sigma": self.sigma, "num_samples": np.int64(self.num_samples)}
        if self.features is not None:
            arrays["features"] = self.features
        arrays["meta"] = np.frombuffer(json.dumps(meta or {}).encode(), dtype=np.uint8)
        return save_npz(path, **arrays)

    @classmethod
    def load(cls, path: Union[str, Path]) -> FeatureStats:
        try:
            with np.load(path) as z:  # allow_pickle=False: object arrays (pickles) are refused
                n = int(z["num_samples"]) if "num_samples" in z.files else ASSUMED_REFERENCE_COUNT
                feats = z["features"] if "features" in z.files else None
                return cls(z["mu"].astype(np.float64), z["sigma"].astype(np.float64), n, feats)
        except ValueError as e:
            raise ValueError(
                f"the statistics file {path} cannot be read as plain arrays ({e}); pickled objects are never loaded. "
                "Use the published reference .npz (mu, sigma) or let dit-lightning compute statistics from images"
            ) from None


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^1/2), in float64.

    The trace of the matrix square root is taken as ``sum(sqrt(eig(R S2 R)))`` with
    ``R = S1^1/2`` (the same eigenvalues as S1 S2, but of a symmetric PSD matrix), which stays
    exact for singular covariances (constant pixels, fewer samples than dimensions) where
    ``scipy.linalg.sqrtm`` of the product warns and needs an epsilon offset.
    """
    mu1, mu2 = np.atleast_1d(mu1).astype(np.float64), np.atleast_1d(mu2).astype(np.float64)
    s1, s2 = np.atleast_2d(sigma1).astype(np.float64), np.atleast_2d(sigma2).astype(np.float64)
    w, v = np.linalg.eigh((s1 + s1.T) / 2)
    root = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    inner = root @ s2 @ root
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh((inner + inner.T) / 2), 0, None)).sum()
    diff = mu1 - mu2
    return float(diff.dot(diff) + np.trace(s1) + np.trace(s2) - 2 * tr_covmean)


# --------------------------------------------------------------------------------------
# Image sources
# --------------------------------------------------------------------------------------


def _npz_member_batches(path: Path, key: str, batch_size: int, limit: Optional[int]) -> Iterator[np.ndarray]:
    """Stream an (N, H, W, C) uint8 array out of an ``.npz`` without loading all of it."""
    with zipfile.ZipFile(path) as zf:
        name = f"{key}.npy"
        if name not in zf.namelist():
            raise KeyError(f"{path} has no '{key}' array (it has {[n[:-4] for n in zf.namelist()]})")
        with zf.open(name) as f:
            version = np.lib.format.read_magic(f)
            read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}[version]
            shape, fortran, dtype = read(f)
            if fortran or dtype != np.uint8 or len(shape) != 4:
                raise ValueError(f"{path}:{key} must be uint8 (N, H, W, C), got {dtype} {shape}")
            n = shape[0] if limit is None else min(limit, shape[0])
            per = int(np.prod(shape[1:]))
            for start in range(0, n, batch_size):
                k = min(batch_size, n - start)
                yield np.frombuffer(f.read(k * per), dtype=np.uint8).reshape(k, *shape[1:]).copy()


def _list_images(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files += [
            Path(dirpath) / f
            for f in sorted(filenames)
            if f.lower().endswith(IMAGE_EXTENSIONS) and not f.startswith(".")
        ]
    return files


def _load_image(path: Path, image_size: Optional[int]) -> np.ndarray:
    from PIL import Image

    from ..data.preprocessing import adm_center_crop

    with Image.open(path) as im:
        image = im.convert("RGB")
    if image_size is not None and image.size != (image_size, image_size):
        image = adm_center_crop(image, image_size)
    return np.asarray(image)


def _store_batches(
    path: Path, batch_size: int, limit: Optional[int], device: str, indices: Optional[np.ndarray] = None
) -> Iterator[np.ndarray]:
    """A latent store decoded to uint8 images (posterior means, unflipped): its items ``indices``
    (sorted; default all)."""
    from ..data.rng import to_float32
    from ..data.store import LatentStore
    from ..images import to_uint8
    from ..latents import LatentTransform
    from ..vae import decode_latents, is_pixel_space, load_vae

    store = LatentStore(path)
    vae = None if is_pixel_space(store.spec.vae) else load_vae(store.spec.vae, device)
    items = np.arange(len(store)) if indices is None else np.sort(np.asarray(indices, np.int64))
    items = items[:limit]
    for start in range(0, len(items), batch_size):
        idx = items[start : start + batch_size]
        x = torch.from_numpy(to_float32(store.read(idx, flip=0)[:, 0])).to(device)
        # the stored values are the VAE's raw latents (the store's transform is applied by the reader):
        # decoded as they are, with the identity transform
        images = decode_latents(x, vae, LatentTransform.pixels())
        yield to_uint8(images)


def image_batches(
    source: Source,
    batch_size: int = 100,
    image_size: Optional[int] = None,
    limit: Optional[int] = None,
    device: str = "cpu",
    indices: Optional[np.ndarray] = None,
) -> Iterator[Tensor]:
    """uint8 (B, 3, H, W) batches from an image folder (recursive; a ``dit-lightning sample``
    output uses its ``samples/``), an ``.npz`` with ``arr_0`` (ADM format) or a latent store
    (decoded; ``indices``: only these items). Grayscale becomes three channels; ``image_size``
    ADM-centre-crops folder images."""
    from ..data.store import is_store

    path = Path(source)
    if indices is not None and not (path.is_dir() and is_store(path)):
        raise ValueError(f"indices select items of a latent store; {source} is not one")
    if path.is_file() and path.suffix == ".npz":
        it: Iterator[np.ndarray] = _npz_member_batches(path, "arr_0", batch_size, limit)
    elif path.is_dir() and is_store(path):
        it = _store_batches(path, batch_size, limit, device, indices)
    elif path.is_dir():
        root = path / "samples" if (path / "sample_config.json").exists() else path
        files = _list_images(root)[:limit]
        if not files:
            raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}")

        def folder() -> Iterator[np.ndarray]:
            for start in range(0, len(files), batch_size):
                arrays = [_load_image(f, image_size) for f in files[start : start + batch_size]]
                if len({a.shape for a in arrays}) > 1:
                    raise ValueError(f"images under {root} differ in size: pass image_size to centre-crop them")
                yield np.stack(arrays)

        it = folder()
    else:
        raise FileNotFoundError(f"{source} is neither an image folder, a latent store nor an .npz")
    for batch in it:
        if batch.shape[-1] == 1:
            batch = np.repeat(batch, 3, axis=-1)
        yield torch.from_numpy(np.ascontiguousarray(batch)).permute(0, 3, 1, 2).contiguous()


@torch.no_grad()
def extract_features(
    extractor: nn.Module, batches: Iterator[Tensor], device: Union[str, torch.device] = "cpu"
) -> np.ndarray:
    """(N, D) float32 features of all images."""
    feats = [extractor(b.to(device)).float().cpu() for b in batches]
    return torch.cat(feats).numpy() if feats else np.zeros((0, 0), np.float32)


def _source_signature(path: Path) -> dict[str, Any]:
    """What identifies a reference source cheaply: path, and sizes + mtimes of its files."""
    if path.is_file():
        st = path.stat()
        return {"path": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    count, total, newest = 0, 0, 0
    for dirpath, _, files in os.walk(path, followlinks=True):
        for f in files:
            st = os.stat(os.path.join(dirpath, f))
            count, total, newest = count + 1, total + st.st_size, max(newest, st.st_mtime_ns)
    return {"path": str(path.resolve()), "files": count, "bytes": total, "mtime_ns": newest}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dit-lightning" / "fid-stats"


def reference_stats(
    reference: Source,
    extractor: nn.Module,
    cache_dir: Optional[Union[str, Path]] = "auto",
    batch_size: int = 100,
    image_size: Optional[int] = None,
    limit: Optional[int] = None,
    keep_features: bool = False,
    device: Union[str, torch.device] = "cpu",
    dim: Optional[int] = None,
    indices: Optional[np.ndarray] = None,
) -> FeatureStats:
    """Statistics of the real images, from a stats ``.npz`` (``mu``/``sigma``: ours or ADM's,
    used as they are) or computed from images once and cached (``cache_dir=None``: no cache).

    The cache file is keyed by the source (path, file sizes and mtimes), the extractor's
    identity, ``image_size``, ``limit`` and ``indices``; it is written atomically. ``dim``: keep
    only the first ``dim`` feature columns (Inception's pool features when it also yields logits).
    ``indices``: of a latent store, only these items (a held-out split: ``--evaluation.reference store``).
    """
    path = Path(reference)
    if path.is_file() and path.suffix == ".npz":
        with np.load(path) as z:
            has_stats = "mu" in z.files and "sigma" in z.files
        if has_stats and not keep_features:
            return FeatureStats.load(path)
    key = {
        "source": _source_signature(path),
        "extractor": extractor_identity(extractor),
        "dim": dim,
        "image_size": image_size,
        "limit": limit,
    }
    if indices is not None:  # the key of a whole source stays as it was: caches written before still hit
        key["indices"] = hashlib.sha256(np.sort(np.asarray(indices, np.int64)).tobytes()).hexdigest()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cache = None
    if cache_dir is not None:
        cache = (
            default_cache_dir() if cache_dir == "auto" else Path(cache_dir)
        ) / f"{path.stem or path.name}-{digest}.npz"
        if cache.exists():
            stats = FeatureStats.load(cache)
            if stats.features is not None or not keep_features:
                return stats
    batches = image_batches(path, batch_size, image_size, limit, str(device), indices)
    feats = extract_features(extractor, batches, device)
    if dim is not None:
        feats = feats[:, :dim]
    stats = FeatureStats.from_features(feats, keep=keep_features)
    if cache is not None:
        stats.save(cache, meta=key)
    return stats


# --------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------


IMAGE_METRICS = ("fid", "is", "kid")


def check_metrics(
    metrics: Sequence[str], reference: Optional[Source], feature_extractor: Optional[nn.Module] = None
) -> list[str]:
    """The requested image metrics, lower-cased; a clear error for what cannot be computed."""
    wanted = [m.lower() for m in metrics]
    unknown = set(wanted) - set(IMAGE_METRICS)
    if unknown:
        raise ValueError(f"unknown metrics {sorted(unknown)}: choose from {', '.join(IMAGE_METRICS)}")
    if ("fid" in wanted or "kid" in wanted) and reference is None:
        raise ValueError("FID and KID need a reference (image folder, store, .npz of images or of mu/sigma)")
    if "is" in wanted and feature_extractor is not None:
        raise ValueError("IS needs the Inception classifier's logits: leave feature_extractor unset")
    if reference is not None and str(reference).endswith(".npz") and os.path.isfile(reference):
        check_plain_npz(reference)
    return wanted


def check_plain_npz(path: Union[str, os.PathLike[Any]]) -> None:
    """Refuse an ``.npz`` holding object arrays (pickles) before any work, from the array headers
    alone (nothing is unpickled, nothing large is read)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                with z.open(name) as f:
                    version = np.lib.format.read_magic(f)
                    read = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    _, _, dtype = read(f)
                    if dtype.hasobject:
                        raise ValueError(
                            f"{path} holds pickled objects (array {name!r} has dtype object), which are never "
                            "loaded (unpickling could run code): use an .npz of plain arrays (images as uint8, or "
                            "mu / sigma statistics)"
                        )
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"{path} is not a readable .npz file ({e}); download or write it again") from None


def build_extractor(
    metrics: Sequence[str],
    inception_weights: Optional[str] = None,
    feature_extractor: Optional[nn.Module] = None,
    antialias: bool = False,
) -> tuple[nn.Module, Optional[int]]:
    """The feature extractor for ``metrics`` and how many leading columns FID/KID use
    (Inception's 2048 pool features; None: all columns of a custom extractor)."""
    if feature_extractor is not None:
        return feature_extractor, None
    return InceptionFeatures(inception_weights, logits="is" in metrics, antialias=antialias), 2048


def metrics_from_features(
    fake: np.ndarray,
    metrics: Sequence[str],
    ref: Optional[FeatureStats] = None,
    dim: Optional[int] = None,
    kid_subset_size: int = 1000,
) -> dict[str, float]:
    """FID / KID (against ``ref``) and IS of generated features (N, D); KID and IS through torchmetrics.

    ``dim``: the columns FID/KID use (default all); IS reads Inception's logits after column 2048.
    """
    if len(fake) < 2:
        raise ValueError(f"metrics need at least 2 generated images, got {len(fake)}")
    dim = dim or fake.shape[1]
    fake_t = torch.from_numpy(np.asarray(fake)).double()
    result: dict[str, float] = {}
    if ref is not None and "fid" in metrics:
        # From the statistics (ADM's reference batches hold nothing else): the same closed form as
        # torchmetrics' FrechetInceptionDistance, in float64 (tests/evaluation/test_fid.py compares them)
        gen = FeatureStats.from_features(np.asarray(fake)[:, :dim])
        result["fid"] = frechet_distance(gen.mu, gen.sigma, ref.mu, ref.sigma)
    if ref is not None and "kid" in metrics:
        from torchmetrics.image.kid import KernelInceptionDistance

        if ref.features is None:
            raise ValueError("KID needs reference images (not a mu/sigma file)")
        size = min(kid_subset_size, len(fake), len(ref.features))
        with warnings.catch_warnings():  # "saves all features": we hand it features, not images
            warnings.filterwarnings("ignore", message=".*will save all extracted features")
            kid = KernelInceptionDistance(feature=_Columns(0, dim), subset_size=size)
        kid.update(torch.from_numpy(ref.features).double(), real=True)
        kid.update(fake_t[:, :dim], real=False)
        mean, std = kid.compute()
        result["kid"], result["kid_std"] = float(mean), float(std)
    if "is" in metrics:
        from torchmetrics.image.inception import InceptionScore

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*will save all extracted features")
            score = InceptionScore(feature=_Columns(2048, 2048 + 1008))
        score.update(fake_t.float())
        mean, std = score.compute()
        result["is"], result["is_std"] = float(mean), float(std)
    return result


def compute_metrics(
    samples: Source,
    reference: Optional[Source] = None,
    metrics: Sequence[str] = ("fid",),
    inception_weights: Optional[str] = None,
    feature_extractor: Optional[nn.Module] = None,
    antialias: bool = False,
    cache_dir: Optional[Union[str, Path]] = "auto",
    batch_size: int = 100,
    image_size: Optional[int] = None,
    max_samples: Optional[int] = None,
    max_reference: Optional[int] = None,
    kid_subset_size: int = 1000,
    device: str = "cpu",
) -> dict[str, Any]:
    """FID / IS / KID of ``samples`` (folder, sample output dir, ``.npz``) against ``reference``.

    ``metrics``: any of "fid", "is", "kid" ("is" needs no reference; "is" needs Inception).
    ``feature_extractor``: an ``nn.Module`` used instead of Inception (uint8 (N,3,H,W) -> (N,D)).
    """
    wanted = check_metrics(metrics, reference, feature_extractor)
    extractor, dim = build_extractor(wanted, inception_weights, feature_extractor, antialias)
    extractor = extractor.to(device).eval()
    fake = extract_features(extractor, image_batches(samples, batch_size, image_size, max_samples, device), device)
    if len(fake) < 2:
        raise ValueError(f"{samples} has fewer than 2 images")
    dim = dim or fake.shape[1]
    result: dict[str, Any] = {"num_samples": int(len(fake)), "feature_extractor": extractor_identity(extractor)}
    ref = None
    if reference is not None and ("fid" in wanted or "kid" in wanted):
        ref = reference_stats(
            reference, extractor, cache_dir, batch_size, image_size, max_reference,
            keep_features="kid" in wanted, device=device, dim=dim,
        )  # fmt: skip
        result["num_reference"] = int(ref.num_samples)
    result.update(metrics_from_features(fake, wanted, ref, dim, kid_subset_size))
    return result
