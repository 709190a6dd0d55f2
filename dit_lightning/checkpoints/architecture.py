"""Which DiT a checkpoint holds, by one rule, and loading weights into it strictly.

Shapes come from the weights; what no shape shows (the number of attention heads, the label
dropout that decides whether the label table has a null row) comes from what the file
records, in this order: the run's own settings (``num_heads`` / ``class_dropout_prob`` in the
Lightning hyper-parameters or the reference arguments), the named configuration (``model:
DiT-XL/2``), the recorded architecture (``args["model_config"]``, written by every export of
this project). Only a file that records nothing (a released raw state dict) is guessed: the
named configuration with the same depth, width and patch, else ``hidden_size / 64`` heads
(the head size of every published DiT), and :func:`dit_config_of` says so.

SiT's checkpoints (github.com/willisma/SiT) are DiTs by their parameter names and shapes; what tells
them apart is the objective, flow matching, which ``LoadedDiT.objective`` reads from what a file
records (:func:`dit_lightning.diffusion.objective_from_record`: this project's ``objective: flow``, or
SiT's training arguments ``path_type`` / ``prediction``). A released raw state dict records nothing:
the caller says it is a flow model. Its
networks are built with ``learn_sigma`` and use only the first C of their 2C output channels;
:func:`sit_output_layout` gives such weights to a network with C outputs (exactly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn

from ..diffusion import TrainingObjective, objective_from_record
from ..latents import LatentTransform, transform_of
from ..models.config import BLOCK_DEFAULTS, block_options, build_from_config, mlp_ratio_for, swiglu_mlp_ratio_for
from ..models.dit import DIT_CONFIGS, LIGHTNINGDIT_CONFIGS, DiT, dit_config
from .formats import DiTCheckpoint, StateDict, Weights, clean_state_dict, read_checkpoint

_DESCRIBED = ("depth", "hidden_size", "patch_size", "in_channels", "input_size", "num_classes", "learn_sigma")
NAMED_CONFIGS = {**DIT_CONFIGS, **LIGHTNINGDIT_CONFIGS}  # a released file's heads, by depth, width and patch


def infer_dit_config(sd: StateDict, source: str = "the state dict") -> dict[str, Any]:
    """The constructor arguments of the DiT that produced a state dict, from the weights alone.

    The heads are guessed (a named configuration of the same depth, width and patch, else
    ``hidden_size // 64``; a head-pruned model with QK-norm shows its head size), and the label
    table is assumed to have a null row (``class_dropout_prob`` 0.1). :func:`dit_config_of`
    corrects both from what a checkpoint records. ``source`` names the weights in the error
    raised when they are not a DiT's (e.g. ``"checkpoint 'x.pt'"``).
    """
    try:
        hidden = sd["pos_embed"].shape[-1]
        tokens = sd["pos_embed"].shape[1]
        w = sd["x_embedder.proj.weight"]
        table = sd["y_embedder.embedding_table.weight"].shape[0]
        out_features = sd["final_layer.linear.weight"].shape[0]
        swiglu = "blocks.0.mlp.w12.weight" in sd  # LightningDiT's SwiGLU: w12 (gate and value), w3
        mlp_hidden = sd["blocks.0.mlp.w3.weight" if swiglu else "blocks.0.mlp.fc1.weight"].shape[1 if swiglu else 0]
        attn_dim = sd["blocks.0.attn.qkv.weight"].shape[0] // 3
        adaln_rows = sd["blocks.0.adaLN_modulation.1.weight"].shape[0]
    except KeyError as e:
        keys = sorted(sd)
        shown = f"its {len(keys)} tensors start {keys[:4]}" if keys else "it holds no tensors"
        raise ValueError(
            f"{source} is not a DiT state dict: no {e} tensor ({shown}). Pass a DiT checkpoint (one that "
            "`dit-lightning fit`, `export` or `prune` wrote, or a released DiT-XL-2 file)."
        ) from None
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    patch, in_channels = w.shape[-1], w.shape[1]
    grid = int(round(tokens**0.5))
    out_channels = out_features // (patch * patch)
    qk_norm = "blocks.0.attn.q_norm.weight" in sd
    cfg: dict[str, Any] = {
        "input_size": grid * patch,
        "patch_size": patch,
        "in_channels": in_channels,
        "hidden_size": hidden,
        "depth": depth,
        "mlp_ratio": (swiglu_mlp_ratio_for if swiglu else mlp_ratio_for)(hidden, mlp_hidden),
        "learn_sigma": out_channels == 2 * in_channels,
        "qk_norm": qk_norm,
        # The label table has a null row iff the model was trained with label dropout; the
        # released and reference models always are, so assume it (num_classes = rows - 1).
        "num_classes": table - 1,
        "class_dropout_prob": 0.1,
    }
    # LightningDiT's block options, each shown by its weights: RMSNorm's gain, SwiGLU's w12, the rope
    # tables (persistent buffers, in LightningDiT's state dicts as in this project's), adaLN's 4 chunks.
    options = {
        "norm": "rmsnorm" if "blocks.0.norm1.weight" in sd else "layernorm",
        "mlp": "swiglu" if swiglu else "gelu",
        "pos_embed": "rope" if "feat_rope.freqs_cos" in sd else "sincos",
        "wo_shift": adaln_rows == 4 * hidden,
    }
    cfg.update({k: v for k, v in options.items() if v != BLOCK_DEFAULTS[k]})
    if "cls_embedder.proj.weight" in sd:  # REG's class token: its entry maps the encoder's width to hidden
        cfg["class_token_dim"] = sd["cls_embedder.proj.weight"].shape[1]
    named = [
        c for c in NAMED_CONFIGS.values() if (c["depth"], c["hidden_size"], c["patch_size"]) == (depth, hidden, patch)
    ]
    cfg["num_heads"] = named[0]["num_heads"] if named else max(1, hidden // 64)
    if options["pos_embed"] == "rope":  # the rope tables have the head size: exact heads
        cfg["num_heads"] = attn_dim // sd["feat_rope.freqs_cos"].shape[-1]
    if attn_dim != hidden:  # head-pruned: exact heads with QK-norm (its weight has the head size)
        cfg["attn_dim"] = attn_dim
        if qk_norm or options["pos_embed"] == "rope":
            head = sd["feat_rope.freqs_cos"].shape[-1] if not qk_norm else sd["blocks.0.attn.q_norm.weight"].shape[0]
        else:
            head = 64 if attn_dim % 64 == 0 else attn_dim
        cfg["num_heads"] = attn_dim // head
    return cfg


def _recorded_heads(args: dict[str, Any]) -> Optional[int]:
    """The heads a checkpoint's arguments record, in the order of the module docstring."""
    if args.get("num_heads"):
        return int(args["num_heads"])
    name = args.get("model")
    if isinstance(name, str) and name.startswith("SiT-"):  # SiT's, REPA's and REG's train.py: DiT's sizes
        name = "DiT-" + name[len("SiT-") :]
    if isinstance(name, str) and name != "custom":
        try:
            return dit_config(name)["num_heads"]
        except ValueError:
            pass
    recorded = args.get("model_config")
    if isinstance(recorded, dict) and recorded.get("num_heads"):
        return int(recorded["num_heads"])
    return None


def dit_config_of(
    ckpt: DiTCheckpoint, sd: Optional[StateDict] = None, num_heads: Optional[int] = None
) -> tuple[dict[str, Any], list[str]]:
    """The architecture of the DiT in ``ckpt`` (weights ``sd``, default its trained ones), by the
    rule of this module; returns ``(config, notes)`` where the notes say what had to be guessed.
    ``num_heads`` overrides everything (for raw files of custom sizes)."""
    sd = sd if sd is not None else ckpt.model
    cfg = infer_dit_config(sd, f"checkpoint '{ckpt.path}'")
    args = ckpt.args
    recorded = args.get("model_config")
    if not isinstance(recorded, dict):
        recorded = {}
    notes: list[str] = []
    heads = num_heads or _recorded_heads(args)
    if (
        heads is None
        and cfg.get("pos_embed") != "rope"
        and not any(
            (c["depth"], c["hidden_size"], c["patch_size"]) == (cfg["depth"], cfg["hidden_size"], cfg["patch_size"])
            for c in NAMED_CONFIGS.values()
        )
    ):
        notes.append(
            f"the head count of this custom DiT is not recorded in '{ckpt.path}'; assuming {cfg['num_heads']} "
            "(hidden/64). Pass num_heads if it was trained with another."
        )
    if heads is not None:
        cfg["num_heads"] = heads
    dropout = args.get("class_dropout_prob", recorded.get("class_dropout_prob"))
    if dropout is not None:
        cfg["class_dropout_prob"] = float(dropout)
    if cfg["class_dropout_prob"] == 0.0:
        # No null row in the label table then: num_classes = rows (inferring assumed rows - 1).
        cfg["num_classes"] = sd["y_embedder.embedding_table.weight"].shape[0]
    inner = cfg.get("attn_dim", cfg["hidden_size"])
    if inner % cfg["num_heads"]:
        raise ValueError(f"attention width {inner} is not divisible by num_heads {cfg['num_heads']}")
    return cfg, notes


_PLAIN = (int, float, str, bool, list, tuple, dict, type(None))


def export_args(ckpt: DiTCheckpoint, cfg: dict[str, Any]) -> dict[str, Any]:
    """What an export records of ``ckpt``: its plain (YAML/JSON-able) settings, the architecture
    ``cfg`` under ``model_config``, and the epoch and step it was saved at."""
    args = {k: v for k, v in {**ckpt.args, "model_config": cfg}.items() if isinstance(v, _PLAIN)}
    args.update({k: ckpt.meta[k] for k in ("epoch", "global_step") if isinstance(ckpt.meta.get(k), int)})
    return args


def describe(cfg: dict[str, Any]) -> str:
    """The sizes of an architecture and the block options where they are not DiT's (``norm=rmsnorm``)."""
    shown = [k for k in _DESCRIBED if k in cfg] + [
        k for k in BLOCK_DEFAULTS if cfg.get(k, BLOCK_DEFAULTS[k]) != BLOCK_DEFAULTS[k]
    ]
    return ", ".join(f"{k}={cfg[k]}" for k in shown)


def check_dit_weights(model: nn.Module, sd: StateDict, source: str = "checkpoint") -> None:
    """Raise a ValueError naming both architectures if ``sd`` does not fit ``model`` exactly."""
    own = model.state_dict()
    sd = clean_state_dict(sd)
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    mismatched = [k for k in own if k in sd and tuple(own[k].shape) != tuple(sd[k].shape)]
    if not (missing or unexpected or mismatched):
        return
    try:
        theirs = describe(infer_dit_config(sd))
    except ValueError:
        theirs = "not a DiT"
    mine = describe(
        {**{k: getattr(model, k) for k in _DESCRIBED}, **(block_options(model) if isinstance(model, DiT) else {})}
    )
    detail = "; ".join(
        part
        for part in (
            f"missing {missing[:4]}" if missing else "",
            f"unexpected {unexpected[:4]}" if unexpected else "",
            f"shape mismatch at {mismatched[:4]}" if mismatched else "",
        )
        if part
    )
    raise ValueError(
        f"{source} holds another architecture ({theirs}) than the configured model ({mine}): {detail}. "
        "Configure the model to match the checkpoint (or sample with the architecture inferred from it)."
    )


def load_dit_weights(model: nn.Module, sd: StateDict, source: str = "checkpoint") -> None:
    """``load_state_dict(strict=True)`` with an error that says which architecture the
    checkpoint holds when it is not the configured one."""
    check_dit_weights(model, sd, source)
    model.load_state_dict(clean_state_dict(sd), strict=True)


def sit_output_layout(sd: StateDict, model: nn.Module) -> StateDict:
    """``sd`` for ``model``, a flow network with C output channels, when ``sd``'s final layer has 2C
    (SiT's ``learn_sigma`` networks, whose forward keeps the first C: the released
    SiT-XL-2-256x256.pt): the rows of the unused channels dropped, which changes no output. Any
    other state dict is returned as it is (and loads strictly, or not at all)."""
    c = int(getattr(model, "in_channels", 0))
    if getattr(model, "learn_sigma", True) or not c:
        return sd
    w, b = sd.get("final_layer.linear.weight"), sd.get("final_layer.linear.bias")
    own = model.state_dict().get("final_layer.linear.weight")
    if w is None or b is None or own is None or w.shape[0] != 2 * own.shape[0] or w.shape[1:] != own.shape[1:]:
        return sd
    keep = torch.arange(w.shape[0]).remainder(2 * c) < c  # features are (p, q, channel), channel fastest
    return {**sd, "final_layer.linear.weight": w[keep], "final_layer.linear.bias": b[keep]}


def recorded_vae(args: dict[str, Any]) -> Optional[str]:
    """The VAE a checkpoint's settings name, the reference script's ``--vae ema|mse`` spelled out."""
    vae = args.get("vae")
    if not isinstance(vae, str) or not vae:
        return None
    return f"stabilityai/sd-vae-ft-{vae}" if vae in ("ema", "mse") else vae


@dataclass
class LoadedDiT:
    """A DiT rebuilt from a checkpoint, in eval mode, and what the checkpoint says about it."""

    net: DiT
    config: dict[str, Any]
    checkpoint: DiTCheckpoint
    weights: Weights  # the weights loaded: "ema", or "raw" when asked or when the file has no EMA
    notes: list[str] = field(default_factory=list)

    @property
    def format(self) -> str:
        return self.checkpoint.format

    @property
    def args(self) -> dict[str, Any]:
        return self.checkpoint.args

    @property
    def vae(self) -> Optional[str]:
        """The VAE the run decoded with; the reference script's ``--vae ema|mse`` spelled out."""
        return recorded_vae(self.args)

    @property
    def objective(self) -> Optional[TrainingObjective]:
        """The objective the checkpoint records (``sample_latents(..., objective=...)``); None for a file
        that records nothing (a released raw state dict: DiT's are DDPM, SiT's flow)."""
        objective = objective_from_record(self.args)
        return objective.for_network(self.net.learn_sigma) if objective is not None else None

    @property
    def scale_factor(self) -> Optional[float]:
        value = self.args.get("scale_factor")
        return float(value) if value is not None else None

    @property
    def latent_transform(self) -> Optional[LatentTransform]:
        """The latent transform the checkpoint records (a legacy one read from its VAE and scale
        factor); None for a file that records neither."""
        return transform_of(self.args)

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling settings a Lightning run was configured with (sampler, steps, guidance)."""
        if self.format not in ("lightning", "sharded"):
            return {}
        keys = ("sample_steps", "sampler", "cfg_scale", "guide_channels")
        return {k: self.args[k] for k in keys if k in self.args}


def load_dit(
    path: Union[str, DiTCheckpoint],
    weights: Union[Weights, str] = "ema",
    num_heads: Optional[int] = None,
    device: Union[str, torch.device] = "cpu",
) -> LoadedDiT:
    """Rebuild the DiT a checkpoint holds (no model config needed) and load its weights strictly.

    ``weights="ema"`` falls back to the trained weights when the file has none; ``"raw"`` (or
    ``"model"``) takes the trained weights. The network is in eval mode with ``pos_embed`` frozen.
    """
    ckpt = path if isinstance(path, DiTCheckpoint) else read_checkpoint(path)
    use_ema = weights == "ema" and ckpt.ema is not None
    sd = ckpt.weights("ema" if use_ema else "model")
    cfg, notes = dit_config_of(ckpt, sd, num_heads=num_heads)
    notes = [*ckpt.meta.get("notes", []), *notes]  # what reading the file noticed (diffusers configs)
    if weights == "ema" and not use_ema:
        notes.append(f"'{ckpt.path}' has no EMA weights; using the raw weights")
    net = build_from_config(cfg, device=device, empty=True)
    load_dit_weights(net, sd, source=f"checkpoint '{ckpt.path}'")
    net.pos_embed.requires_grad_(False)
    return LoadedDiT(net.eval(), cfg, ckpt, "ema" if use_ema else "raw", notes)
