"""Pre-extract VAE posterior moments of an ImageFolder into a latent store (or, with ``--vae none``,
its cropped pixels: a pixel store, no VAE).

Data-parallel and resumable: the sorted file list is cut into fixed shards, process ``rank``
of ``world_size`` encodes the shards ``k`` with ``k % world_size == rank`` that are not yet on
disk, every shard is committed atomically, and whichever process finds all shards present
writes the index (meta.json). Killing a run and starting it again gives the same bytes.

    torchrun --nproc_per_node 8 -m dit_lightning.cli extract --image_root /data/imagenet/train \
        --output data/imagenet256_latents

Runs on the GPU when there is one (``device="auto"``); the VAE stays in float32 by default.

With ``--repa_encoder`` (and its local ``--repa_weights``) every shard also stores the frozen REPA
encoder's patch features of each image and of its flip (``shard-KKKKK.repa.npy``), computed on the
very image the VAE encodes, and, for an encoder with a class token, that token from the same pass
(``shard-KKKKK.repa_class_token.npy``: REG's target). On a store whose latents are all written, the
same command computes only the features (:func:`extract_features`): from the stored pixels of a
pixel store, from the images (``--image_root``, checked against the store's fingerprint) of a VAE
store; a store whose patch features predate class tokens gets only the class tokens added.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import numpy as np
import torch

from ..atomic import check_writable
from ..latents import LatentTransform
from ..ranks import resolve_device, resolve_rank
from ..signals import on_stop, safe_points, stop_point
from ..vae import is_pixel_space, load_vae, vae_reference
from . import store as st
from .preprocessing import BadImage, folder_channels, list_image_folder, preprocess
from .rng import NoiseKernel, to_float32

if TYPE_CHECKING:
    from ..models.encoders import FrozenEncoder
    from ..models.repa import REPAOptions
    from ..models.repa_head import EncoderIdentity

# Test hook: "k" makes the process exit right after committing k shards, "k+" makes it die
# inside the next shard, after its data file and before its commit record.
EXIT_AFTER_ENV = "DIT_LIGHTNING_EXTRACT_EXIT_AFTER"
# Key of the noise stream used by variant="sample" (never equal to a training epoch).
_SAMPLE_EPOCH = -1


class _ImageFiles(torch.utils.data.Dataset):
    """Decodes and crops one image per item; failures come back as a reason, not an exception."""

    def __init__(self, root: str, paths: list[str], image_size: int, channels: int = 3) -> None:
        self.root, self.paths, self.image_size, self.channels = root, paths, image_size, channels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item: dict[str, Any] = {"i": i, "x": None, "note": None, "error": None}
        try:
            path = os.path.join(self.root, self.paths[i])
            item["x"], item["note"] = preprocess(path, self.image_size, self.channels)
        except BadImage as e:
            item["error"] = e.reason
        except Exception as e:  # one odd file must not kill a day-long extraction
            item["error"] = f"unexpected {type(e).__name__}: {e}"
        return item


def _collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    xs = [it["x"] for it in items if it["x"] is not None]
    return {
        "x": torch.stack(xs) if xs else None,
        "items": [{k: v for k, v in it.items() if k != "x"} for it in items],
    }


def _image_loader(
    image_root: str,
    paths: list[str],
    image_size: int,
    batches: list[list[int]],
    num_workers: int,
    dev: torch.device,
    channels: int = 3,
) -> torch.utils.data.DataLoader:
    """Decoded, cropped images of ``paths`` in the given batches (of indices into ``paths``)."""
    return torch.utils.data.DataLoader(
        _ImageFiles(image_root, paths, image_size, channels),
        batch_sampler=batches,
        num_workers=num_workers,
        collate_fn=_collate,
        pin_memory=dev.type == "cuda",
        prefetch_factor=4 if num_workers > 0 else None,
    )


def _fingerprint(paths: list[str], labels: list[int]) -> str:
    h = hashlib.sha256()
    for p, y in zip(paths, labels):
        h.update(f"{p}\t{y}\n".encode())
    return h.hexdigest()


def _dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


def _to_storage(t: torch.Tensor, storage_dtype: str) -> np.ndarray:
    if storage_dtype == "bfloat16":
        return t.to(torch.bfloat16).view(torch.uint16).cpu().numpy()
    return t.to(torch.float16).cpu().numpy()


def _exit_plan() -> tuple[Optional[int], bool]:
    v = os.environ.get(EXIT_AFTER_ENV, "").strip()
    if not v:
        return None, False
    return int(v.rstrip("+")), v.endswith("+")


# --------------------------------------------------------------------------------------
# Pixel stores (--vae none): the cropped images themselves, no VAE
# --------------------------------------------------------------------------------------

PIXEL_VAE = "none/pixels"  # what a pixel store records as its VAE (the digits store too)
Channels = Union[Literal["auto"], int]


def pixel_vae(vae: str) -> bool:
    """Whether ``--vae`` asks for a pixel store: ``none``, or ``none/pixels`` (the name the store
    records). Another ``none/...`` is refused: it would otherwise be looked up on the hub."""
    if vae in ("none", PIXEL_VAE):
        return True
    if is_pixel_space(vae):
        raise ValueError(
            f"--vae {vae!r} names no VAE: a pixel store is --vae none (or none/pixels, the name stores record); "
            "a VAE is a hub id or a local AutoencoderKL.save_pretrained directory"
        )
    return False


def pixel_channels(image_root: str, paths: list[str], channels: Channels = "auto") -> int:
    """The channels of a pixel store of these images: ``auto`` gives 1 when every image is stored grey
    (PIL modes ``L``, ``LA``, ``I;16``..., read from the headers), else 3; 1 or 3 force it (1: PIL's
    luma of colour images; 3: grey images repeated)."""
    if channels == "auto":
        return folder_channels(image_root, paths)
    if channels not in (1, 3):
        raise ValueError(f"channels must be auto, 1 or 3, got {channels!r}")
    return int(channels)


def folder_fields(image_root: str, paths: list[str], labels: list[int], classes: list[str]) -> dict[str, Any]:
    """What a store's spec records of the image folder it was made from (pixel and VAE stores alike):
    its class names, absolute path, image count and the fingerprint of its listing."""
    return {
        "class_names": tuple(classes),
        "source": os.path.abspath(image_root),
        "num_items": len(paths),
        "fingerprint": _fingerprint(paths, labels),
    }


def pixel_store_spec(
    image_root: str,
    image_size: int,
    channels: Channels = "auto",
    flips: bool = True,
    storage_dtype: Literal["float16", "bfloat16"] = "float16",
    shard_size: int = 1024,
    listing: Optional[tuple[list[str], list[int], list[str]]] = None,
) -> st.StoreSpec:
    """The StoreSpec ``extract --vae none`` plans for these settings (known without writing the
    store: the image list and, for ``channels="auto"``, the image headers are read). ``listing``:
    the folder's ``(paths, labels, classes)`` where the caller has read it (extract, after --limit)."""
    paths, labels, classes = listing if listing is not None else list_image_folder(image_root)
    if not paths:
        raise FileNotFoundError(f"no images under {image_root} (extensions: jpg, jpeg, png, ...)")
    c = pixel_channels(image_root, paths, channels)
    return st.StoreSpec(
        latent_shape=(c, image_size, image_size),
        dtype=storage_dtype,
        variant="sample",
        flips=flips,
        scale_factor=1.0,
        vae=PIXEL_VAE,
        image_size=image_size,
        shard_size=shard_size,
        **folder_fields(image_root, paths, labels, classes),
    )


def pixel_store_mismatch(
    spec: st.StoreSpec, image_root: str, image_size: int, channels: Channels, flips: bool = False
) -> Optional[str]:
    """What differs between a store and the pixel store of ``image_root`` at ``image_size`` (and
    ``channels`` unless ``auto``; with mirrored images where ``flips``), or None when the store is
    that one (a store with mirrors serves a run without: it reads the unflipped images)."""
    if not is_pixel_space(spec.vae):
        return f"it holds latents of the VAE {spec.vae}, not pixels"
    if os.path.abspath(image_root) != spec.source:
        return f"it was made from {spec.source}, not {os.path.abspath(image_root)}"
    paths, labels, _ = list_image_folder(image_root)
    if len(paths) != spec.num_items or _fingerprint(paths, labels) != spec.fingerprint:
        return (
            f"the files under {image_root} are not the ones it was made from ({spec.num_items} then, {len(paths)} now)"
        )
    if spec.image_size != image_size:
        return f"its images are {spec.image_size} px, not {image_size}"
    if channels != "auto" and spec.latent_shape[0] != channels:
        return f"its images have {spec.latent_shape[0]} channel(s), not {channels}"
    if flips and not spec.flips:  # it would train unflipped: random_flip has no mirror to pick
        return "it holds no mirrored images (prepared with --data.random_flip false), and this run flips them"
    return None


def _pixels(x: torch.Tensor, spec: st.StoreSpec) -> np.ndarray:
    """(n, F, 1, C, H, W) in the storage dtype: the cropped images in [-1, 1] and their mirrors."""
    if tuple(x.shape[1:]) != spec.latent_shape:
        raise RuntimeError(f"the images are {tuple(x.shape[1:])}, the store expects {spec.latent_shape}")
    out = torch.stack([x, x.flip(-1)], 1) if spec.flips else x[:, None]
    return _to_storage(out[:, :, None].contiguous(), spec.dtype)


# --------------------------------------------------------------------------------------
# REPA features
# --------------------------------------------------------------------------------------


# The store's feature set of the REPA encoder's patch features (repa.json, shard-KKKKK.repa.npy).
REPA_FEATURES = "repa"
# The feature set of the same encoder's class token (REG's target), written in the same pass as the
# patch features by an encoder that has one: one 1 x D row per image and flip.
REPA_CLASS_TOKEN = "repa_class_token"


def repa_feature_spec(identity: EncoderIdentity, weights: Optional[str], tokens: int, dim: int) -> st.FeatureSpec:
    """The store's record of the features of the encoder ``identity`` (``weights``: its weights file's
    name): its source (:meth:`EncoderIdentity.store_record`), shape and key
    (:meth:`EncoderIdentity.features_key`)."""
    return st.FeatureSpec(
        REPA_FEATURES, identity.store_record(weights), tokens, dim, key=identity.features_key(tokens, dim)
    )


def repa_class_token_spec(identity: EncoderIdentity, weights: Optional[str], dim: int) -> st.FeatureSpec:
    """The store's record of the class token of the encoder ``identity``: the same source as its patch
    features (:func:`repa_feature_spec`), one token of width ``dim``."""
    return st.FeatureSpec(REPA_CLASS_TOKEN, identity.store_record(weights), 1, dim, key=identity.features_key(1, dim))


def repa_extract_command(root: str, plan: st.StoreSpec, source: Mapping[str, Any]) -> str:
    """The ``extract`` command that computes (or resumes) the REPA features recorded by ``source``
    in the store at ``root``: only the shards without them are computed."""
    cmd = f"dit-lightning extract --output {root} --repa_encoder {source.get('encoder')}"
    if source.get("weights"):
        cmd += f" --repa_weights <{source['weights']}>"
    if source.get("image_size") is not None:
        cmd += f" --repa_image_size {source['image_size']}"
    if not is_pixel_space(plan.vae):  # pixel stores hold their images; VAE stores need theirs
        cmd += " --image_root <the images>"
    return cmd


def _repa_fix(root: str, plan: st.StoreSpec, features: st.FeatureSpec) -> str:
    command = repa_extract_command(root, plan, features.source)
    return f"rerun `{command}` to compute it again (only the missing features are computed)"


# The remedies the store's messages give for a broken REPA features file (LatentStore's ``fixes``).
REPA_FIXES: dict[str, st.FeaturesFix] = {REPA_FEATURES: _repa_fix, REPA_CLASS_TOKEN: _repa_fix}


def unfinished_repa_features(store: st.LatentStore) -> Optional[str]:
    """Why ``store`` holds no REPA features though a features pass started on it (``repa.json``
    written, not every shard done), with the fixes; None when no pass is unfinished."""
    planned = st.load_features_plan(store.path, REPA_FEATURES)
    if planned is None or REPA_FEATURES in store.features:
        return None
    done, _ = st.features_status(store.path, planned, store.spec)
    return (
        f"the store {store.path} has REPA features of {planned.source.get('encoder')} in only {len(done)} of its "
        f"{store.num_shards} shards (a features pass stopped half-way), so its batches carry none and REPA would "
        "compute them online, a decode and an encoder forward per step. Resume the features pass: "
        f"`{repa_extract_command(store.path, store.spec, planned.source)}`; or set data.repa_features false to "
        "compute them online knowingly"
    )


class _Repa:
    """The REPA encoder of one extraction: its store records (the ``repa`` feature set and, for an
    encoder with a class token, ``repa_class_token``) and, loaded only when features are left to
    compute, the encoder itself."""

    def __init__(
        self,
        spec: st.FeatureSpec,
        token: Optional[st.FeatureSpec],
        options: Any,
        dev: torch.device,
        encoder: Optional[FrozenEncoder],
    ) -> None:
        self.spec, self.token, self.options, self.dev = spec, token, options, dev
        self._encoder = encoder
        self._placed = False

    @property
    def sets(self) -> list[st.FeatureSpec]:
        """The feature sets one encoder pass writes: the patch features, then the class token."""
        return [self.spec] if self.token is None else [self.spec, self.token]

    @property
    def encoder(self) -> FrozenEncoder:
        if self._encoder is None:
            from ..models.encoders import load_encoder

            self._encoder = load_encoder(self.options, trusted=True)  # the command line's encoder
        if not self._placed:
            self._encoder, self._placed = self._encoder.to(self.dev), True
        return self._encoder

    @torch.inference_mode()
    def features(self, images: torch.Tensor) -> list[np.ndarray]:
        """The float16 values of :attr:`sets` for images in [0, 1], (n, F, C, H, W), from one encoder
        pass: the patch features (n, F, T, D), then the class token (n, F, 1, D)."""
        n, f = images.shape[:2]
        z, token = self.encoder.encode(images.to(self.dev, non_blocking=True).flatten(0, 1))
        want = (self.spec.tokens, self.spec.dim)
        if tuple(z.shape[1:]) != want:
            raise RuntimeError(f"the REPA encoder gave features {tuple(z.shape[1:])}, the store records {want}")
        out = [z.reshape(n, f, *want)]
        if self.token is not None:
            if token is None or tuple(token.shape[1:]) != (self.token.dim,):
                got = "none" if token is None else f"one of width {token.shape[-1]}"
                raise RuntimeError(
                    f"the REPA encoder gave {got} as its class token, the store records {self.token.dim}"
                )
            out.append(token.reshape(n, f, 1, self.token.dim))
        return [v.to(torch.float16).cpu().numpy() for v in out]

    def empty(self, spec: st.StoreSpec) -> list[np.ndarray]:
        """The values of :attr:`sets` for a shard without images."""
        return [np.zeros((0, spec.num_flips, fs.tokens, fs.dim), np.float16) for fs in self.sets]


def _repa_identity(options: REPAOptions) -> tuple[EncoderIdentity, Optional[str]]:
    """The identity of the asked encoder (its weights hashed now) and its weights file's name (None
    for a directory, whose files are hashed together, or a class that needs none); an encoder that
    needs a weights file and has none is refused."""
    from ..models.encoders import needs_weights
    from ..models.repa_head import EncoderIdentity

    if not options.weights and needs_weights(options.encoder or "", trusted=True):  # typed by the user
        raise ValueError(
            f"--repa_encoder {options.encoder} needs --repa_weights, its local weights file: features of an encoder "
            "without trained weights would be random (and differ at every run)"
        )
    identity = EncoderIdentity.of(options)
    if os.path.isdir(options.encoder or "") or not options.weights:
        return identity, None
    return identity, os.path.basename(options.weights)


def _repa_options(encoder: Optional[str], weights: Optional[str], image_size: Optional[int]) -> Any:
    """The REPAOptions of the ``--repa_*`` arguments, or None without ``--repa_encoder``."""
    if not encoder:
        if weights or image_size:
            raise ValueError("--repa_weights / --repa_image_size need --repa_encoder: the encoder to compute with")
        return None
    from ..models.repa import REPAOptions

    if os.path.isdir(encoder):
        encoder = os.path.abspath(encoder)  # a save_pretrained directory: recorded by its full path
    elif weights and not os.path.isfile(weights):
        raise FileNotFoundError(f"--repa_weights {weights} is not a file")  # before any other work
    return REPAOptions(encoder=encoder, weights=weights, image_size=image_size)


def _image_shape(spec: st.StoreSpec) -> tuple[int, int, int]:
    """(C, H, W) of the images behind a store's latents (the encoder's input)."""
    if is_pixel_space(spec.vae):
        return spec.latent_shape
    return (3, spec.image_size, spec.image_size)


def _setup_repa(output: str, spec: st.StoreSpec, options: Any, dev: torch.device) -> _Repa:
    """Check the asked encoder against the store's features (``repa.json``) or record it there.

    A store's features all come from one encoder (:class:`EncoderIdentity`'s rule): another is
    refused before any work. The encoder is loaded here only for a store without features (to read
    its tokens and width)."""
    from ..models.repa_head import EncoderIdentity

    identity, weights = _repa_identity(options)
    old = st.load_features_plan(output, REPA_FEATURES)
    old_token = st.load_features_plan(output, REPA_CLASS_TOKEN)
    planned = [p for p in (old, old_token) if p is not None]
    for plan in planned:
        wrong = EncoderIdentity.from_record(plan.source).differences(identity)
        if wrong:  # each names the asked encoder, then "this one": the store's
            parts = [f for p in planned for f in (p.plan_file, f"shards/*.{p.name}.npy")]
            files = ", ".join(parts[:-1]) + " and " + parts[-1]
            raise st.StoreError(
                f"{output} already holds REPA features of another encoder than the one asked: "
                + "; ".join(wrong).replace("this one", "the store's")
                + f". Features of two encoders are never mixed: extract with the store's settings "
                f"(`{repa_extract_command(output, spec, plan.source)}`), or delete {files} in the store to "
                "replace its features"
            )
    if old is not None and old_token is not None:
        return _Repa(old, old_token, options, dev, None)
    from ..models.encoders import feature_shape, load_encoder

    # Loaded to read the features' shape, or whether it has a class token: a store whose patch features
    # were written before class tokens were stored gets them from the same encoder (REG's target).
    encoder = load_encoder(options, trusted=True)  # --repa_encoder: the user's choice (a store's is only compared)
    if old is None:
        tokens, dim = feature_shape(encoder, _image_shape(spec))
        old = st.write_features_plan(output, repa_feature_spec(identity, weights, tokens, dim))
    token = None
    if encoder.has_class_token:  # the same output tensor as the patches: the same width
        token = st.write_features_plan(output, repa_class_token_spec(identity, weights, old.dim))
    return _Repa(old, token, options, dev, encoder)


def _check_fingerprint(image_root: str, spec: st.StoreSpec) -> None:
    """Refuse an image folder whose file list is not the one the store was extracted from."""
    paths, labels, _ = list_image_folder(image_root)
    paths, labels = paths[: spec.num_items], labels[: spec.num_items]
    if len(paths) != spec.num_items or _fingerprint(paths, labels) != spec.fingerprint:
        raise ValueError(
            f"--image_root {image_root} does not hold the images the store was extracted from ({spec.source}: "
            f"{spec.num_items} files, fingerprint {spec.fingerprint[:12]}...; found {len(paths)} files with another "
            "list): the features must be computed from the very images of the latents; pass the original folder"
        )


def _shard_images(
    output: str,
    spec: st.StoreSpec,
    image_root: Optional[str],
    shards: list[int],
    counts: dict[int, int],
    sources: dict[int, list[str]],
    batch_size: int,
    num_workers: int,
    dev: torch.device,
) -> Iterator[tuple[int, Optional[torch.Tensor]]]:
    """(shard, images in [0, 1] of shape (b, F, C, H, W)) batches of the committed ``shards``, in
    order, never across a shard; (shard, None) closes each shard. Pixel stores read their stored
    pixels (and stored flips); VAE stores decode and crop the shard's source images again."""
    if is_pixel_space(spec.vae):
        for k in shards:
            data = np.load(st.data_path(output, k), mmap_mode="r")  # (n, F, K, C, H, W)
            for a in range(0, counts[k], batch_size):
                x = to_float32(np.ascontiguousarray(data[a : a + batch_size, :, 0]))  # (b, F, C, H, W) in [-1, 1]
                yield k, (torch.from_numpy(x) + 1) / 2
            yield k, None
        return
    assert image_root is not None
    flat = [p for k in shards for p in sources[k]]
    batches: list[list[int]] = []
    start = 0
    for k in shards:  # batches never cross a shard: a shard's bytes do not depend on the others
        batches.extend(
            list(range(s, min(start + counts[k], s + batch_size))) for s in range(start, start + counts[k], batch_size)
        )
        start += counts[k]
    it = iter(_image_loader(image_root, flat, spec.image_size, batches, num_workers, dev))
    for k in shards:
        for _ in range(-(-counts[k] // batch_size)):
            batch = next(it)
            bad = [it_ for it_ in batch["items"] if it_["error"] is not None]
            if bad:
                path = os.path.join(image_root, flat[bad[0]["i"]])
                raise ValueError(
                    f"{path} was encoded into shard {k} of {output} but cannot be read now ({bad[0]['error']}): "
                    "the features need the very images of the latents; restore the file and run again"
                )
            x = (batch["x"] + 1) / 2
            yield k, torch.stack([x, x.flip(-1)], 1) if spec.flips else x[:, None]
        yield k, None


@dataclass
class _FeaturesJob:
    """What one rank's features pass works with (the store, its encoder, how to read and show)."""

    output: str
    spec: st.StoreSpec
    repa: _Repa
    image_root: Optional[str]
    batch_size: int
    num_workers: int
    dev: torch.device
    show: bool
    stats: dict[str, int]
    rank: int
    world_size: int

    @property
    def label(self) -> str:
        return f"{self.rank}/{self.world_size}"


class _LogLines:
    """Progress as plain lines where rich's bar shows nothing until the end (a log file, a pipe): after
    the first batch, then at most one line every ``every_s`` seconds, and at the end."""

    def __init__(self, what: str, total: int, show: bool, every_s: float = 30.0) -> None:
        self.what, self.total, self.every_s = what, total, every_s
        self.on = show and not sys.stderr.isatty()
        self.done, self.start, self.last = 0, time.perf_counter(), -float("inf")

    def advance(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if not self.on or (now - self.last < self.every_s and self.done < self.total):
            return
        self.last = now
        rate = self.done / max(1e-9, now - self.start)
        eta = int((self.total - self.done) / rate) if rate > 0 else 0
        print(
            f"{self.what}: {self.done}/{self.total} images ({100 * self.done / max(1, self.total):.1f}%), "
            f"{rate:.1f} img/s, ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}",
            file=sys.stderr,
            flush=True,
        )


def _missing_sets(job: _FeaturesJob) -> dict[int, list[int]]:
    """Shard -> the positions in ``job.repa.sets`` of the feature sets the committed shard lacks (a
    store whose patch features predate its class tokens lacks only those), for the shards that lack one."""
    missing: dict[int, list[int]] = {}
    for i, fs in enumerate(job.repa.sets):
        for k in st.features_status(job.output, fs, job.spec)[1]:
            missing.setdefault(k, []).append(i)
    return dict(sorted(missing.items()))


def _features_pass(job: _FeaturesJob, shards: Mapping[int, list[int]]) -> None:
    """Compute and commit the feature sets ``shards`` lack (shard -> positions in ``repa.sets``) of
    the committed shards: one encoder pass per batch, every lacking set of a shard committed together
    (shard by shard: a kill loses at most the shard in progress; the test hook of ``EXIT_AFTER_ENV``
    counts features shards here)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    output, spec, repa, stats = job.output, job.spec, job.repa, job.stats
    records = {k: st.read_shard_record(output, k) for k in shards}
    counts = {k: int(r["count"]) if r else 0 for k, r in records.items()}
    sources = {k: list(r["sources"]) if r else [] for k, r in records.items()}
    exit_after, exit_mid = _exit_plan()
    pending: list[list[np.ndarray]] = []
    lines = _LogLines(f"extract features rank {job.label}", sum(counts.values()), job.show)
    with Progress(
        TextColumn(f"[bold]features[/] rank {job.label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        disable=not job.show or lines.on,
        transient=False,
    ) as bar:
        task = bar.add_task("features", total=sum(counts.values()))
        read = (job.batch_size, job.num_workers, job.dev)
        for k, images in _shard_images(output, spec, job.image_root, list(shards), counts, sources, *read):
            stop_point()  # (dit_lightning.signals)
            if images is not None:
                pending.append(repa.features(images))
                bar.update(task, advance=len(images))
                lines.advance(len(images))
                continue
            hook = None
            if exit_after is not None and exit_mid and stats["features_written"] == exit_after:
                hook = lambda: os._exit(17)  # noqa: E731
            values = [np.concatenate(v) for v in zip(*pending)] if pending else repa.empty(spec)
            todo = [(repa.sets[i], values[i]) for i in shards[k]]
            st.write_features(output, k, spec, *todo[0], after_data_hook=hook, also=todo[1:])
            pending = []
            stats["features_written"] += 1
            stats["features_images"] += counts[k]
            if exit_after is not None and not exit_mid and stats["features_written"] == exit_after:
                os._exit(17)


def _finalize_if_done(output: str, spec: st.StoreSpec, sets: Sequence[st.FeatureSpec] = ()) -> bool:
    """Write the index once every shard (and its feature ``sets``) is committed and the index does
    not say so yet; whether the store is complete."""
    if st.shard_status(output, spec)[1]:
        return False
    if any(st.features_status(output, fs, spec)[1] for fs in sets):
        return False
    try:
        current = st.LatentStore(output)
        indexed = [current.features.get(fs.name) for fs in sets]
        fresh = all(old is not None and old.key == fs.key for old, fs in zip(indexed, sets))
    except (st.StoreError, OSError, ValueError):
        fresh = False
    if not fresh:
        st.finalize_store(output)
    return True


def extract_features(
    output: str,
    repa_encoder: str,
    repa_weights: Optional[str] = None,
    repa_image_size: Optional[int] = None,
    image_root: Optional[str] = None,
    batch_size: int = 32,
    num_workers: int = 4,
    device: str = "auto",
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    finalize: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Add a frozen REPA encoder's patch features (and its class token, for an encoder with one) to a
    store whose latents are all written; to a store with the patch features only, its class tokens.

    Shard by shard, resumable (rerun: it continues; the same bytes as an uninterrupted run) and
    data-parallel like :func:`extract_latents` (which calls this when its latents are done). A pixel
    store (the digits) is encoded from its stored pixels, ``(x + 1) / 2``, and its stored flips; a
    VAE store from its images, ``image_root`` (default: the folder it was extracted from), checked
    against the store's fingerprint and cropped as for the latents. The index (``meta.json``) is
    rewritten with the features once every shard has them; until then the store reads as before.

    Args:
        output: The store.
        repa_encoder: The encoder (a timm name, ``dinov2-vitb14``, a ``save_pretrained`` directory or
            a class path: :func:`dit_lightning.models.encoders.load_encoder`).
        repa_weights: Its local weights file (not for a directory).
        repa_image_size: The encoder's input side; unset: its own (224 for DINOv2).
        image_root: The images of a VAE store.
        batch_size: Images per encoder forward (their flips go in the same forward).
        num_workers: Image decoding processes (VAE stores).
        device: ``auto`` (``cuda:LOCAL_RANK`` when CUDA is present, else CPU) or a torch device.
        rank: This process's rank (default: torchrun's).
        world_size: Number of processes.
        finalize: Rewrite the index when every shard has its features.
        progress: Show a progress bar and the summary.
    """
    t0 = time.perf_counter()
    rank, world_size, local_rank = resolve_rank(rank, world_size)
    output = os.path.abspath(output)
    options = _repa_options(repa_encoder, repa_weights, repa_image_size)
    if options is None:
        raise ValueError("extract_features needs repa_encoder: the encoder whose features to add")
    if not os.path.exists(os.path.join(output, st.PLAN_FILE)):
        raise st.StoreError(
            f"no latent store at {output}: extract its latents first (`dit-lightning extract --image_root ... "
            "--output ...`; the --repa_* arguments there compute the features at the same time)"
        )
    spec = st.load_plan(output)
    done, missing = st.shard_status(output, spec)
    if missing:
        raise st.IncompleteStoreError(
            f"{output}: {len(missing)} of {spec.num_shards} shards of latents are not written yet; finish them with "
            "the original `dit-lightning extract --image_root ...` command and the --repa_* arguments (both at once)"
        )
    if is_pixel_space(spec.vae):
        image_root = None  # the stored values are the images
    else:
        image_root = image_root or (spec.source if os.path.isdir(spec.source) else None)
        if not image_root:
            raise ValueError(
                f"{output} holds VAE latents: its features are computed from the same images; pass --image_root "
                f"(the store was extracted from {spec.source}, which is not a directory here)"
            )
        _check_fingerprint(image_root, spec)
    check_writable(output, "store directory", "Features are written into the store.")
    for name, value in (("batch_size", batch_size),):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    dev = resolve_device(device, local_rank)
    repa = _setup_repa(output, spec, options, dev)
    stats = {"features_written": 0, "features_images": 0}
    show = progress and local_rank == 0
    job = _FeaturesJob(output, spec, repa, image_root, batch_size, num_workers, dev, show, stats, rank, world_size)
    mine = _run_features(job)
    finalized = _finalize_if_done(output, spec, repa.sets) if finalize else False
    seconds = time.perf_counter() - t0
    summary = {
        "output": output,
        "rank": rank,
        "world_size": world_size,
        "device": str(dev),
        "repa": repa.spec.to_json(),
        "repa_class_token": repa.token.to_json() if repa.token is not None else None,
        "shards_total": spec.num_shards,
        "features_written": stats["features_written"],
        "features_already_done": sum(1 for k in range(spec.num_shards) if k % world_size == rank) - len(mine),
        "images_done": stats["features_images"],
        "seconds": round(seconds, 3),
        "finalized": finalized,
    }
    if progress:
        from rich.console import Console

        token = " and its class token" if repa.token is not None else ""
        Console(stderr=True).print(
            f"[bold]features[/] rank {rank}/{world_size} on {dev}: {repa.spec.source['encoder']} ({repa.spec.tokens}x"
            f"{repa.spec.dim} per image and flip{token}) of {stats['features_images']} images in "
            f"{stats['features_written']} shards ({summary['features_already_done']} already done) in {seconds:.1f}s; "
            + ("store finalised with its features" if finalized else "not finalised yet (other shards pending)")
        )
    return summary


def _run_features(job: _FeaturesJob) -> list[int]:
    """The features pass over this rank's shards that lack them (any of the sets), with stop handling
    (a signal drops only the shard in progress); the shards it did."""
    shards = {k: sets for k, sets in _missing_sets(job).items() if k % job.world_size == job.rank}
    if not shards:
        return []

    def stopped() -> str:
        have = job.spec.num_shards - len(_missing_sets(job))
        return (
            f"{have} of {job.spec.num_shards} shards of {job.output} have their REPA features (each whole); run "
            "the same command again to resume from there"
        )

    with safe_points(), on_stop(stopped):
        _features_pass(job, shards)
    return list(shards)


def extract_latents(
    image_root: Optional[str] = None,
    output: Optional[str] = None,
    vae: str = "stabilityai/sd-vae-ft-ema",
    image_size: int = 256,
    batch_size: int = 32,
    storage_dtype: Literal["float16", "bfloat16"] = "float16",
    variant: Optional[Literal["moments", "sample"]] = None,
    flips: bool = True,
    shard_size: int = 1024,
    num_workers: int = 4,
    device: str = "auto",
    vae_dtype: Literal["float32", "float16", "bfloat16"] = "float32",
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    seed: int = 0,
    scale_factor: Optional[float] = None,
    latent_norm: Literal["scale", "channel_stats"] = "scale",
    latent_multiplier: float = 1.0,
    limit: Optional[int] = None,
    finalize: bool = True,
    finalize_only: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    repa_encoder: Optional[str] = None,
    repa_weights: Optional[str] = None,
    repa_image_size: Optional[int] = None,
    channels: Channels = "auto",
) -> dict[str, Any]:
    """Encode an ImageFolder into a latent store (resumable, data-parallel), with the REPA encoder's
    features when ``repa_encoder`` is set.

    Args:
        image_root: ImageFolder root, ``root/<class>/<image>`` (ImageNet layout); classes and
            files are taken in sorted order. (Not needed with ``finalize_only``.)
        output: Store directory (required). Rerunning with the same arguments resumes an interrupted run.
        vae: diffusers ``AutoencoderKL``: a hub id or a local directory (``save_pretrained``); or
            ``none`` (``none/pixels``, the name the store records): a pixel store, the cropped images
            themselves in [-1, 1] (variant ``sample``, scale factor 1.0; no VAE, nothing downloaded).
        image_size: Side of the ADM centre crop in pixels (256 -> 4x32x32 latents with the SD VAE).
        batch_size: Images per VAE forward (their flips are encoded in the same forward).
        storage_dtype: ``float16`` or ``bfloat16`` on disk.
        variant: ``moments`` (the default with a VAE) stores the posterior mean and log-variance
            (fresh sample at every read); ``sample`` stores one posterior sample (half the size,
            frozen noise); pixel stores are ``sample`` (the images, no noise).
        flips: Also store the horizontally flipped image (random flip at read time).
        shard_size: Images per shard, the unit of work, resume and parallelism.
        num_workers: Decoding processes of the image DataLoader.
        device: ``auto`` (``cuda:LOCAL_RANK`` when CUDA is present, else CPU), or a torch device.
        vae_dtype: Compute dtype of the VAE.
        rank: This process's rank; default from torch.distributed or the RANK env var (torchrun).
        world_size: Number of processes; default from torch.distributed or WORLD_SIZE.
        seed: Seed of the posterior noise of ``variant="sample"`` (a function of seed and file).
        scale_factor: Latent scale recorded in the metadata; default the VAE's
            ``config.scaling_factor`` (0.18215 for the SD VAEs).
        latent_norm: The latent transform the store records, which readers apply (docs/data.md,
            "Latent transforms"): ``scale``: the VAE's ``scaling_factor`` and ``shift_factor`` as
            diffusers applies them, ``(x - shift) * scale``; ``channel_stats``: LightningDiT's
            ``(x - mean) / std * latent_multiplier`` with each channel's mean and std measured over
            the store once its last shard is written (every image up to 10,000, else a seeded 10,000).
        latent_multiplier: The multiplier of ``latent_norm channel_stats`` (LightningDiT's
            ``latent_multiplier``; 1.0 in its VA-VAE configs).
        limit: Only use the first ``limit`` files of the sorted list (smoke tests).
        finalize: Write the index when all shards are present.
        finalize_only: Do not encode; only finalise a store whose shards are all written.
        overwrite: Replace an existing store at ``output`` (single process only): only a directory
            that is provably a store written by this tool (and holds nothing else, and not the
            images) is deleted, and only after the images and the VAE have been checked.
        progress: Show a rich progress bar (on local rank 0).
        repa_encoder: Also store this frozen REPA encoder's patch features of every image and flip,
            and its class token when it has one (``model.repa.encoder``'s names: ``dinov2-vitb14``, a
            timm name, a ``save_pretrained`` directory, a class path). On a store whose latents are all
            written only the features are computed (:func:`extract_features`; ``image_root`` is then
            only needed for VAE stores, and the other settings are the store's).
        repa_weights: The encoder's local weights file (nothing is downloaded).
        repa_image_size: The encoder's input side; unset: its own (224 for DINOv2).
        channels: Pixel stores: ``auto`` (1 when every image of the folder is stored grey, PIL mode
            ``L``, ``LA``, ``I;16``...; else 3), 1 (colour images become PIL's luma) or 3.

    Returns:
        A summary: images done/skipped/converted by this process, shards written and already
        present, seconds, images/s, output size in bytes, and whether the store is finalised.
    """
    t0 = time.perf_counter()
    rank, world_size, local_rank = resolve_rank(rank, world_size)
    if not output:
        raise ValueError("extract needs --output: the store directory to write (or to finalise)")
    output = os.path.abspath(output)
    if finalize_only:
        meta = st.finalize_store(output)
        return {"output": output, "finalized": True, "count": meta["count"], "rank": rank}
    pixels = pixel_vae(vae)  # a pixel store: no VAE is ever loaded
    if variant is None:
        variant = "sample" if pixels else "moments"
    elif pixels and variant != "sample":
        raise ValueError("--variant moments needs a VAE's posterior: a pixel store (--vae none) stores the images")
    if not pixels and channels != "auto":
        raise ValueError(f"--channels {channels} is for pixel stores (--vae none); a VAE's latents have its channels")
    options = _repa_options(repa_encoder, repa_weights, repa_image_size)
    plan_path = os.path.join(output, st.PLAN_FILE)
    if options is not None and not overwrite and os.path.exists(plan_path) and not st.shard_status(output)[1]:
        # The latents are all written (the common case: a store extracted long ago): features only.
        return extract_features(
            output, options.encoder, repa_weights, repa_image_size, image_root=image_root, batch_size=batch_size,
            num_workers=num_workers, device=device, rank=rank, world_size=world_size, finalize=finalize,
            progress=progress,
        )  # fmt: skip
    if not image_root:
        raise ValueError("extract needs --image_root: the ImageFolder to encode (root/<class>/<image>)")
    if not os.path.isdir(image_root):
        raise FileNotFoundError(f"--image_root {image_root} is not a directory of class folders")
    if st.contains(output, image_root):
        raise ValueError(
            f"--output {output} contains the images (--image_root {os.path.abspath(image_root)}): the store must be "
            "written to a directory of its own, outside the images"
        )
    if st.contains(image_root, output):
        raise ValueError(
            f"--output {output} lies inside --image_root {os.path.abspath(image_root)}: the store would be read as "
            "images of a class; write it outside the image folder"
        )
    check_writable(output, "output directory", "Choose another --output.")  # before any image is read
    replace = overwrite and os.path.exists(output)
    if replace:
        if world_size > 1:
            raise ValueError("--overwrite true with several processes would race; delete the output once, first")
        st.check_removable_store(output)  # before any work: refuse what is not provably a store

    paths, labels, classes = list_image_folder(image_root)
    if limit is not None:
        paths, labels = paths[:limit], labels[:limit]
    if not paths:
        raise FileNotFoundError(f"no images under {image_root} (extensions: jpg, jpeg, png, ...)")
    if image_size < 1:
        raise ValueError(f"image_size must be a positive number of pixels, got {image_size}")
    for name, value in (("batch_size", batch_size), ("shard_size", shard_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if pixels and scale_factor not in (None, 1.0):
        raise ValueError(f"--scale_factor {scale_factor}: a pixel store holds the images in [-1, 1] at scale 1.0")

    if latent_norm not in ("scale", "channel_stats"):
        raise ValueError(f"--latent_norm {latent_norm!r}: use scale (the VAE's scaling and shift) or channel_stats")
    if latent_norm == "scale" and latent_multiplier != 1.0:
        raise ValueError(
            "--latent_multiplier applies to --latent_norm channel_stats; a scale store takes --scale_factor instead"
        )
    if latent_norm == "channel_stats" and scale_factor is not None:
        raise ValueError(
            f"--scale_factor {scale_factor}: --scale_factor applies to --latent_norm scale; channel_stats measures "
            "its own statistics (drop --scale_factor, or use --latent_multiplier)"
        )
    if not (latent_multiplier > 0 and np.isfinite(latent_multiplier)):
        raise ValueError(f"--latent_multiplier must be a positive number, got {latent_multiplier}")
    if pixels and latent_norm != "scale":
        raise ValueError(
            f"--latent_norm {latent_norm} normalises a VAE's latents; a pixel store (--vae none) holds the images in "
            "[-1, 1] as they are: drop --latent_norm, or extract with a VAE"
        )

    dev = resolve_device(device, local_rank)
    vae_model = None
    if replace:
        if not pixels:
            vae_model = load_vae(vae, dev, getattr(torch, vae_dtype))  # the last input check
        with safe_points():  # a signal waits for the deletion to finish: never half a store
            st.remove_store(output)  # every input check passed: now the old store may go
    recorded_vae = PIXEL_VAE if pixels else vae_reference(vae)  # a local directory by its absolute path
    transform: Optional[Mapping[str, Any]] = None  # pixel stores record none: read as pixels by their vae
    if os.path.exists(os.path.join(output, st.PLAN_FILE)):
        # Resume: the shapes come from the plan, and the VAE is loaded only if work is left.
        old = st.load_plan(output)
        latent_shape, sf = old.latent_shape, old.scale_factor
        if vae_reference(old.vae) == recorded_vae:
            recorded_vae = old.vae  # a store planned before VAE directories were recorded absolute
        if pixels and channels != "auto" and old.latent_shape[0] != channels:
            latent_shape = (int(channels), *old.latent_shape[1:])  # refused by write_plan, naming the field
        if not pixels:
            planned = old.transform
            if planned.kind == "pixels":
                raise st.StoreError(
                    f"{output} already holds a pixel store (--vae none), asked --vae {vae}: choose another --output, "
                    "or replace it with --overwrite true"
                )
            if planned.kind != latent_norm:
                raise st.StoreError(
                    f"{output} already holds a store planned with --latent_norm {planned.kind}, asked {latent_norm}: "
                    "resume with the original settings, choose another --output, or replace it with --overwrite true"
                )
            shift = planned.shift
            transform = old.latent_transform  # None: planned before transforms were recorded (read as scale)
    elif pixels:
        latent_shape, sf = (pixel_channels(image_root, paths, channels), image_size, image_size), 1.0
    else:
        vae_model = vae_model or load_vae(vae, dev, getattr(torch, vae_dtype))
        cfg: Any = vae_model.config  # diffusers' FrozenDict: its keys read as attributes
        down = 2 ** (len(cfg.block_out_channels) - 1)
        if image_size % down:
            raise ValueError(f"image_size {image_size} is not divisible by the VAE's downsampling factor {down}")
        latent_shape = (int(cfg.latent_channels), image_size // down, image_size // down)
        sf = float(getattr(cfg, "scaling_factor", None) or 0.18215)
        shift = float(getattr(cfg, "shift_factor", None) or 0.0)  # SD3 / FLUX VAEs: diffusers' (x - shift) * scale
        transform = {"kind": "scale"}  # filled in below
    if scale_factor is not None:
        sf = float(scale_factor)
    if latent_norm == "channel_stats":
        transform = LatentTransform.channel_stats(multiplier=latent_multiplier).record()  # measured at the end
    elif transform is not None:
        transform = LatentTransform.scaled(sf, shift).record()
    if pixels:  # the spec prepare: images announces, from the same listing
        listing = (paths, labels, classes)
        plan = pixel_store_spec(image_root, image_size, int(latent_shape[0]), flips, storage_dtype, shard_size, listing)
    else:
        plan = st.StoreSpec(
            latent_shape=latent_shape,
            dtype=storage_dtype,
            variant=variant,
            flips=flips,
            scale_factor=sf,
            vae=recorded_vae,
            image_size=image_size,
            shard_size=shard_size,
            **folder_fields(image_root, paths, labels, classes),
            extra=(("seed", int(seed)),) if variant == "sample" else (),
            latent_transform=transform,
        )
    spec = st.write_plan(output, plan)

    done, missing = st.shard_status(output, spec)
    mine = [k for k in missing if k % world_size == rank]
    resumed = sum(1 for k in done if k % world_size == rank)
    show = progress and local_rank == 0
    stats = {"images": 0, "skipped": 0, "converted": 0, "shards_written": 0, "features_written": 0}
    stats["features_images"] = 0
    repa = _setup_repa(output, spec, options, dev) if options is not None else None
    recorded = st.load_features_plan(output, REPA_FEATURES) if repa is None and missing else None
    if recorded is not None:
        raise st.StoreError(
            f"{output} is being extracted with REPA features ({recorded.plan_file}: --repa_encoder "
            f"{recorded.source.get('encoder')}); resume with the same --repa_encoder / --repa_weights / "
            "--repa_image_size, so that every shard has them"
        )

    if mine:
        if vae_model is None and not pixels:
            vae_model = load_vae(vae, dev, getattr(torch, vae_dtype))

        def stopped() -> str:
            have = len(st.shard_status(output, spec)[0])
            return (
                f"{have} of {spec.num_shards} shards of {output} are written (each whole); run the same command "
                "again to resume from there"
            )

        # A signal stops before the next batch: the shard in progress is dropped, never half-written.
        with safe_points(), on_stop(stopped):
            _encode_shards(
                output, spec, image_root, paths, labels, mine, vae_model, dev, batch_size, num_workers, seed, show,
                stats, label=f"{rank}/{world_size}", repa=repa,
            )  # fmt: skip
    if repa is not None:
        # Shards committed by an earlier run without features (this run writes them with theirs).
        job = _FeaturesJob(output, spec, repa, image_root, batch_size, num_workers, dev, show, stats, rank, world_size)
        _run_features(job)

    finalized = False
    meta_count = None
    if finalize and _finalize_if_done(output, spec, repa.sets if repa is not None else ()):
        finalized = True
        meta_count = st.store_info(output)["count"]
    seconds = time.perf_counter() - t0
    summary = {
        "output": output,
        "rank": rank,
        "world_size": world_size,
        "device": str(dev),
        "shards_total": spec.num_shards,
        "shards_written": stats["shards_written"],
        "shards_already_done": resumed,
        "images_done": stats["images"],
        "images_skipped": stats["skipped"],
        "images_converted": stats["converted"],
        "features_written": stats["features_written"],
        "seconds": round(seconds, 3),
        "images_per_s": round(stats["images"] / seconds, 2) if seconds > 0 else 0.0,
        "output_bytes": _dir_bytes(output),
        "finalized": finalized,
        "count": meta_count,
        "report": os.path.join(output, st.REPORT_FILE) if finalized else None,
    }
    if progress:
        _print_summary(summary)
    if finalized and meta_count == 0:
        raise ValueError(
            f"none of the {len(paths)} files under {image_root} could be read as an image: every one was skipped "
            f"(the reason for each is in {summary['report']}). The store at {output} is empty: check the files "
            "and --image_root, then run again with --overwrite true"
        )
    return summary


def _encode_shards(
    output: str,
    spec: st.StoreSpec,
    image_root: str,
    paths: list[str],
    labels: list[int],
    shards: list[int],
    vae_model: Optional[Any],
    dev: torch.device,
    batch_size: int,
    num_workers: int,
    seed: int,
    show: bool,
    stats: dict[str, int],
    label: str = "0/1",
    repa: Optional[_Repa] = None,
) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    # Batches never cross a shard boundary, so a shard's content (and its bytes) does not
    # depend on which shards this run happens to do.
    batches: list[list[int]] = []
    for k in shards:
        a, b = spec.shard_range(k)
        batches.extend(list(range(s, min(b, s + batch_size))) for s in range(a, b, batch_size))
    pixels = vae_model is None  # a pixel store: the cropped images are the data
    channels = spec.latent_shape[0] if pixels else 3
    loader = _image_loader(image_root, paths, spec.image_size, batches, num_workers, dev, channels)
    noise = NoiseKernel(int(np.prod(spec.latent_shape))) if spec.variant == "sample" and not pixels else None
    exit_after, exit_mid = _exit_plan()
    vae_dtype = next(vae_model.parameters()).dtype if vae_model is not None else torch.float32
    total = sum(spec.shard_range(k)[1] - spec.shard_range(k)[0] for k in shards)

    pending: dict[str, list] = {"data": [], "features": [], "labels": [], "sources": [], "report": []}
    shard_iter = iter(shards)
    current = next(shard_iter)
    cur_end = spec.shard_range(current)[1]

    lines = _LogLines(f"extract rank {label}", total, show)
    with Progress(
        TextColumn(f"[bold]extract[/] rank {label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]} img/s"),
        TimeRemainingColumn(),
        disable=not show or lines.on,
        transient=False,
    ) as bar:
        task = bar.add_task("extract", total=total, rate="-")
        t_start = time.perf_counter()
        for batch in loader:
            stop_point()  # (dit_lightning.signals)
            items = batch["items"]
            ok = [it for it in items if it["error"] is None]
            for it in items:
                if it["error"] is not None:
                    pending["report"].append({"path": paths[it["i"]], "status": "skipped", "reason": it["error"]})
                    stats["skipped"] += 1
                elif it["note"]:
                    pending["report"].append({"path": paths[it["i"]], "status": "converted", "reason": it["note"]})
                    stats["converted"] += 1
            if ok:
                if pixels:
                    data = _pixels(batch["x"], spec)
                else:
                    data = _encode(vae_model, batch["x"], dev, vae_dtype, spec, noise, seed, [it["i"] for it in ok])
                pending["data"].append(data)
                if repa is not None:
                    # the very image the VAE encoded, in [0, 1], and its mirror (flip 1, as for the latents)
                    x = (batch["x"] + 1) / 2
                    pending["features"].append(  # the patch features and the class token, one pass
                        repa.features(torch.stack([x, x.flip(-1)], 1) if spec.flips else x[:, None])
                    )
                pending["labels"].extend(labels[it["i"]] for it in ok)
                pending["sources"].extend(paths[it["i"]] for it in ok)
                stats["images"] += len(ok)
            bar.update(
                task,
                advance=len(items),
                rate=f"{stats['images'] / max(1e-9, time.perf_counter() - t_start):.1f}",
            )
            lines.advance(len(items))
            if items[-1]["i"] + 1 == cur_end:
                hook = None
                if exit_after is not None and exit_mid and stats["shards_written"] == exit_after:
                    hook = lambda: os._exit(17)  # noqa: E731
                data = (
                    np.concatenate(pending["data"])
                    if pending["data"]
                    else np.zeros((0, *spec.sample_shape), spec.np_dtype)
                )
                features: list[tuple[st.FeatureSpec, np.ndarray]] = []
                if repa is not None:
                    found = pending["features"]
                    values = [np.concatenate(v) for v in zip(*found)] if found else repa.empty(spec)
                    features = list(zip(repa.sets, values))
                st.write_shard(
                    output,
                    current,
                    spec,
                    data,
                    np.asarray(pending["labels"], np.int32),
                    pending["sources"],
                    pending["report"],
                    after_data_hook=hook,
                    features=features,
                )
                stats["shards_written"] += 1
                if exit_after is not None and not exit_mid and stats["shards_written"] == exit_after:
                    os._exit(17)
                pending = {"data": [], "features": [], "labels": [], "sources": [], "report": []}
                current = next(shard_iter, -1)
                cur_end = spec.shard_range(current)[1] if current >= 0 else -1


@torch.inference_mode()
def _encode(
    vae_model: Any,
    x: torch.Tensor,
    dev: torch.device,
    vae_dtype: torch.dtype,
    spec: st.StoreSpec,
    noise: Optional[NoiseKernel],
    seed: int,
    items: list[int],
) -> np.ndarray:
    """(n, F, K, C, H, W) in the storage dtype for one batch of preprocessed images."""
    x = x.to(dev, non_blocking=True).to(vae_dtype)
    n = x.shape[0]
    if spec.flips:
        x = torch.cat([x, x.flip(-1)])  # one forward for the images and their mirrors
    dist = vae_model.encode(x).latent_dist
    mean, logvar = dist.mean.float(), dist.logvar.float()
    if tuple(mean.shape[1:]) != spec.latent_shape:
        raise RuntimeError(f"the VAE produced latents {tuple(mean.shape[1:])}, the store expects {spec.latent_shape}")
    F = spec.num_flips
    mean = mean.reshape(F, n, *spec.latent_shape).transpose(0, 1)  # (n, F, C, H, W)
    logvar = logvar.reshape(F, n, *spec.latent_shape).transpose(0, 1)
    if spec.variant == "moments":
        out = torch.stack([mean, logvar], dim=2)  # (n, F, 2, C, H, W)
    else:
        assert noise is not None
        # noise keyed by (seed, file index, flip): identical however the work is split or resumed
        keys = (np.asarray(items, np.int64)[:, None] * F + np.arange(F)).reshape(-1)
        m = mean.reshape(n * F, -1).cpu().numpy()
        lv = logvar.reshape(n * F, -1).cpu().numpy()
        z = noise.posterior_sample(m, lv, seed, _SAMPLE_EPOCH, keys, 1.0)
        out = torch.from_numpy(z).reshape(n, F, 1, *spec.latent_shape)
    return _to_storage(out.contiguous(), spec.dtype)


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console

    c = Console(stderr=True)
    mb = summary["output_bytes"] / 2**20
    c.print(
        f"[bold]extract[/] rank {summary['rank']}/{summary['world_size']} on {summary['device']}: "
        f"{summary['images_done']} images encoded, {summary['images_skipped']} skipped, "
        f"{summary['images_converted']} converted, {summary['shards_written']} shards written "
        f"({summary['shards_already_done']} already done) in {summary['seconds']:.1f}s "
        f"({summary['images_per_s']:.1f} img/s); store {mb:.1f} MiB, "
        + ("finalised" if summary["finalized"] else "not finalised yet (other shards pending)")
    )
    if summary["finalized"] and summary["images_skipped"]:
        c.print(f"skipped files are listed in {summary['report']}")
