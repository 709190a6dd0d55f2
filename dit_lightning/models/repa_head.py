"""REPA as one head beside the DiT: its options, the projector, the alignment term, the frozen encoder
(kept out of the module tree) and the one rule that says whether features are this encoder's, which
serves a training run (features computed online, or read from a store) and ``extract`` alike.

The DiT hands the head the hidden state of the aligned block as a value
(``DiT.forward(..., hidden_at=depth)``): no hook, no state between calls.

Plain PyTorch: the encoders are loaded from local files by :mod:`.encoders`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from ..hashing import file_sha256, tree_sha256
from .dit import DiT
from .encoders import FrozenEncoder, feature_shape, load_encoder
from .repa import Projector, REPAOptions, alignment_loss

# A path's point and velocity at per-sample times: (data, noise, t) -> (x_t, d x_t / dt) (the flow
# objective's ``interpolate``; REG noises its class token on the latents' path).
Interpolate = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
# The objective's batch-mean terms for a network function (x_t, t, **kwargs) -> output.
DiffusionLoss = Callable[[Callable[..., Tensor]], dict[str, Tensor]]


@dataclass(frozen=True)
class EncoderIdentity:
    """What makes two encoders' features interchangeable: the encoder (a class path or timm name as
    given; any ``save_pretrained`` directory, which its files' hash identifies wherever it lies), the
    sha256 of its weights (the file's bytes, or every file of a directory) and the input image side."""

    encoder: str
    weights_sha256: Optional[str]
    image_size: Optional[int]

    @staticmethod
    def encoder_name(options: REPAOptions) -> str:
        """The encoder as an identity names it: a ``save_pretrained`` directory by its absolute path."""
        name = str(options.encoder)
        return os.path.abspath(name) if os.path.isdir(name) else name

    @classmethod
    def of(cls, options: REPAOptions) -> EncoderIdentity:
        """The identity of the encoder ``options`` name, its weights hashed now (None: no weights)."""
        name = cls.encoder_name(options)
        if os.path.isdir(name):
            return cls(name, tree_sha256(name), options.image_size)
        sha = file_sha256(options.weights) if options.weights and os.path.isfile(options.weights) else None
        return cls(name, sha, options.image_size)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> EncoderIdentity:
        size = record.get("image_size")
        sha = record.get("weights_sha256")
        return cls(str(record.get("encoder")), None if sha is None else str(sha), None if size is None else int(size))

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def store_record(self, weights: Optional[str]) -> dict[str, Any]:
        """What a latent store records of the encoder behind its features (the feature set's source):
        the identity and the weights file's name (None for a directory); ``weights_sha256`` is ""
        for an encoder without weights."""
        return {
            "encoder": self.encoder,
            "weights": weights,
            "weights_sha256": self.weights_sha256 or "",
            "image_size": self.image_size,
        }

    def features_key(self, tokens: int, dim: int, dtype: str = "float16") -> str:
        """A short hash of the identity and the features' shape: a store's commit records carry it, so
        a features file written for another encoder never counts (the weights file's name may differ)."""
        d = {**self.store_record(None), "tokens": tokens, "dim": dim, "dtype": dtype}
        del d["weights"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def _name_key(self) -> str:
        # a directory is identified by its files' hash: a copy elsewhere is the same encoder
        return "<save_pretrained directory>" if os.path.isabs(self.encoder) else self.encoder

    def differences(self, other: EncoderIdentity) -> list[str]:
        """What differs, in words (empty: the same encoder); weights unknown on either side are not
        compared."""
        out = []
        if self._name_key() != other._name_key():
            out.append(f"encoder {other.encoder} (this one: {self.encoder})")
        if self.weights_sha256 and other.weights_sha256 and self.weights_sha256 != other.weights_sha256:
            out.append(f"weights sha256 {other.weights_sha256[:12]}... (this one: {self.weights_sha256[:12]}...)")
        if self.image_size != other.image_size:
            out.append(f"image size {other.image_size} (this one: {self.image_size})")
        return out


def image_shape_of(latent_shape: Any, pixels: bool) -> tuple[int, int, int]:
    """(C, H, W) of the images behind latents of ``latent_shape``: the latents themselves for pixel
    stores, RGB at 8x the side for the SD VAEs."""
    c, h, w = (int(v) for v in latent_shape)
    return (c, h, w) if pixels else (3, 8 * h, 8 * w)


class REPAHead:
    """REPA for one DiT: built from its options (the encoder is loaded once, to read its feature width
    and token count, when the options do not record them), then :meth:`attach`'d to the network, which
    creates the projector (the module registers it as ``repa_projector``: checkpoints keep that name).

    ``trusted``: whether ``options.encoder`` was given by the user, or read from a file (a checkpoint's
    record): a class path read from a file is imported only when the encoders' allowlist allows it.
    """

    def __init__(self, options: REPAOptions, image_shape: tuple[int, int, int], trusted: bool = True) -> None:
        self.trusted = trusted
        self._frozen: dict[str, FrozenEncoder] = {}  # a plain dict: the encoder stays out of every state dict
        self.tokens: Optional[int] = None
        if options.feature_dim is None:
            encoder = self._load(options)
            if options.class_token and not encoder.has_class_token:
                raise self._no_class_token(options)
            self.tokens, width = feature_shape(encoder, image_shape)
            options = dataclasses.replace(options, feature_dim=width)
        # weights hashed here need no second look at first use; a recorded hash is checked then
        self._weights_checked = options.weights_sha256 is None
        if options.weights_sha256 is None:
            options = dataclasses.replace(options, weights_sha256=EncoderIdentity.of(options).weights_sha256)
        self.options = options
        self.projector: Optional[Projector] = None
        self.dit_tokens: Optional[int] = None  # the network's, once attached

    def _load(self, options: REPAOptions) -> FrozenEncoder:
        encoder = load_encoder(options, trusted=self.trusted)
        self._frozen["encoder"] = encoder
        return encoder

    @property
    def depth(self) -> int:
        return self.options.depth

    @property
    def coeff(self) -> float:
        return self.options.coeff

    @property
    def class_token_dim(self) -> Optional[int]:
        """The width of REG's class token, the DiT's ``class_token_dim`` (None: REG is off): the
        encoder's feature width, recorded as ``feature_dim`` (the class token is the first token of the
        same output as the patch features, DINOv2's ``x_norm_clstoken``)."""
        return self.options.feature_dim if self.options.class_token else None

    @staticmethod
    def _no_class_token(options: REPAOptions) -> ValueError:
        return ValueError(
            f"model.repa.class_token_weight {options.class_token_weight} (REG) needs an encoder with a class token, "
            f"and {options.encoder} has none: use DINOv2 (dinov2-vitb14), a class-path encoder whose output starts "
            "with its class token (class attribute prefix_tokens = 1), or set model.repa.class_token_weight 0"
        )

    def attach(self, net: DiT) -> Projector:
        """Check the options against the network (its blocks and tokens) and create the projector."""
        self.options.check(len(net.blocks))
        tokens = self.dit_tokens = int(net.x_embedder.num_patches)
        if self.tokens is not None and self.tokens != tokens:
            side = int(round(tokens**0.5))
            raise ValueError(
                f"REPA: encoder {self.options.encoder} gives {self.tokens} patch features per image and the DiT has "
                f"{tokens} tokens; they must match one to one: set model.repa.image_size so that the encoder's patch "
                f"grid is {side}x{side} (DINOv2 at 224 px for 256 px images and patch 2)"
            )
        assert self.options.feature_dim is not None
        self.projector = Projector(net.hidden_size, self.options.projector_dim, self.options.feature_dim)
        return self.projector

    def identity(self) -> EncoderIdentity:
        """This run's encoder, with the weights' hash it recorded."""
        return EncoderIdentity(
            EncoderIdentity.encoder_name(self.options), self.options.weights_sha256, self.options.image_size
        )

    def record(self) -> dict[str, Any]:
        """The options as a checkpoint records them (feature width and weights' hash included)."""
        return dataclasses.asdict(self.options)

    # ---- the encoder ---------------------------------------------------------------------------
    def encoder(self, device: Optional[torch.device] = None) -> FrozenEncoder:
        """The frozen encoder (loaded on first use, checked against the weights the run recorded)."""
        if "encoder" not in self._frozen:
            wrong = [] if self._weights_checked else EncoderIdentity.of(self.options).differences(self.identity())
            if wrong:
                raise ValueError(
                    f"model.repa.weights {self.options.weights} is not the encoder this run recorded: "
                    + "; ".join(wrong)
                    + ". Point model.repa.weights at the weights the run was trained with"
                )
            self._load(self.options)
        encoder = self._frozen["encoder"]
        return encoder.to(device) if device is not None else encoder

    def features(self, batch: Mapping[str, Tensor], decode: Any) -> Tensor:
        """The encoder's patch features of the batch's clean images (:meth:`targets`' first)."""
        return self.targets(batch, decode)[0]

    def targets(self, batch: Mapping[str, Tensor], decode: Any) -> tuple[Tensor, Optional[Tensor]]:
        """The encoder's patch features (N, T, D) of the batch's clean images and, with REG, its class
        token (N, D) (else None): precomputed by ``extract`` (``batch["repa"]`` and
        ``batch["repa_class_token"]``, the flip the batch holds) or computed now from
        ``decode(batch["x"])`` in one encoder pass."""
        reg = self.options.class_token
        if "repa" in batch:
            if not reg:
                return batch["repa"], None
            if "repa_class_token" not in batch:
                raise self._no_stored_class_token()
            return batch["repa"], batch["repa_class_token"]
        with torch.no_grad():
            images = decode(batch["x"])
            patches, token = self.encoder(images.device).encode(images)
        if reg and token is None:
            raise self._no_class_token(self.options)
        return patches, token if reg else None

    def check_store(self, spec: Mapping[str, Any]) -> None:
        """Features precomputed in a store (its record ``spec``, the datamodule's ``repa_spec``) must be
        this run's encoder's: the same encoder, weights and image size (:class:`EncoderIdentity`), width
        and the DiT's token count. With REG on, the store must hold the encoder's class token too
        (``spec["class_token"]``, the same encoder's, of its width): a store without it is refused."""
        tokens = self.dit_tokens
        problems = EncoderIdentity.from_record(spec).differences(self.identity())
        if spec.get("dim") != self.options.feature_dim:
            problems.append(f"feature width {spec.get('dim')} (the encoder gives {self.options.feature_dim})")
        if spec.get("tokens") != tokens:
            problems.append(f"{spec.get('tokens')} tokens (the DiT has {tokens})")
        token = spec.get("class_token")
        if self.options.class_token and isinstance(token, Mapping):
            problems += [f"class token: {p}" for p in EncoderIdentity.from_record(token).differences(self.identity())]
            if token.get("dim") != self.options.feature_dim:  # the class token is a row of the features' output
                problems.append(f"class token width {token.get('dim')} (the encoder gives {self.options.feature_dim})")
        if problems:
            raise ValueError(
                "the store's REPA features were made with another encoder: " + "; ".join(problems) + ". Extract the "
                "features of this run's encoder (dit-lightning extract --output STORE --repa_encoder ... "
                "--repa_weights ...), or set data.repa_features false to compute them online"
            )
        if self.options.class_token and not isinstance(token, Mapping):
            raise self._no_stored_class_token(spec)

    def _no_stored_class_token(self, spec: Optional[Mapping[str, Any]] = None) -> ValueError:
        """The one refusal of REG on a store whose REPA features hold no class token (``spec``: the
        store's record, which names the encoder to extract with)."""
        encoder = (spec or {}).get("encoder") or self.options.encoder
        weights = (spec or {}).get("weights") or self.options.weights
        return ValueError(
            f"REG (model.repa.class_token_weight {self.options.class_token_weight}) needs the encoder's class "
            "token, and the store's precomputed REPA features hold none (extracted before class tokens were "
            f"stored, or a class-token pass not finished): rerun `dit-lightning extract --output STORE "
            f"--repa_encoder {encoder}{f' --repa_weights <{weights}>' if weights else ''}` (add --image_root for a "
            "VAE store) to add it (one encoder pass; the patch features stay), or set data.repa_features false to "
            "compute the targets online"
        )

    # ---- the alignment term ------------------------------------------------------------------------
    def loss(self, hidden: Tensor, features: Tensor) -> Tensor:
        """REPA's ``loss.py``: the mean over the batch of each sample's mean negative cosine similarity
        between the projected hidden tokens and the encoder's patch features."""
        assert self.projector is not None, "attach() the head to the network first"
        return alignment_loss(self.projector(hidden), features.to(hidden.device)).mean()

    def losses(
        self,
        net: DiT,
        diffusion_loss: DiffusionLoss,
        targets: tuple[Tensor, Optional[Tensor]],
        token_noise: Optional[Tensor] = None,
        interpolate: Optional[Interpolate] = None,
        step: Optional[int] = None,
    ) -> dict[str, Tensor]:
        """REPA's and REG's terms around the objective's (``diffusion_loss`` of a network function).

        ``targets``: :meth:`targets`' (patches, class token or None). With REG the class token is
        noised on the latents' path at the latents' times with ``token_noise`` (``interpolate``), the
        network gets it and predicts its velocity: REG's ``loss.py`` term ``class_token``, the mean
        over the token's dimensions of the squared error, batch mean, times ``class_token_weight``;
        the alignment target is then the class token followed by the patches, aligned with all the
        network's 1 + T tokens (REG's ``dense_z``). Label dropout leaves the token alone (REG).

        ``step``: the optimiser step of a training pass: ``loss`` adds ``coeff`` x the alignment term
        before ``until_step`` and 0 x it from there on (logged still; kept in the graph, so that the
        projector is never an unused parameter to DDP). None: an evaluation pass: no alignment,
        ``loss`` is the objective's, and the class token's term is reported beside it.
        """
        patches, token = targets
        if token is not None and (token_noise is None or interpolate is None):
            raise ValueError("REG's class token needs its noise and the objective's path (interpolate)")
        align = step is not None
        if not align and token is None:
            return diffusion_loss(net)  # nothing of the head's to evaluate
        hidden: list[Tensor] = []
        errors: list[Tensor] = []

        def network(x: Tensor, t: Tensor, **kwargs: Any) -> Tensor:
            if token is None:
                out, h = net(x, t, **kwargs, hidden_at=self.depth)
                hidden.append(h)
                return out
            assert token_noise is not None and interpolate is not None
            noisy, velocity = interpolate(token.float(), token_noise, t)
            if align:
                out, h, predicted = net(x, t, **kwargs, hidden_at=self.depth, class_token=noisy)
                hidden.append(h)
            else:
                out, predicted = net(x, t, **kwargs, class_token=noisy)
            errors.append(((predicted.float() - velocity) ** 2).mean(dim=1))  # REG's mean_flat: per sample
            return out

        terms = diffusion_loss(network)
        loss = terms["loss"]
        out = {**terms, "denoising": terms["loss"]} if align else dict(terms)
        if step is not None:
            target = patches if token is None else torch.cat([token[:, None].to(patches.dtype), patches], dim=1)
            repa = self.loss(hidden[0], target)
            coeff = self.coeff if self.options.aligns_at(step) else 0.0
            loss = loss + coeff * repa
            out["repa"] = repa
        if token is not None:
            class_token = errors[0].mean()
            if align:
                loss = loss + self.options.class_token_weight * class_token
            out["class_token"] = class_token
        out["loss"] = loss
        return out


def repa_head(
    repa: Optional[REPAOptions | Mapping[str, Any]], image_shape: tuple[int, int, int], trusted: bool = True
) -> Optional[REPAHead]:
    """The head of REPA's options (a checkpoint's record is a plain dict), or None when REPA is off.

    Options that record the encoder's feature width come from a checkpoint's record (a user leaves it
    unset): their class path is not ``trusted`` (resolved against the encoders' allowlist)."""
    if isinstance(repa, Mapping):
        repa = REPAOptions(**repa)
    if repa is None or not repa.enabled:
        return None
    return REPAHead(repa, image_shape, trusted=trusted and repa.feature_dim is None)
