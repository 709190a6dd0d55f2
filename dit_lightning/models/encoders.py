"""The frozen encoders REPA aligns with, loaded from local files only (nothing is downloaded, no
code from a file runs).

``load_encoder(options, trusted=...)`` accepts
- ``dinov2-vitb14``: REPA's ImageNet encoder as timm builds it (``vit_base_patch14_dinov2.lvd142m``,
  224 px input: 16x16 patch tokens for 256 px images, SiT-XL/2's token grid), with ``weights`` the
  local checkpoint (timm's file, or DINOv2's own ``dinov2_vitb14_pretrain.pth``: timm converts it);
- any other timm model name (one timm registers: no hub names), with ``weights`` a local file;
- a ``save_pretrained`` directory of a vision model transformers defines itself (e.g.
  ``facebook/dinov2-base``): a directory whose ``config.json`` maps to its own Python (``auto_map``)
  is refused, and transformers is always called with ``trust_remote_code=False``;
- a class path: an ``nn.Module`` built without arguments that maps images in [0, 1] to (N, T, D)
  patch features, with ``weights`` its state dict; a class whose features need no trained weights
  says so with a class attribute ``needs_weights = False`` (without weights any other is refused:
  it would be randomly initialised). A class path read from a file (``trusted=False``: a
  checkpoint's settings, a store's record) is imported only when it is allowed
  (:func:`dit_lightning.safe_read.class_path_allowed`: this package's classes, and
  ``DIT_LIGHTNING_TRUSTED_CLASSES``); one typed by the user (``trusted=True``) is the user's choice.

Every weights file (a timm name's, a class path's, a directory's) is read by the foundation's one
reader of foreign files (:func:`dit_lightning.safe_read.read_state_dict`: safetensors, or
``torch.load`` weights-only), and every error names the file and the fix.

Each becomes a :class:`FrozenEncoder`: images in [0, 1] -> resized (bicubic, as REPA) and normalised
as the encoder was trained -> patch tokens without class / register tokens, in float32;
:meth:`FrozenEncoder.encode` also gives the class token (REG's target: the first token of the
encoder's normalised output, DINOv2's ``x_norm_clstoken``). A class-path encoder whose output starts
with a class token declares ``prefix_tokens = 1`` (class attribute); one without has no class token.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..safe_read import (
    FileKind,
    UntrustedClassError,
    is_class_path_syntax,
    read_json_object,
    read_state_dict,
    resolve_class_path,
)
from .repa import REPAOptions

# REPA's ImageNet choice, spelled as timm names it.
ENCODER_ALIASES = {"dinov2-vitb14": "vit_base_patch14_dinov2.lvd142m"}
_DINOV2_SIZE = 224  # REPA resizes 256 px images to 224 for DINOv2 (patch 14: 16x16 tokens)
WEIGHTS = FileKind(
    "REPA encoder weights",
    "weights file",
    "Check model.repa.weights (extract: --repa_weights).",
)
OPTION = "model.repa.encoder"
# A class-path encoder's class attribute: False when its features need no trained weights file.
NEEDS_WEIGHTS_ATTR = "needs_weights"
# The weights files of a transformers save_pretrained directory, safetensors first (they hold no code).
_HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


class FrozenEncoder(nn.Module):
    """A frozen feature encoder: images in [0, 1] (N, C, H, W) -> patch features (N, T, D)."""

    def __init__(
        self,
        net: nn.Module,
        kind: str,
        image_size: Optional[int] = None,
        mean: Optional[tuple[float, ...]] = None,
        std: Optional[tuple[float, ...]] = None,
        prefix_tokens: int = 0,
        in_channels: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.net = net.requires_grad_(False).eval()
        self.kind = kind
        self.image_size = image_size
        self.prefix_tokens = prefix_tokens
        self.in_channels = in_channels
        self.mean: Optional[Tensor]
        self.std: Optional[Tensor]
        self.register_buffer("mean", None if mean is None else torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", None if std is None else torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    def train(self, mode: bool = True) -> FrozenEncoder:
        return super().train(False)  # frozen: always in eval mode (no dropout, fixed norms)

    @property
    def has_class_token(self) -> bool:
        """Whether the encoder's output starts with a class token (REG needs one)."""
        return self.prefix_tokens > 0

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        """Images in [0, 1] (N, C, H, W) -> patch features (N, T, D), float32."""
        return self.encode(images)[0]

    @torch.no_grad()
    def encode(self, images: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """One pass: (patch features (N, T, D), the class token (N, D) or None when the encoder has
        none), float32. The class token is the first token of the encoder's normalised output."""
        x = images.float()
        if self.in_channels == 3 and x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)  # grey images for an RGB encoder
        if self.image_size is not None and x.shape[-1] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bicubic", align_corners=False)
        if self.mean is not None and self.std is not None:
            x = (x - self.mean.to(x.device)) / self.std.to(x.device)
        net: Any = self.net  # timm / transformers / any module: each called its own way
        if self.kind == "timm":
            z = net.forward_features(x)
        elif self.kind == "transformers":
            z = net(pixel_values=x).last_hidden_state
        else:
            z = net(x)
        if z.dim() != 3:
            raise ValueError(f"REPA encoder ({self.kind}) gave features of shape {tuple(z.shape)}, not (N, T, D)")
        token = z[:, 0].float() if self.prefix_tokens > 0 else None
        return z[:, self.prefix_tokens :].float(), token


def load_encoder(options: REPAOptions, trusted: bool = True) -> FrozenEncoder:
    """The frozen encoder ``options`` names, from local files; a clear error when it cannot be loaded.

    ``trusted``: whether ``options.encoder`` was given by the user (the command line, their config),
    or read from a file (a checkpoint's recorded settings, a store's record: pass ``False``). Only
    a class path is concerned: one read from a file is imported only when allowed."""
    name = options.encoder
    if not name:
        raise ValueError("REPA needs model.repa.encoder (e.g. dinov2-vitb14 with model.repa.weights)")
    kind = encoder_kind(name)
    if kind == "transformers":
        return _transformers_encoder(name, options.image_size)
    if kind == "class":
        return _class_encoder(name, options, trusted)
    return _timm_encoder(ENCODER_ALIASES.get(name, name), options)


def encoder_kind(name: str) -> str:
    """``"transformers"`` (a directory), ``"timm"`` or ``"class"`` for an encoder name, decided
    without importing anything the name gives (timm's registry is consulted, a module is not)."""
    if os.path.isdir(name):
        return "transformers"
    if name in ENCODER_ALIASES or _is_timm_name(name):
        return "timm"
    return "class" if _is_class_path(name) else "timm"  # an unknown name: timm's error says what it is not


def _is_timm_name(name: str) -> bool:
    try:
        import timm
    except ImportError:
        return False
    return bool(timm.is_model(name))  # a registered architecture (with or without its pretrained tag)


def _is_class_path(name: str) -> bool:
    """A dotted name that is not a timm model name (``vit_base_patch14_dinov2.lvd142m`` is one):
    from the name alone, never by importing its module (that would run the module)."""
    return is_class_path_syntax(name) and not _is_timm_name(name)


def resolve_encoder_class(name: str, trusted: bool = True) -> type[nn.Module]:
    """The ``nn.Module`` class a class-path encoder names; with ``trusted=False`` (a name read
    from a file) only an allowed name is imported (:func:`dit_lightning.safe_read.resolve_class_path`)."""
    try:
        cls = resolve_class_path(name, trusted=trusted, option=OPTION, source="a checkpoint's or a store's record")
    except UntrustedClassError:
        raise
    except ValueError as e:  # not importable: say what else the name could have been
        raise ValueError(f"{e}; an encoder is a timm model name, a save_pretrained directory or a class path") from None
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"{OPTION} {name} is not an nn.Module class")
    return cls


def needs_weights(name: str, trusted: bool = True) -> bool:
    """Whether the encoder ``name`` needs a weights file: timm names and class paths do (unless the
    class declares ``needs_weights = False``), a save_pretrained directory holds its own."""
    kind = encoder_kind(name)
    if kind == "class":
        return bool(getattr(resolve_encoder_class(name, trusted), NEEDS_WEIGHTS_ATTR, True))
    return kind == "timm"


def check_weights(options: REPAOptions, trusted: bool = True) -> None:
    """Refuse an encoder that would be randomly initialised: a timm name or a class path without
    ``weights`` (unless its class declares ``needs_weights = False``). A directory holds its own."""
    name = options.encoder
    if not name or options.weights or not needs_weights(name, trusted):
        return
    kind = encoder_kind(name)
    extra = (
        f"; a class whose features need no trained weights declares it with the class attribute "
        f"{NEEDS_WEIGHTS_ATTR} = False"
        if kind == "class"
        else ""
    )
    raise ValueError(
        f"{OPTION} {name}: set model.repa.weights (extract: --repa_weights) to the encoder's local weights file: "
        f"without it the encoder would be randomly initialised and teach nothing (nothing is downloaded){extra}"
    )


def _read_state_dict(path: str) -> dict[str, Tensor]:
    """A weights file's state dict (safetensors, or weights-only torch; under ``state_dict`` / ``model``
    for training checkpoints), through the foundation's reader: every error names the file."""
    sd: Any = read_state_dict(path, WEIGHTS)
    for key in ("state_dict", "model"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
        raise ValueError(
            f"{WEIGHTS.label} '{path}' holds a {type(sd).__name__}, not a state dict (a mapping of names to tensors): "
            "save the encoder's weights with torch.save(model.state_dict(), ...) or as safetensors"
        )
    return sd


def _not_fitting(path: str, network: str, problems: list[str]) -> ValueError:
    return ValueError(
        f"{WEIGHTS.label} '{path}' does not fit {network}: {'; '.join(problems)}. They are the weights of "
        f"another network: pass the weights of {network} (or the encoder these weights belong to)"
    )


def _class_encoder(path: str, options: REPAOptions, trusted: bool) -> FrozenEncoder:
    cls = resolve_encoder_class(path, trusted)
    check_weights(options, trusted)
    net = cls()
    if options.weights:
        sd = _read_state_dict(options.weights)
        try:
            net.load_state_dict(sd)
        except RuntimeError as e:  # missing / unexpected keys, other shapes
            lines = [line.strip().rstrip(".") for line in str(e).splitlines()[1:] if line.strip()]
            raise _not_fitting(options.weights, path, lines[:2] or [str(e)]) from None
    prefix = int(getattr(cls, "prefix_tokens", 0))  # a class token (and registers) first, when it says so
    return FrozenEncoder(net, "class", image_size=options.image_size, prefix_tokens=prefix)


def _timm_encoder(name: str, options: REPAOptions) -> FrozenEncoder:
    try:
        import timm
    except ImportError as e:
        raise ImportError(f"{OPTION} {name}: timm models need timm (pip install 'dit-lightning[repa]')") from e
    if not timm.is_model(name):  # only timm's registered names: no hub names (nothing is downloaded)
        raise ValueError(
            f"{OPTION} {name}: not a timm model name, directory or class path (a timm name as timm.list_models() "
            "gives it, a save_pretrained directory, or package.module.Class)"
        )
    check_weights(options)
    assert options.weights is not None
    dinov2 = "dinov2" in name
    kwargs: dict[str, Any] = {"num_classes": 0}
    size = options.image_size or (_DINOV2_SIZE if dinov2 else None)
    if size is not None and name.startswith(("vit", "eva", "deit")):
        kwargs["img_size"] = size  # timm's ViTs resample their position embeddings (DINOv2's 518 px ones too)
    net = timm.create_model(name, pretrained=False, **kwargs)  # timm runs no code from files
    # the weights read weights-only (no code runs from the file), then timm's own conversion of the
    # model family's checkpoints (DINOv2's original keys, resampled positions)
    sd = _read_state_dict(options.weights)
    convert = getattr(sys.modules.get(type(net).__module__), "checkpoint_filter_fn", None)
    try:
        if convert is not None:
            sd = convert(sd, net)
        missing, unexpected = net.load_state_dict(sd, strict=False)
    except (KeyError, RuntimeError, ValueError, IndexError) as e:  # other keys or shapes than the family's
        raise _not_fitting(
            options.weights, f"timm's {name}", [f"{type(e).__name__}: {str(e).splitlines()[0]}"]
        ) from None
    wrong = [k for k in [*missing, *unexpected] if not k.startswith(("head.", "fc_norm."))]  # the unused classifier
    if wrong:
        raise _not_fitting(options.weights, f"timm's {name}", [f"missing or unexpected keys {wrong[:5]}"])
    cfg: dict[str, Any] = dict(getattr(net, "pretrained_cfg", {}))
    size = size or int(cfg["input_size"][-1])
    return FrozenEncoder(
        net,
        "timm",
        image_size=size,
        mean=tuple(cfg.get("mean", (0.485, 0.456, 0.406))),
        std=tuple(cfg.get("std", (0.229, 0.224, 0.225))),
        prefix_tokens=int(getattr(net, "num_prefix_tokens", 0)),
        in_channels=int(cfg["input_size"][0]),
    )


def _directory_weights(path: str) -> tuple[dict[str, Tensor], list[str]]:
    """The state dict of a save_pretrained directory (one file, or the shards its index lists),
    safetensors first, read by the foundation's reader; and the files read."""
    for name in _HF_WEIGHTS:
        index = os.path.join(path, name + ".index.json")
        if os.path.isfile(os.path.join(path, name)):
            files = [os.path.join(path, name)]
        elif os.path.isfile(index):
            shards = read_json_object(index, "copy the directory again", OPTION).get("weight_map", {})
            files = [os.path.join(path, os.path.basename(str(f))) for f in sorted(set(shards.values()))]
        else:
            continue
        sd: dict[str, Tensor] = {}
        for file in files:
            sd.update(_read_state_dict(file))
        return sd, files
    raise ValueError(
        f"{OPTION} {path}: the directory holds no weights ({' or '.join(_HF_WEIGHTS)}, or their sharded index): "
        "pass a directory written by save_pretrained"
    )


def _transformers_encoder(path: str, image_size: Optional[int]) -> FrozenEncoder:
    """A save_pretrained directory, with remote code off: transformers builds the network its
    config names (its own classes only) and the weights come from the foundation's reader."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{OPTION} {path}: a directory without config.json is not a save_pretrained directory")
    if "auto_map" in read_json_object(config_file, "copy the directory again", OPTION):
        raise ValueError(
            f"{OPTION} {path}: its config.json has an auto_map entry: the network is defined by Python files of the "
            "directory, which are never run (remote code is off). Use a model transformers defines itself (e.g. the "
            "save_pretrained directory of facebook/dinov2-base), or your own class as a class path "
            "(package.module.Class) with model.repa.weights"
        )
    try:
        from transformers import AutoConfig, AutoModel
    except ImportError as e:
        raise ImportError(f"{OPTION} {path}: a save_pretrained directory needs transformers") from e
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        model_class: Any = AutoModel._model_mapping[type(config)]  # its own class for the config: no code
    except (KeyError, ValueError, OSError) as e:
        raise ValueError(
            f"{OPTION} {path}: transformers does not build this directory's model ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}): pass the save_pretrained directory of a vision model "
            "transformers defines (e.g. facebook/dinov2-base)"
        ) from None
    sd, files = _directory_weights(path)
    # no name: transformers reads no file itself (our reader did) and fetches nothing
    net, info = model_class.from_pretrained(None, config=config, state_dict=sd, output_loading_info=True)
    checks = (("missing_keys", "missing keys"), ("mismatched_keys", "keys of other shapes"))
    problems = [f"{what} {sorted(info[key])[:5]}" for key, what in checks if info.get(key)]
    if problems:  # keys it does not use (a classifier's head) are fine
        raise _not_fitting(", ".join(files), f"{type(net).__name__} of {config_file}", problems)
    dinov2 = "dinov2" in str(getattr(config, "model_type", ""))
    size = image_size or (_DINOV2_SIZE if dinov2 else int(getattr(config, "image_size", 224)))
    prefix = 1 + int(getattr(config, "num_register_tokens", 0) or 0)  # [CLS] (+ registers) come first
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # the ImageNet statistics DINOv2 / ViTs use
    processor = os.path.join(path, "preprocessor_config.json")
    if os.path.isfile(processor):  # read as data: its own auto_map (processor code) is never used
        proc = read_json_object(processor, "copy the directory again", OPTION)
        mean, std = tuple(proc.get("image_mean", mean)), tuple(proc.get("image_std", std))
    return FrozenEncoder(
        net.float(),
        "transformers",
        image_size=size,
        mean=mean,
        std=std,
        prefix_tokens=prefix,
        in_channels=int(getattr(config, "num_channels", 3)),
    )


def feature_shape(encoder: FrozenEncoder, image_shape: tuple[int, int, int]) -> tuple[int, int]:
    """(tokens, width) of ``encoder``'s features for images of ``image_shape`` (C, H, W)."""
    z = encoder(torch.zeros(1, *image_shape))
    return int(z.shape[1]), int(z.shape[2])
