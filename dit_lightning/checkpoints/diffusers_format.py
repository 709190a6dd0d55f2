"""diffusers' DiT (``DiTPipeline`` / ``DiTTransformer2DModel``) and safetensors files: one name
rule, read both ways, strictly.

The rule (:func:`name_table`) pairs every parameter of the reference DiT with its diffusers
name(s). Two entries are not one-to-one: the fused ``attn.qkv`` projection is diffusers'
``to_q``, ``to_k``, ``to_v`` (split along the output dimension), and the reference's one
timestep / label embedder is copied into every diffusers block (``norm1.emb``), whose copies
must therefore be identical when read back. ``pos_embed``, the fixed sin-cos table, is not in
diffusers' weights (a non-persistent buffer it recomputes); reading rebuilds it. Any name
outside the rule, missing or extra, is an error.

What diffusers' ``DiTTransformer2DModel`` cannot express (:func:`diffusers_transformer_config`
says which): head-pruned attention (q/k/v narrower than the residual width), an MLP other than
4 x hidden (MLP-pruned or narrow distilled students), QK-norm, and a label table without the
null class (``class_dropout_prob`` 0). Every depth, width, head count, patch size and learned
sigma is expressible.

diffusers' network is not exactly the reference network: its timestep embedding divides the
frequency exponent by 127 instead of 128 (``downscale_freq_shift=1``; the reference uses 0),
and a released config without ``norm_eps`` puts 1e-5 in the MLP's LayerNorm where the reference
has 1e-6 (exports write 1e-6). :func:`use_reference_timestep_embedding` makes a loaded model
the reference network. Pure PyTorch (+ diffusers, safetensors); no Lightning.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import torch
from torch import Tensor, nn

from ..models.config import BLOCK_DEFAULTS
from ..models.dit import sincos_2d
from ..safe_read import read_json_object

StateDict = dict[str, Tensor]  # (formats.StateDict; not imported: formats reads through this module)

TRANSFORMER_CLASSES = ("DiTTransformer2DModel", "Transformer2DModel")  # the second: released configs
WEIGHT_FILE = "diffusion_pytorch_model.safetensors"
_WEIGHT_FILES = (WEIGHT_FILE, "diffusion_pytorch_model.bin")
_INDEX_FILE = WEIGHT_FILE + ".index.json"
METADATA_KEY = "dit_lightning"  # safetensors metadata entry of `export --format safetensors`
INFO_FILE = "dit_lightning.json"  # what an export knows beyond diffusers' files (VAE reference...)
REFERENCE_NORM_EPS = 1e-6
_ARCH_REASON_HINT = "export it with --format safetensors (or reference) instead"


class NotExpressibleError(ValueError):
    """A DiT whose architecture diffusers' ``DiTTransformer2DModel`` has no setting for."""


# ---------------------------------------------------------------------------------------
# The name rule
# ---------------------------------------------------------------------------------------

# (kind, reference name, diffusers name); "{i}" is a block index, "{p}" weight / bias.
#   same:   one tensor each side;
#   qkv:    the reference's fused q|k|v rows are diffusers' to_q, to_k, to_v;
#   shared: one tensor in the reference, a copy in every diffusers block.
_RULE: tuple[tuple[str, str, str], ...] = (
    ("same", "x_embedder.proj.{p}", "pos_embed.proj.{p}"),
    ("shared", "t_embedder.mlp.0.{p}", "transformer_blocks.{i}.norm1.emb.timestep_embedder.linear_1.{p}"),
    ("shared", "t_embedder.mlp.2.{p}", "transformer_blocks.{i}.norm1.emb.timestep_embedder.linear_2.{p}"),
    ("shared", "y_embedder.embedding_table.weight",
     "transformer_blocks.{i}.norm1.emb.class_embedder.embedding_table.weight"),
    ("same", "blocks.{i}.adaLN_modulation.1.{p}", "transformer_blocks.{i}.norm1.linear.{p}"),
    ("qkv", "blocks.{i}.attn.qkv.{p}", "transformer_blocks.{i}.attn1.to_{qkv}.{p}"),
    ("same", "blocks.{i}.attn.proj.{p}", "transformer_blocks.{i}.attn1.to_out.0.{p}"),
    ("same", "blocks.{i}.mlp.fc1.{p}", "transformer_blocks.{i}.ff.net.0.proj.{p}"),
    ("same", "blocks.{i}.mlp.fc2.{p}", "transformer_blocks.{i}.ff.net.2.{p}"),
    ("same", "final_layer.adaLN_modulation.1.{p}", "proj_out_1.{p}"),
    ("same", "final_layer.linear.{p}", "proj_out_2.{p}"),
)  # fmt: skip
FIXED = ("pos_embed",)  # reference parameters diffusers recomputes instead of storing


def name_table(depth: int) -> list[tuple[str, str, tuple[str, ...]]]:
    """Every ``(kind, reference name, diffusers names)`` of a DiT with ``depth`` blocks."""
    rows: list[tuple[str, str, tuple[str, ...]]] = []
    for kind, ours, theirs in _RULE:
        for p in ("weight", "bias"):
            if "{p}" not in ours and p == "bias":
                continue
            blocks = range(depth) if "{i}" in ours else [None]
            for i in blocks:
                mine = ours.format(i=i, p=p)
                if kind == "shared":
                    names = tuple(theirs.format(i=j, p=p) for j in range(depth))
                elif kind == "qkv":
                    names = tuple(theirs.format(i=i, p=p, qkv=c) for c in "qkv")
                else:
                    names = (theirs.format(i=i, p=p),)
                rows.append((kind, mine, names))
    return rows


def _depth_of(names: Any, prefix: str) -> int:
    found = {int(k[len(prefix) :].split(".")[0]) for k in names if k.startswith(prefix)}
    if not found:
        raise ValueError(f"no '{prefix}N.' parameters: not a DiT state dict")
    if found != set(range(len(found))):
        raise ValueError(f"blocks {sorted(set(range(max(found) + 1)) - found)} are missing")
    return len(found)


def _check_names(have: set[str], want: set[str], what: str) -> None:
    missing, extra = sorted(want - have), sorted(have - want)
    if missing or extra:
        parts = [f"missing {missing[:4]}" if missing else "", f"unexpected {extra[:4]}" if extra else ""]
        raise ValueError(f"{what} does not follow the DiT name rule: {'; '.join(p for p in parts if p)}")


def to_diffusers_state_dict(sd: StateDict) -> StateDict:
    """Reference / dit-lightning names -> diffusers names (strict; ``pos_embed`` is dropped)."""
    depth = _depth_of(sd, "blocks.")
    table = name_table(depth)
    _check_names(set(sd), {ours for _, ours, _ in table} | set(FIXED), "the DiT state dict")
    out: StateDict = {}
    for kind, ours, theirs in table:
        value = sd[ours]
        if kind == "qkv":
            if value.shape[0] % 3:
                raise ValueError(f"{ours} has {value.shape[0]} rows, not 3 equal q, k, v parts")
            parts = value.chunk(3, dim=0)
            out.update({name: part.contiguous().clone() for name, part in zip(theirs, parts)})
        else:
            out.update({name: value.contiguous().clone() for name in theirs})  # separate copies
    return out


def from_diffusers_state_dict(sd: StateDict, grid_size: int) -> StateDict:
    """diffusers names -> reference / dit-lightning names (strict), with the fixed ``pos_embed``
    of a ``grid_size`` x ``grid_size`` token grid rebuilt. The per-block copies of the timestep
    and label embedders must be identical: a model whose blocks learned their own is not a DiT."""
    depth = _depth_of(sd, "transformer_blocks.")
    table = name_table(depth)
    _check_names(set(sd), {name for _, _, theirs in table for name in theirs}, "the diffusers state dict")
    out: StateDict = {}
    for kind, ours, theirs in table:
        if kind == "qkv":
            out[ours] = torch.cat([sd[name] for name in theirs], dim=0)
            continue
        out[ours] = sd[theirs[0]]
        for name in theirs[1:]:
            if not torch.equal(sd[name], out[ours]):
                raise ValueError(
                    f"{name} differs from {theirs[0]}: its blocks have their own timestep/label embedders, "
                    "which a DiT (one embedder shared by every block) cannot express"
                )
    hidden = out["x_embedder.proj.weight"].shape[0]
    dtype = out["x_embedder.proj.weight"].dtype
    out["pos_embed"] = reference_pos_embed(hidden, grid_size).to(dtype)
    return out


def reference_pos_embed(hidden_size: int, grid_size: int) -> Tensor:
    """The fixed (1, grid^2, hidden) sin-cos table, exactly as :class:`~dit_lightning.models.DiT` builds it."""
    return torch.from_numpy(sincos_2d(hidden_size, grid_size)).float().unsqueeze(0)


# ---------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------


def inexpressible(cfg: dict[str, Any]) -> list[str]:
    """Why diffusers' ``DiTTransformer2DModel`` cannot hold the DiT of configuration ``cfg``
    (empty when it can)."""
    hidden = int(cfg["hidden_size"])
    reasons = []
    attn = cfg.get("attn_dim")
    if attn is not None and int(attn) != hidden:
        reasons.append(f"its attention is {attn} wide but the residual stream {hidden} (head-pruned)")
    if int(hidden * float(cfg.get("mlp_ratio", 4.0))) != 4 * hidden:
        width = int(hidden * float(cfg["mlp_ratio"]))
        reasons.append(f"its MLP has {width} channels, not 4 x {hidden} (diffusers fixes the ratio at 4)")
    if cfg.get("qk_norm"):
        reasons.append("it normalises queries and keys (qk_norm), which diffusers' DiT blocks have no setting for")
    lightning = {
        "norm": "RMSNorm (norm rmsnorm)",
        "mlp": "a SwiGLU feed-forward (mlp swiglu)",
        "pos_embed": "rotary position embeddings (pos_embed rope)",
        "wo_shift": "adaLN without shifts (wo_shift)",
    }
    for key, part in lightning.items():
        if cfg.get(key, BLOCK_DEFAULTS[key]) != BLOCK_DEFAULTS[key]:
            reasons.append(f"it has LightningDiT's {part}, which diffusers' DiT blocks have no setting for")
    if cfg.get("class_token_dim"):
        reasons.append(
            f"it has REG's class token (class_token_dim {cfg['class_token_dim']}: cls_embedder and "
            "final_layer.linear_cls), which DiTTransformer2DModel has no place for"
        )
    if float(cfg.get("class_dropout_prob", 0.1)) <= 0:
        reasons.append("its label table has no null-class row (class_dropout_prob 0); diffusers always has one")
    return reasons


def diffusers_transformer_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``DiTTransformer2DModel`` arguments of the DiT of configuration ``cfg`` (as
    :func:`~dit_lightning.checkpoints.dit_config_of` returns it); raises
    :class:`NotExpressibleError` naming every part diffusers has no setting for."""
    reasons = inexpressible(cfg)
    if reasons:
        raise NotExpressibleError(
            "diffusers' DiTTransformer2DModel cannot express this DiT: " + "; ".join(reasons) + f". {_ARCH_REASON_HINT}"
        )
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_heads"])
    in_channels = int(cfg["in_channels"])
    return {
        "num_attention_heads": heads,
        "attention_head_dim": hidden // heads,
        "in_channels": in_channels,
        "out_channels": 2 * in_channels if cfg.get("learn_sigma", True) else in_channels,
        "num_layers": int(cfg["depth"]),
        "sample_size": int(cfg["input_size"]),
        "patch_size": int(cfg["patch_size"]),
        "num_embeds_ada_norm": int(cfg["num_classes"]),
        "activation_fn": "gelu-approximate",
        "attention_bias": True,
        "norm_type": "ada_norm_zero",
        "norm_elementwise_affine": False,
        "norm_eps": REFERENCE_NORM_EPS,
        "dropout": 0.0,
        "upcast_attention": False,
    }


def dit_config_from_diffusers(config: dict[str, Any], where: str = "config.json") -> tuple[dict[str, Any], list[str]]:
    """The dit-lightning architecture of a diffusers DiT config; ``(config, notes)``. Raises a
    ValueError for a config that is not a class-conditional DiT (another norm, activation...)."""
    name = config.get("_class_name", "DiTTransformer2DModel")
    expected = {
        "norm_type": ("ada_norm_zero", "ada_norm_zero"),
        "activation_fn": ("gelu-approximate", "gelu-approximate"),
        "attention_bias": (True, False),
        "norm_elementwise_affine": (False, True),
    }
    wrong = []
    if name not in TRANSFORMER_CLASSES:
        wrong.append(f"_class_name {name!r} (expected one of {TRANSFORMER_CLASSES})")
    for key, (want, default) in expected.items():
        if config.get(key, default) != want:
            wrong.append(f"{key}={config.get(key, default)!r} (a DiT has {want!r})")
    for key in ("cross_attention_dim", "num_vector_embeds"):
        if config.get(key) is not None:
            wrong.append(f"{key}={config[key]!r} (a DiT has none)")
    for key in ("patch_size", "num_embeds_ada_norm"):
        if config.get(key) is None:
            wrong.append(f"no {key}")
    in_channels = int(config.get("in_channels", 4))
    out_channels = config.get("out_channels") or in_channels
    if out_channels not in (in_channels, 2 * in_channels):
        wrong.append(f"out_channels={out_channels} (a DiT outputs in_channels, or twice that with learned sigma)")
    if wrong:
        raise ValueError(f"{where} is not a class-conditional DiT that dit-lightning can load: " + "; ".join(wrong))
    heads, head_dim = int(config.get("num_attention_heads", 16)), int(config.get("attention_head_dim", 72))
    cfg: dict[str, Any] = {
        "input_size": int(config.get("sample_size", 32)),
        "patch_size": int(config["patch_size"]),
        "in_channels": in_channels,
        "hidden_size": heads * head_dim,
        "depth": int(config.get("num_layers", 28)),
        "num_heads": heads,
        "mlp_ratio": 4.0,
        "class_dropout_prob": 0.1,  # diffusers' label table always has the null row
        "num_classes": int(config["num_embeds_ada_norm"]),
        "learn_sigma": out_channels == 2 * in_channels,
        "qk_norm": False,
    }
    notes = []
    eps = float(config.get("norm_eps", 1e-5))
    if eps != REFERENCE_NORM_EPS:
        notes.append(
            f"{where} has norm_eps={eps:g}: diffusers runs the MLP's LayerNorm with it, the reference DiT "
            f"(and dit-lightning) with {REFERENCE_NORM_EPS:g}"
        )
    return cfg, notes


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------


def _transformer_dir(path: Path) -> Optional[Path]:
    """The folder of a diffusers DiT's config and weights: ``path`` itself or its ``transformer/``."""
    for d in (path / "transformer", path):
        config = d / "config.json"
        if config.is_file():
            try:
                name = read_json_object(config).get("_class_name")
            except ValueError:
                continue
            if name in TRANSFORMER_CLASSES:
                return d
    return None


def is_diffusers_checkpoint(path: Union[str, Path]) -> bool:
    """A diffusers pipeline directory with a DiT transformer, or a DiT transformer directory."""
    path = Path(path)
    return path.is_dir() and _transformer_dir(path) is not None


def is_safetensors_file(path: Union[str, Path]) -> bool:
    """A safetensors file (by its name, or its header: a little-endian length, then JSON)."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix == ".safetensors":
        return True
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and int.from_bytes(head[:8], "little") < path.stat().st_size and head[8:9] == b"{"


def _load_safetensors(path: Path) -> tuple[StateDict, dict[str, str]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as e:
        raise ValueError(f"cannot read safetensors file '{path}': {e}") from e


def _load_weights_dir(d: Path) -> StateDict:
    index = d / _INDEX_FILE
    if index.is_file():
        files = sorted(set(read_json_object(index).get("weight_map", {}).values()))
        sd: StateDict = {}
        for name in files:
            sd.update(_load_safetensors(d / name)[0])
        return sd
    if (d / WEIGHT_FILE).is_file():
        return _load_safetensors(d / WEIGHT_FILE)[0]
    if (d / _WEIGHT_FILES[1]).is_file():
        from .safe_load import load_file

        data = load_file(d / _WEIGHT_FILES[1], mmap=True)  # weights only; a refusal says what the file is
        if not isinstance(data, dict):
            raise ValueError(f"'{d / _WEIGHT_FILES[1]}' holds a {type(data).__name__}, not a state dict")
        return data
    raise FileNotFoundError(f"'{d}' has a DiT config but no weights ({', '.join(_WEIGHT_FILES)})")


def _scheduler_args(d: Path, notes: list[str]) -> dict[str, Any]:
    from ..sampling.schedulers import noise_schedule_of

    config = d / "scheduler_config.json"
    if not config.is_file():
        return {}
    found = noise_schedule_of(read_json_object(config))
    if found is None:
        notes.append(
            f"the betas of {config} are not dit-lightning's linear or cosine schedule: sampling uses the "
            "linear schedule of 1000 steps"
        )
        return {}
    return {"noise_schedule": found[0], "diffusion_steps": found[1]}


def read_diffusers(path: Union[str, Path]) -> tuple[StateDict, dict[str, Any], dict[str, Any]]:
    """A diffusers DiT (pipeline directory, or its ``transformer/`` folder) as
    ``(state dict in reference names, args, meta)``.

    ``args`` records the architecture (``model_config``, ``num_heads``), the noise schedule of
    ``scheduler/``, and the VAE: the pipeline's ``vae/`` folder when it has one, else what an
    export of dit-lightning recorded in ``dit_lightning.json`` (a hub id, or ``none/pixels``).
    ``meta["notes"]`` says where diffusers' settings differ from the reference network's.
    """
    path = Path(path)
    d = _transformer_dir(path)
    if d is None:
        raise ValueError(f"'{path}' is not a diffusers DiT: no config.json with _class_name in {TRANSFORMER_CLASSES}")
    root = d.parent if d != path else path
    config = read_json_object(d / "config.json")
    cfg, notes = dit_config_from_diffusers(config, str(d / "config.json"))
    sd = from_diffusers_state_dict(_load_weights_dir(d), cfg["input_size"] // cfg["patch_size"])
    info = read_json_object(root / INFO_FILE) if (root / INFO_FILE).is_file() else {}
    args: dict[str, Any] = {"model_config": cfg, "num_heads": cfg["num_heads"]}
    args.update(_scheduler_args(root / "scheduler", notes))
    vae_dir = root / "vae"
    if (vae_dir / "config.json").is_file():
        args["vae"] = str(vae_dir.resolve())
        vae_config = read_json_object(vae_dir / "config.json")
        args["scale_factor"] = float(vae_config.get("scaling_factor", 0.18215))
        if vae_config.get("shift_factor"):  # an SD3-style VAE's shift (DiTPipeline itself ignores it)
            args["latent_transform"] = {
                "kind": "scale",
                "scale": args["scale_factor"],
                "shift": vae_config["shift_factor"],
            }
    elif info.get("vae"):
        args["vae"] = str(info["vae"])
        if info.get("scale_factor") is not None:
            args["scale_factor"] = float(info["scale_factor"])
        if isinstance(info.get("latent_transform"), dict):  # not folded into a vae/ of the export: as recorded
            args["latent_transform"] = info["latent_transform"]
    for key in ("noise_schedule", "diffusion_steps"):
        if key not in args and key in info:
            args[key] = info[key]
    meta: dict[str, Any] = {"notes": notes}
    meta.update({k: info[k] for k in ("epoch", "global_step", "weights", "source") if k in info})
    return sd, args, meta


def read_safetensors(path: Union[str, Path]) -> tuple[StateDict, dict[str, Any], dict[str, Any]]:
    """A ``.safetensors`` DiT file as ``(state dict in reference names, args, meta)``: an
    ``export --format safetensors`` file (reference names, the settings in its metadata), a raw
    state dict in reference names, or a diffusers transformer's weights (diffusers names; the
    architecture then comes from the ``config.json`` next to it)."""
    path = Path(path)
    sd, metadata = _load_safetensors(path)
    if any(k.startswith("transformer_blocks.") for k in sd):
        config_path = path.parent / "config.json"
        if not config_path.is_file():
            raise ValueError(
                f"'{path}' holds diffusers names but has no config.json next to it: pass the diffusers "
                "directory (with its config.json) instead"
            )
        cfg, notes = dit_config_from_diffusers(read_json_object(config_path), str(config_path))
        mapped = from_diffusers_state_dict(sd, cfg["input_size"] // cfg["patch_size"])
        return mapped, {"model_config": cfg, "num_heads": cfg["num_heads"]}, {"notes": notes}
    if "pos_embed" not in sd and not any(k.startswith("blocks.") for k in sd):
        raise ValueError(f"'{path}' is not a DiT: found tensors {sorted(sd)[:6]}")
    args: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    if METADATA_KEY in metadata:
        try:
            recorded = json.loads(metadata[METADATA_KEY])
        except ValueError as e:
            raise ValueError(f"'{path}' has unreadable {METADATA_KEY} metadata: {e}") from e
        args = dict(recorded.get("args") or {})
        meta = {k: recorded[k] for k in ("epoch", "global_step", "weights", "source") if k in recorded}
    return sd, args, meta


# ---------------------------------------------------------------------------------------
# For diffusers users
# ---------------------------------------------------------------------------------------

M = TypeVar("M")


def use_reference_timestep_embedding(model: M) -> M:
    """Make a diffusers DiT (a ``DiTPipeline`` or its ``DiTTransformer2DModel``) compute the
    reference network: timestep frequencies with ``downscale_freq_shift=0`` (diffusers builds
    them with 1) and the MLP's LayerNorm with eps 1e-6 (configs without ``norm_eps`` give 1e-5).
    Returns ``model``, so that ``pipe = use_reference_timestep_embedding(DiTPipeline.from_pretrained(DIR))``.
    """
    transformer = getattr(model, "transformer", model)
    blocks = getattr(transformer, "transformer_blocks", None)
    if blocks is None:
        raise TypeError(f"{type(model).__name__} is neither a DiTPipeline nor a DiTTransformer2DModel")
    for block in blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 0
        block.norm3.eps = REFERENCE_NORM_EPS
    return model


class PixelDecoder(nn.Module):
    """The "VAE" of a pixel-space DiT (the digits demo) for ``DiTPipeline``: decoding is the
    identity with ``scaling_factor`` 1, so the pipeline's ``(x / 2 + 0.5).clamp(0, 1)`` gives
    the images dit-lightning writes. Load a pixel-space export with
    ``DiTPipeline.from_pretrained(DIR, vae=PixelDecoder())``."""

    def __init__(self) -> None:
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(scaling_factor=1.0)
        # Gives the pipeline a device and dtype to read (it asks every component).
        self.register_buffer("_anchor", torch.zeros(()), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.get_buffer("_anchor").device

    @property
    def dtype(self) -> torch.dtype:
        return self.get_buffer("_anchor").dtype

    def decode(self, z: Tensor, return_dict: bool = True) -> Any:
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=z) if return_dict else (z,)
