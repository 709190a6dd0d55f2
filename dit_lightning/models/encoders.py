"""The frozen encoders REPA aligns with, loaded from local files only (nothing is downloaded).

``load_encoder(options)`` accepts
- ``dinov2-vitb14``: REPA's ImageNet encoder as timm builds it (``vit_base_patch14_dinov2.lvd142m``,
  224 px input: 16x16 patch tokens for 256 px images, SiT-XL/2's token grid), with ``weights`` the
  local checkpoint (timm's file, or DINOv2's own ``dinov2_vitb14_pretrain.pth``: timm converts it);
- any other timm model name, with ``weights`` a local file;
- a ``save_pretrained`` directory of a transformers vision model (e.g. ``facebook/dinov2-base``);
- a class path: an ``nn.Module`` built without arguments that maps images in [0, 1] to (N, T, D)
  patch features, with optional ``weights`` (a state dict, read with ``weights_only=True``).

Each becomes a :class:`FrozenEncoder`: images in [0, 1] -> resized (bicubic, as REPA) and normalised
as the encoder was trained -> patch tokens without class / register tokens, in float32.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .repa import REPAOptions

# REPA's ImageNet choice, spelled as timm names it.
ENCODER_ALIASES = {"dinov2-vitb14": "vit_base_patch14_dinov2.lvd142m"}
_DINOV2_SIZE = 224  # REPA resizes 256 px images to 224 for DINOv2 (patch 14: 16x16 tokens)


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

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
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
        return z[:, self.prefix_tokens :].float()


def load_encoder(options: REPAOptions) -> FrozenEncoder:
    """The frozen encoder ``options`` names, from local files; a clear error when it cannot be loaded."""
    name = options.encoder
    if not name:
        raise ValueError("REPA needs model.repa.encoder (e.g. dinov2-vitb14 with model.repa.weights)")
    if os.path.isdir(name):
        return _transformers_encoder(name, options.image_size)
    if name in ENCODER_ALIASES:
        return _timm_encoder(ENCODER_ALIASES[name], options)
    if _is_class_path(name):
        return _class_encoder(name, options)
    return _timm_encoder(name, options)


def _is_class_path(name: str) -> bool:
    module, _, attr = name.rpartition(".")
    if not module:
        return False
    try:
        return isinstance(getattr(importlib.import_module(module), attr, None), type)
    except ImportError:
        return False


def _read_state_dict(path: str) -> dict[str, Tensor]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model.repa.weights: no file {path}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    sd: Any = torch.load(path, map_location="cpu", weights_only=True)  # tensors only: no code runs from it
    for key in ("state_dict", "model"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    return sd


def _class_encoder(path: str, options: REPAOptions) -> FrozenEncoder:
    module, _, attr = path.rpartition(".")
    cls = getattr(importlib.import_module(module), attr)
    if not issubclass(cls, nn.Module):
        raise TypeError(f"model.repa.encoder {path} is not an nn.Module class")
    net = cls()
    if options.weights:
        net.load_state_dict(_read_state_dict(options.weights))
    return FrozenEncoder(net, "class", image_size=options.image_size)


def _timm_encoder(name: str, options: REPAOptions) -> FrozenEncoder:
    try:
        import timm
    except ImportError as e:
        raise ImportError(
            f"model.repa.encoder {name}: timm models need timm (pip install 'dit-lightning[repa]')"
        ) from e
    if not options.weights:
        raise ValueError(
            f"model.repa.encoder {name}: set model.repa.weights to the encoder's local weights file "
            "(nothing is downloaded; an untrained encoder would teach nothing)"
        )
    if not os.path.isfile(options.weights):
        raise FileNotFoundError(f"model.repa.weights: no file {options.weights}")
    dinov2 = "dinov2" in name
    kwargs: dict[str, Any] = {"num_classes": 0}
    size = options.image_size or (_DINOV2_SIZE if dinov2 else None)
    if size is not None and name.startswith(("vit", "eva", "deit")):
        kwargs["img_size"] = size  # timm's ViTs resample their position embeddings (DINOv2's 518 px ones too)
    try:
        net = timm.create_model(name, pretrained=False, **kwargs)
    except RuntimeError as e:
        if "Unknown model" in str(e):
            raise ValueError(f"model.repa.encoder {name}: not a timm model name, directory or class path") from e
        raise
    # the weights read here with weights_only=True (no code runs from the file), then timm's own
    # conversion of the model family's checkpoints (DINOv2's original keys, resampled positions)
    sd = _read_state_dict(options.weights)
    convert = getattr(sys.modules.get(type(net).__module__), "checkpoint_filter_fn", None)
    if convert is not None:
        sd = convert(sd, net)
    missing, unexpected = net.load_state_dict(sd, strict=False)
    wrong = [k for k in [*missing, *unexpected] if not k.startswith(("head.", "fc_norm."))]  # the unused classifier
    if wrong:
        raise ValueError(f"model.repa.weights {options.weights} does not fit timm's {name}: {wrong[:5]}")
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


def _transformers_encoder(path: str, image_size: Optional[int]) -> FrozenEncoder:
    try:
        from transformers import AutoConfig, AutoModel
    except ImportError as e:
        raise ImportError(f"model.repa.encoder {path}: a save_pretrained directory needs transformers") from e
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    net = AutoModel.from_pretrained(path, local_files_only=True)
    dinov2 = "dinov2" in str(getattr(config, "model_type", ""))
    size = image_size or (_DINOV2_SIZE if dinov2 else int(getattr(config, "image_size", 224)))
    prefix = 1 + int(getattr(config, "num_register_tokens", 0) or 0)  # [CLS] (+ registers) come first
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # the ImageNet statistics DINOv2 / ViTs use
    processor = os.path.join(path, "preprocessor_config.json")
    if os.path.isfile(processor):
        import json

        with open(processor) as f:
            proc = json.load(f)
        mean, std = tuple(proc.get("image_mean", mean)), tuple(proc.get("image_std", std))
    return FrozenEncoder(
        net,
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
