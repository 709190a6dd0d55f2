"""Sampling from DiT checkpoints: per-sample deterministic, distributed, resumable.

``dit-lightning sample --checkpoint DiT-XL-2-256x256.pt --output samples/ --num_samples 50000``
reads any supported checkpoint (Lightning, reference ``{model, ema, opt, args}`` or the
released raw state dict; the architecture is inferred from the weights), samples class-
conditional latents with DDPM or DDIM (with classifier-free guidance), decodes them with the
VAE, and writes one PNG per sample, a grid and an ADM-evaluator ``.npz``.

Determinism: every random number of sample ``i`` (its label when labels are "random", its
initial noise, the noise of every DDPM / DDIM step) is a pure function of ``(seed, i, step)``
drawn with :mod:`dit_lightning.keyed_random`, not of a sequential generator. So sample ``i``
is the same image whatever the batch size, the number of ranks or the resume point (up to
the last-bit differences batched GEMMs of different sizes may show). ``DiTModule.sample``
draws from one ``torch.Generator`` per call, which ties the noise to the batch composition;
that is why the loop here is its own (it reuses the diffusion's ``p_mean_variance`` and the
model's ``forward_with_cfg``).

Layout of an output directory::

    sample_config.json   the settings that determine the images (a resume must match them)
    samples/000123-c207.png   sample 123, class 207 (written atomically: tmp + rename)
    grid.png             the first ``grid_size`` samples
    samples.npz          key ``arr_0``: uint8 (N, H, W, 3), assembled from the PNGs once all exist
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import numpy as np
import torch
from torch import Tensor, nn

from .diffusion import SpacedDiffusion, create_diffusion
from .keyed_random import keyed_normal, keyed_randint, sample_keys
from .models.checkpoint import infer_dit_config, load_dit_weights, read_checkpoint
from .models.dit import DIT_CONFIGS, DiT, dit_config

Sampler = Literal["ddpm", "ddim"]
Precision = Literal["fp32", "bf16", "fp16"]
Weights = Literal["ema", "raw"]
LabelSpec = Union[str, list[int]]

DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
DEFAULT_SCALE_FACTOR = 0.18215
PIXEL_VAE_PREFIX = "none"  # "none/pixels": the store holds pixels in [-1, 1]

# Keys of the counter-based random numbers; fixed forever, since they define which image
# sample i is for a given seed.
_KEY_LABEL, _KEY_INIT, _KEY_STEP = 0x1AB, 0x1E1, 0x57E
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
_PNG = re.compile(r"^(\d+)-c(\d+)\.png$")


# --------------------------------------------------------------------------------------
# Labels
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LabelPlan:
    """Which class sample ``i`` gets: ``classes[i % len(classes)]``, or keyed-random.

    Both are pure functions of ``i``, so a run can be extended (10K -> 50K samples) or split
    over ranks without changing the labels of the samples already written.
    """

    classes: Optional[tuple[int, ...]]  # None: random
    num_classes: int
    seed: int = 0

    def __call__(self, indices: Union[Tensor, np.ndarray, Sequence[int]]) -> Tensor:
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        if self.classes is None:
            return keyed_randint(sample_keys(idx, self.seed, _KEY_LABEL), self.num_classes)
        table = torch.tensor(self.classes, dtype=torch.long)
        return table[idx % len(table)]

    def describe(self) -> str:
        return "random" if self.classes is None else ",".join(map(str, self.classes))


def parse_labels(labels: LabelSpec, num_classes: int, seed: int = 0) -> LabelPlan:
    """``"random"``, ``"all"``, ranges and lists (``"0-9"``, ``"1,5,88-90"``) or a list of ints."""
    if isinstance(labels, str):
        text = labels.strip().lower()
        if text == "random":
            return LabelPlan(None, num_classes, seed)
        if text == "all":
            return LabelPlan(tuple(range(num_classes)), num_classes, seed)
        classes: list[int] = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
            if m:
                lo, hi = int(m.group(1)), int(m.group(2))
                if hi < lo:
                    raise ValueError(f"empty label range {part!r}")
                classes.extend(range(lo, hi + 1))
            elif part.isdigit():
                classes.append(int(part))
            else:
                raise ValueError(f"cannot parse labels {labels!r}: use 'random', 'all', '0-9' or '1,5,7'")
    else:
        classes = [int(c) for c in labels]
    if not classes:
        raise ValueError("no class labels given")
    bad = [c for c in classes if not 0 <= c < num_classes]
    if bad:
        raise ValueError(f"labels {bad[:5]} outside the model's {num_classes} classes (0..{num_classes - 1})")
    return LabelPlan(tuple(classes), num_classes, seed)


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


@dataclass
class LoadedModel:
    """A DiT ready to sample and what its checkpoint says about the diffusion and the VAE."""

    net: DiT
    config: dict[str, Any]
    format: str
    weights: str
    noise_schedule: str = "linear"
    diffusion_steps: int = 1000
    vae: Optional[str] = None
    defaults: dict[str, Any] = field(default_factory=dict)


def _checkpoint_format(path: str, args: Optional[dict]) -> str:
    if args is None:
        return "raw"
    return "lightning" if "eval_weights" in args or "latent_shape" in args else "reference"


def _heads_from_args(args: Optional[dict]) -> Optional[int]:
    """Attention heads are not visible in a state dict: take them from the checkpoint's args."""
    if not args:
        return None
    if args.get("num_heads"):
        return int(args["num_heads"])
    config = args.get("model_config")
    if isinstance(config, dict) and config.get("num_heads"):
        return int(config["num_heads"])
    name = args.get("model")
    if isinstance(name, str) and name != "custom":
        try:
            return dit_config(name)["num_heads"]
        except ValueError:
            return None
    return None


def _vae_from_args(args: Optional[dict]) -> Optional[str]:
    vae = (args or {}).get("vae")
    if not isinstance(vae, str) or not vae:
        return None
    # The reference training script's --vae is "ema" or "mse" (the two sd-vae-ft VAEs).
    return f"stabilityai/sd-vae-ft-{vae}" if vae in ("ema", "mse") else vae


def load_model(
    checkpoint: str, weights: Weights = "ema", num_heads: Optional[int] = None, device: Union[str, torch.device] = "cpu"
) -> LoadedModel:
    """Build the DiT a checkpoint holds, with no model config: sizes from the weights, heads from
    the checkpoint's args (or the named configuration with that depth/width/patch)."""
    ckpt = read_checkpoint(checkpoint)
    args = ckpt["args"]
    fmt = _checkpoint_format(checkpoint, args)
    if weights == "ema" and ckpt["ema"] is None:
        print(f"note: '{checkpoint}' has no EMA weights; sampling with the raw weights", file=sys.stderr)
    sd = ckpt["ema"] if weights == "ema" and ckpt["ema"] is not None else ckpt["model"]
    assert sd is not None
    config = infer_dit_config(sd)
    heads = num_heads or _heads_from_args(args)
    if heads:
        config["num_heads"] = heads
    elif not any(c["hidden_size"] == config["hidden_size"] and c["depth"] == config["depth"] for c in DIT_CONFIGS.values()):
        print(
            f"note: the head count of this custom DiT is not recorded in '{checkpoint}'; assuming "
            f"{config['num_heads']} (hidden/64). Pass num_heads if it was trained with another.",
            file=sys.stderr,
        )
    net = DiT(**config)
    load_dit_weights(net, sd, source=f"checkpoint '{checkpoint}'")
    net = net.to(device).eval().requires_grad_(False)
    a = args or {}
    defaults = {k: a[k] for k in ("sample_steps", "sampler", "cfg_scale", "guide_channels") if k in a and fmt == "lightning"}
    return LoadedModel(
        net=net,
        config=config,
        format=fmt,
        weights="ema" if sd is ckpt["ema"] else "raw",
        noise_schedule=str(a.get("noise_schedule") or "linear"),
        diffusion_steps=int(a.get("diffusion_steps") or 1000),
        vae=_vae_from_args(args),
        defaults=defaults,
    )


# --------------------------------------------------------------------------------------
# The sampling loop (generator-free: every draw keyed on (seed, sample index, step))
# --------------------------------------------------------------------------------------


def build_sampling_diffusion(
    sampler: Sampler, num_steps: int, noise_schedule: str = "linear", diffusion_steps: int = 1000, learn_sigma: bool = True
) -> SpacedDiffusion:
    """The respaced process: ``"250"`` for DDPM; ``"ddimN"`` (even stride) for DDIM where N
    divides the steps that way, else the section respacing of N steps."""
    if num_steps < 2 or num_steps > diffusion_steps:
        # One step has no posterior variance to interpolate (the learned-range variance needs t=1).
        raise ValueError(f"num_steps must be in 2..{diffusion_steps}, got {num_steps}")
    respacing = str(num_steps)
    if sampler == "ddim" and any(len(range(0, diffusion_steps, s)) == num_steps for s in range(1, diffusion_steps)):
        respacing = f"ddim{num_steps}"
    return create_diffusion(respacing, noise_schedule=noise_schedule, learn_sigma=learn_sigma, diffusion_steps=diffusion_steps)


def initial_noise(indices: Tensor, shape: Sequence[int], seed: int) -> Tensor:
    """x_T of samples ``indices``: (N, *shape) float32, a pure function of (seed, index)."""
    return keyed_normal(sample_keys(indices.long(), seed, _KEY_INIT), shape)


def step_noise(indices: Tensor, shape: Sequence[int], seed: int, step: int) -> Tensor:
    """The noise sample ``i`` gets at sampling step ``step`` (0 = the first, at t = T-1)."""
    return keyed_normal(sample_keys(indices.long(), seed, _KEY_STEP, step), shape)


def guided_model_fn(
    net: DiT, cfg_scale: float, guide_channels: Optional[int] = None, precision: Precision = "fp32", force_cfg: bool = False
) -> Callable[..., Tensor]:
    """``fn(x, t, y)`` -> model output for the (un-doubled) batch ``x``.

    With guidance the batch is doubled to ``[x, x]`` with labels ``[y, null]`` and combined by
    ``net.forward_with_cfg`` (``guide_channels=3``: the reference's published-FID variant); the
    first half is returned. Scale 1 skips the doubled batch (same result, half the cost)
    unless ``force_cfg``. The network runs under autocast for bf16/fp16; the output is float32.
    """
    dtype = _AUTOCAST.get(precision)

    def run(x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        if cfg_scale == 1.0 and not force_cfg:
            return net(x, t, y)
        n = x.shape[0]
        null = torch.full_like(y, net.num_classes)
        out = net.forward_with_cfg(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]), cfg_scale, guide_channels)
        return out[:n]

    def fn(x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        if dtype is None:
            return run(x, t, y).float()
        with torch.autocast(device_type=x.device.type, dtype=dtype):
            return run(x, t, y).float()

    return fn


@torch.no_grad()
def sample_latents(
    net: DiT,
    labels: Union[Tensor, Sequence[int]],
    indices: Optional[Union[Tensor, Sequence[int]]] = None,
    *,
    seed: int = 0,
    sampler: Sampler = "ddpm",
    num_steps: int = 250,
    eta: float = 0.0,
    cfg_scale: float = 1.0,
    guide_channels: Optional[int] = None,
    precision: Precision = "fp32",
    noise_schedule: str = "linear",
    diffusion_steps: int = 1000,
    noise: Optional[Tensor] = None,
    noise_fn: Optional[Callable[[int, Tensor], Tensor]] = None,
    model_fn: Optional[Callable[..., Tensor]] = None,
    clip_denoised: bool = False,
) -> Tensor:
    """Latents (N, C, H, W) for ``labels``, sample ``indices[k]`` drawn from keys (seed, index).

    ``indices`` default to ``0..N-1``. ``noise`` overrides x_T; ``noise_fn(step, x)`` overrides
    the per-step noise (tests use it to replay a ``torch.Generator``). DDPM is ancestral
    sampling with the learned variance; DDIM ignores the variance and adds ``eta``-scaled
    noise (eta 0: deterministic given x_T).

    ``clip_denoised`` clamps every step's estimate of x_0 to [-1, 1] (both samplers). Off by
    default: VAE latents are unbounded and DiT's published numbers sample them unclipped.
    Pixel stores should pass ``clip_denoised_for(vae)`` (True): their data lie in [-1, 1], and
    without the clamp a step where alphas_cumprod is tiny turns a small epsilon error into a
    huge x_0 (the cosine schedule's last step, acp ~ 2.4e-9, multiplies it by ~2e4) that
    ancestral sampling carries into the next inputs of the network.
    """
    device = next(net.parameters()).device
    y = torch.as_tensor(labels, dtype=torch.long).to(device)
    n = y.shape[0]
    idx = torch.arange(n) if indices is None else torch.as_tensor(indices, dtype=torch.long)
    if idx.shape != (n,):
        raise ValueError(f"{n} labels but indices of shape {tuple(idx.shape)}")
    shape = (net.in_channels, net.input_size, net.input_size)
    diffusion = build_sampling_diffusion(sampler, num_steps, noise_schedule, diffusion_steps, net.learn_sigma)
    fn = model_fn or guided_model_fn(net, cfg_scale, guide_channels, precision)
    if noise_fn is None:
        idx_dev = idx.to(device)

        def noise_fn(step: int, like: Tensor) -> Tensor:
            return step_noise(idx_dev, shape, seed, step).to(like.dtype)

    x = (noise if noise is not None else initial_noise(idx.to(device), shape, seed)).to(device, torch.float32)
    if tuple(x.shape) != (n, *shape):
        raise ValueError(f"noise of shape {tuple(x.shape)}, expected {(n, *shape)}")
    if sampler not in ("ddpm", "ddim"):
        raise ValueError(f"sampler must be 'ddpm' or 'ddim', got {sampler!r}")
    was_training = net.training
    net.eval()
    common = dict(noise=x, clip_denoised=clip_denoised, model_kwargs={"y": y}, device=device, noise_fn=noise_fn)
    try:
        if sampler == "ddpm":
            x = diffusion.p_sample_loop(fn, x.shape, **common)
        else:
            x = diffusion.ddim_sample_loop(fn, x.shape, eta=eta, **common)
    finally:
        net.train(was_training)
    return x


class SampleRequests(torch.utils.data.Dataset):
    """Items ``{"index", "y"}`` for samples ``indices``: a predict dataloader for
    ``DiTModule.predict_step`` (``Trainer.predict`` shards it over ranks)."""

    def __init__(self, indices: Sequence[int], plan: LabelPlan) -> None:
        self.indices = torch.as_tensor(list(indices), dtype=torch.long)
        self.labels = plan(self.indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> dict[str, Tensor]:
        return {"index": self.indices[k], "y": self.labels[k]}


# --------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------


def is_pixel_space(vae: Optional[str]) -> bool:
    return not vae or vae.startswith(PIXEL_VAE_PREFIX)


def clip_denoised_for(vae: Optional[str]) -> bool:
    """The ``clip_denoised`` a store decoded by ``vae`` samples with: True for pixel stores
    (values known to lie in [-1, 1], as ADM samples pixel models), False for VAE latents
    (unbounded; the DiT paper's setting)."""
    return is_pixel_space(vae)


def load_vae(name: str, device: Union[str, torch.device] = "cpu") -> nn.Module:
    """diffusers ``AutoencoderKL`` from a hub id or a local ``save_pretrained`` directory (fp32)."""
    from diffusers.models import AutoencoderKL

    try:
        vae = AutoencoderKL.from_pretrained(name)
    except Exception as e:
        raise RuntimeError(
            f"cannot load the VAE {name!r} ({type(e).__name__}: {e}). Offline, pass a local directory "
            "written by AutoencoderKL.save_pretrained (or have the hub id in the Hugging Face cache)."
        ) from e
    return vae.to(device).eval().requires_grad_(False)


@torch.no_grad()
def decode_latents(
    latents: Tensor, vae: Optional[Union[str, nn.Module]], scale_factor: float = DEFAULT_SCALE_FACTOR
) -> Tensor:
    """Images in [0, 1] (N, C, H, W): ``(x + 1) / 2`` for pixel stores, else ``vae.decode(z / s)``.

    The VAE runs in fp32 whatever the sampling precision: decoding is a small share of the
    cost and the SD decoders are the part most sensitive to reduced precision.
    """
    if vae is None or isinstance(vae, str):
        if is_pixel_space(vae):
            return ((latents.float() + 1) / 2).clamp(0, 1)
        vae = load_vae(vae, latents.device)
    images = vae.decode(latents.float() / scale_factor).sample
    return ((images.float() + 1) / 2).clamp(0, 1)


def to_uint8(images: Tensor) -> np.ndarray:
    """[0, 1] (N, C, H, W) -> uint8 (N, H, W, C), rounded (as ``clamp(127.5 x + 128)`` on [-1, 1])."""
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------


def png_name(index: int, label: int) -> str:
    return f"{index:06d}-c{label}.png"


def _atomic_save_image(array: np.ndarray, path: Path, tmp_tag: str) -> None:
    from PIL import Image

    image = Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)
    tmp = path.with_name(f".{path.name}.{tmp_tag}.tmp")
    image.save(tmp, format="PNG")
    os.replace(tmp, path)


def load_png_rgb(path: Union[str, Path]) -> np.ndarray:
    """uint8 (H, W, 3); grayscale expanded to three channels."""
    from PIL import Image

    with Image.open(path) as im:
        return np.array(im.convert("RGB"))  # a writable copy


def existing_samples(samples_dir: Union[str, Path]) -> dict[int, Path]:
    """Complete sample PNGs by index (atomic writes: a listed name is a complete file)."""
    out: dict[int, Path] = {}
    d = Path(samples_dir)
    if not d.is_dir():
        return out
    for entry in os.scandir(d):
        m = _PNG.match(entry.name)
        if m:
            out[int(m.group(1))] = Path(entry.path)
    return out


def write_npz_from_pngs(paths: Sequence[Union[str, Path]], output: Union[str, Path]) -> Path:
    """The ADM evaluator's sample batch: ``.npz`` with ``arr_0`` uint8 (N, H, W, 3).

    Streamed image by image into the (uncompressed) zip member, so 50K 256px samples
    (9.8 GB) never need to be in memory at once; written to a temporary file, then renamed.
    ``np.load(output)["arr_0"]`` reads it like an ``np.savez`` file.
    """
    output = Path(output)
    if not paths:
        raise ValueError("no images to write")
    first = load_png_rgb(paths[0])
    shape = (len(paths), *first.shape)
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            with zf.open("arr_0.npy", "w", force_zip64=True) as f:
                header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False, "shape": shape}
                np.lib.format.write_array_header_1_0(f, header)
                for k, p in enumerate(paths):
                    arr = first if k == 0 else load_png_rgb(p)
                    if arr.shape != first.shape:
                        raise ValueError(f"{p} is {arr.shape[1]}x{arr.shape[0]}, the others {first.shape[1]}x{first.shape[0]}")
                    f.write(np.ascontiguousarray(arr).tobytes())
        os.replace(tmp, output)
    finally:
        if tmp.exists():
            tmp.unlink()
    return output


def make_grid_image(images: Tensor, nrow: int) -> Tensor:
    """(N, C, H, W) in [0, 1] -> one (3, H', W') grid with ``nrow`` images per row."""
    from torchvision.utils import make_grid

    if images.shape[1] == 1:
        images = images.expand(-1, 3, -1, -1)
    return make_grid(images.float().cpu(), nrow=nrow, padding=1, pad_value=1.0)


def save_png(grid: Tensor, path: str | Path, upscale: int = 1) -> Path:
    """Write a (3, H, W) [0, 1] grid as a PNG, nearest-upscaled so small digits stay visible."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    array = (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    image = Image.fromarray(array)
    if upscale > 1:
        image = image.resize((image.width * upscale, image.height * upscale), Image.NEAREST)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    image.save(tmp, format="PNG")
    tmp.replace(path)
    return path


def write_grid(paths: Sequence[Union[str, Path]], output: Union[str, Path], nrow: Optional[int] = None) -> Path:
    """A grid PNG of the given samples; small images are magnified (nearest) to >= 64 px."""
    images = torch.stack([torch.from_numpy(load_png_rgb(p)).permute(2, 0, 1) for p in paths]).float() / 255
    nrow = nrow or max(1, math.ceil(math.sqrt(len(paths))))
    return save_png(make_grid_image(images, nrow), output, upscale=max(1, math.ceil(64 / images.shape[-1])))


def write_json_atomic(path: Union[str, Path], obj: Any) -> None:
    """``obj`` as indented JSON at ``path``, written to a temporary name and renamed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------
# Distribution
# --------------------------------------------------------------------------------------


def resolve_rank(rank: Optional[int] = None, world_size: Optional[int] = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the arguments, torch.distributed, or torchrun's env."""
    dist = torch.distributed
    if rank is None or world_size is None:
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        else:
            rank = int(os.environ.get("RANK", 0)) if rank is None else rank
            world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    return rank, world_size, int(os.environ.get("LOCAL_RANK", rank))


def resolve_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return dev


def _maybe_init_process_group(world_size: int, explicit: bool, device: torch.device) -> bool:
    """Join torchrun's process group (for the final barrier) when launched by it; True if we did."""
    dist = torch.distributed
    if explicit or world_size == 1 or not dist.is_available() or dist.is_initialized():
        return False
    if "MASTER_ADDR" not in os.environ:
        return False
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return True


def rank_indices(num_samples: int, rank: int, world_size: int) -> range:
    """Strided shares: rank r gets r, r+W, r+2W... (disjoint, together exactly 0..N-1)."""
    return range(rank, num_samples, world_size)


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------

# Settings that determine the pixels of sample i; a resumed run must match them exactly.
_IMAGE_KEYS = (
    "weights_fingerprint", "weights", "labels", "sampler", "num_steps", "eta",
    "cfg_scale", "guide_channels", "seed", "precision", "vae", "scale_factor", "num_heads",
    "noise_schedule", "diffusion_steps", "clip_denoised",
)  # fmt: skip
# What a key absent from an older sample_config.json meant (those runs never clipped).
_IMAGE_KEY_DEFAULTS: dict[str, Any] = {"clip_denoised": False}


def weights_fingerprint(net: nn.Module) -> str:
    """A short hash of a few trained tensors: tells two checkpoints apart (a ``last.ckpt``
    overwritten by more training keeps its name and size) without hashing gigabytes."""
    import hashlib

    sd = net.state_dict()
    h = hashlib.sha1()
    for name in ("final_layer.linear.weight", "final_layer.adaLN_modulation.1.weight", "y_embedder.embedding_table.weight"):
        h.update(sd[name].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _check_or_write_config(path: Path, config: dict[str, Any]) -> None:
    if path.exists():
        old = json.loads(path.read_text())
        before = {k: old.get(k, _IMAGE_KEY_DEFAULTS.get(k)) for k in _IMAGE_KEYS}
        diff = {k: (before[k], config.get(k)) for k in _IMAGE_KEYS if before[k] != config.get(k)}
        if diff:
            desc = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"{path.parent} holds samples made with other settings ({desc}). Resuming would mix "
                "images of two runs: use another output directory, or delete this one."
            )
        if old.get("num_samples", 0) >= config["num_samples"]:
            return
    write_json_atomic(path, config)


def _log(msg: str, enabled: bool) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)


def _chunks(seq: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    for start in range(0, len(seq), size):
        yield seq[start : start + size]


def sample(
    checkpoint: str,
    output: str,
    num_samples: Optional[int] = None,
    labels: LabelSpec = "random",
    sampler: Optional[Sampler] = None,
    num_steps: Optional[int] = None,
    eta: float = 0.0,
    cfg_scale: Optional[float] = None,
    guide_channels: Optional[int] = None,
    seed: int = 0,
    batch_size: int = 32,
    precision: Precision = "fp32",
    weights: Weights = "ema",
    vae: Optional[str] = None,
    scale_factor: Optional[float] = None,
    clip_denoised: Optional[bool] = None,
    num_heads: Optional[int] = None,
    device: str = "auto",
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    grid_size: int = 64,
    grid_nrow: Optional[int] = None,
    write_npz: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Sample images from a DiT checkpoint into ``output`` (PNGs, grid, ADM ``.npz``).

    Args:
        checkpoint: Lightning ``.ckpt``, reference ``{model, ema, opt, args}`` or a raw state
            dict like the released ``DiT-XL-2-256x256.pt``; no model config is needed.
        output: directory; rerunning with the same settings resumes (existing PNGs are kept).
        num_samples: images to make (default: one per entry of an explicit label list).
        labels: "random" (keyed on seed and index), "all", "0-9", "1,5,7" or a list; an
            explicit list is cycled: sample i gets ``labels[i % len(labels)]``.
        sampler, num_steps: "ddpm" (ancestral, learned variance) or "ddim"; respaced steps.
            Default: the Lightning checkpoint's sampling settings, else DDPM 250.
        eta: DDIM noise (0 deterministic).
        cfg_scale: classifier-free guidance scale (1: none; the paper's best FID used 1.5).
        guide_channels: guide only the first N epsilon channels; 3 reproduces the reference
            implementation the published FIDs were computed with; default all (correct).
        seed: key of every random number; sample i depends only on (seed, i).
        batch_size: samples per forward (per rank); does not change the images.
        precision: autocast of the DiT: "fp32", "bf16" or "fp16" (changes the images slightly).
        weights: "ema" (default) or "raw" training weights.
        vae: hub id or local directory of a diffusers AutoencoderKL, or "none/pixels" for pixel
            stores; default: the checkpoint's, else sd-vae-ft-ema for 4-channel latents.
        scale_factor: latent scale (default 0.18215 for a VAE).
        clip_denoised: clamp each step's x_0 estimate to [-1, 1]; default: on for pixel stores
            (``vae`` "none/pixels"), off for VAE latents (the published setting).
        num_heads: attention heads, when a raw checkpoint of a custom size does not match hidden/64.
        device: "auto", "cpu", "cuda"; under torchrun each rank takes cuda:LOCAL_RANK.
        rank, world_size: this process's share (default: torch.distributed, then RANK /
            WORLD_SIZE from torchrun); ranks may also run as separate jobs with these flags.
        grid_size, grid_nrow: images in grid.png and per row.
        write_npz: assemble ``samples.npz`` once every PNG exists (rank 0 after a barrier
            under torchrun; otherwise whichever process finds the set complete).
        progress: print progress to stderr.
    """
    t_start = time.perf_counter()
    # Ranks given as arguments (separate jobs, tests) need no process group: the last one to
    # finish assembles the npz. Under torchrun we join its group for a final barrier.
    explicit_rank = rank is not None and world_size is not None
    rank, world_size, local_rank = resolve_rank(rank, world_size)
    dev = resolve_device(device, local_rank)
    own_group = _maybe_init_process_group(world_size, explicit_rank, dev)
    try:
        loaded = load_model(checkpoint, weights=weights, num_heads=num_heads, device=dev)
        net = loaded.net
        d = loaded.defaults
        sampler = sampler or d.get("sampler") or "ddpm"
        num_steps = num_steps or d.get("sample_steps") or 250
        cfg_scale = float(d.get("cfg_scale", 1.0) if cfg_scale is None else cfg_scale)
        guide_channels = d.get("guide_channels") if guide_channels is None else guide_channels
        vae_name = vae or loaded.vae or (DEFAULT_VAE if net.in_channels == 4 else "none/pixels")
        pixels = is_pixel_space(vae_name)
        if pixels and net.in_channels not in (1, 3):
            raise ValueError(f"{net.in_channels}-channel latents need a VAE to decode: pass vae (e.g. {DEFAULT_VAE})")
        scale = float(scale_factor if scale_factor is not None else (1.0 if pixels else DEFAULT_SCALE_FACTOR))
        clip = clip_denoised_for(vae_name) if clip_denoised is None else bool(clip_denoised)
        plan = parse_labels(labels, net.num_classes, seed)
        if num_samples is None:
            if plan.classes is None:
                raise ValueError("labels='random' needs num_samples")
            num_samples = len(plan.classes)
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")

        out = Path(output)
        samples_dir = out / "samples"
        samples_dir.mkdir(parents=True, exist_ok=True)
        config = {
            "checkpoint": str(checkpoint),
            "weights_fingerprint": weights_fingerprint(net),
            "checkpoint_format": loaded.format,
            "model": {k: loaded.config[k] for k in ("depth", "hidden_size", "num_heads", "patch_size", "in_channels", "input_size", "num_classes")},
            "weights": loaded.weights,
            "labels": plan.describe(),
            "num_samples": int(num_samples),
            "sampler": sampler,
            "num_steps": int(num_steps),
            "eta": float(eta) if sampler == "ddim" else 0.0,
            "cfg_scale": cfg_scale,
            "guide_channels": guide_channels,
            "seed": int(seed),
            "precision": precision,
            "vae": vae_name,
            "scale_factor": scale,
            "num_heads": loaded.config["num_heads"],
            "noise_schedule": loaded.noise_schedule,
            "diffusion_steps": loaded.diffusion_steps,
            "clip_denoised": clip,
        }
        _check_or_write_config(out / "sample_config.json", config)

        tmp_tag = f"r{rank}"
        for stale in samples_dir.glob(f".*.{tmp_tag}.tmp"):  # left by a killed run of this rank
            stale.unlink(missing_ok=True)
        done = existing_samples(samples_dir)
        mine = [i for i in rank_indices(num_samples, rank, world_size) if i not in done]
        skipped = len(rank_indices(num_samples, rank, world_size)) - len(mine)
        _log(
            f"rank {rank}/{world_size}: {len(mine)} samples to make, {skipped} already on disk "
            f"({sampler}-{num_steps}, cfg {cfg_scale}, {loaded.weights} weights, {precision}, {dev})",
            progress,
        )
        vae_model = None if pixels else load_vae(vae_name, dev)
        t0 = time.perf_counter()
        made = 0
        for chunk in _chunks(mine, batch_size):
            idx = torch.tensor(list(chunk), dtype=torch.long)
            y = plan(idx)
            latents = sample_latents(
                net, y, idx, seed=seed, sampler=sampler, num_steps=num_steps, eta=eta, cfg_scale=cfg_scale,
                guide_channels=guide_channels, precision=precision, noise_schedule=loaded.noise_schedule,
                diffusion_steps=loaded.diffusion_steps, clip_denoised=clip,
            )  # fmt: skip
            images = to_uint8(decode_latents(latents, vae_model if vae_model is not None else vae_name, scale))
            for k, (i, c) in enumerate(zip(idx.tolist(), y.tolist())):
                _atomic_save_image(images[k], samples_dir / png_name(i, c), tmp_tag)
            made += len(chunk)
            rate = made / (time.perf_counter() - t0)
            _log(f"rank {rank}: {made}/{len(mine)} ({rate:.2f} images/s)", progress)
        elapsed = time.perf_counter() - t0

        dist = torch.distributed
        grouped = dist.is_available() and dist.is_initialized() and world_size > 1
        if grouped:
            dist.barrier()
        result: dict[str, Any] = {
            "output": str(out),
            "samples_dir": str(samples_dir),
            "num_samples": int(num_samples),
            "rank": rank,
            "world_size": world_size,
            "generated": made,
            "skipped": skipped,
            "images_per_second": made / elapsed if made and elapsed > 0 else None,
            "npz": None,
            "grid": None,
            "complete": False,
        }
        if grouped and rank != 0:
            return result
        done = existing_samples(samples_dir)
        missing = [i for i in range(num_samples) if i not in done]
        if missing:
            _log(f"{len(missing)} of {num_samples} samples still missing (other ranks?): npz not written yet", progress)
            return result
        result["complete"] = True
        paths = [done[i] for i in range(num_samples)]
        result["grid"] = str(write_grid(paths[:grid_size], out / "grid.png", nrow=grid_nrow))
        if write_npz:
            npz = write_npz_from_pngs(paths, out / "samples.npz")
            result["npz"] = str(npz)
        _log(f"done in {time.perf_counter() - t_start:.1f}s: {result['npz'] or samples_dir}", progress)
        return result
    finally:
        if own_group:
            torch.distributed.destroy_process_group()
