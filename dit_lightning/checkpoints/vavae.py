"""LightningDiT's VA-VAE (an LDM ``AutoencoderKL``, github.com/hustvl/LightningDiT ``vavae/`` and
``tokenizer/``) as a diffusers ``AutoencoderKL`` directory, so that ``extract``, ``sample`` and
the diffusers export use it like any other VAE.

diffusers' ``AutoencoderKL`` represents the LDM network exactly when:

- ``ch_mult[0] == 1`` (diffusers' ``conv_in`` outputs ``block_out_channels[0]``, LDM's ``ch``);
  ``block_out_channels = ch * ch_mult``, ``layers_per_block = num_res_blocks`` (the decoder's
  ``num_res_blocks + 1`` in both);
- the attention of ``attn_resolutions`` sits where diffusers' block types can put it: LDM attends
  after every ResNet block of each level whose resolution (``resolution / 2^level``) is listed,
  in the encoder and the decoder alike; diffusers' ``AttnDownEncoderBlock2D`` /
  ``AttnUpDecoderBlock2D`` do the same (one head over all channels, LDM's ``C^-1/2`` scale). VA-VAE
  f16d32 attends at 16 x 16, its last level (``attn_resolutions: [16]``, resolution 256, five levels);
- vanilla attention, ``double_z``, ``resamp_with_conv``, no ``tanh_out`` / ``give_pre_end``, and
  ``embed_dim == z_channels`` (diffusers' quant convs keep the latent width). Anything else is
  refused with the setting that differs.

The names map one to one (``down.{i}.block.{j}`` -> ``down_blocks.{i}.resnets.{j}``, ``nin_shortcut``
-> ``conv_shortcut``, the attention's 1x1 convolutions ``q`` / ``k`` / ``v`` / ``proj_out`` ->
linear ``to_q`` / ``to_k`` / ``to_v`` / ``to_out.0``, the decoder's ``up.{i}`` -> ``up_blocks.{n-1-i}``,
``mid.block_1`` / ``attn_1`` / ``block_2`` -> ``mid_block.resnets.0`` / ``attentions.0`` /
``resnets.1``, ``norm_out`` -> ``conv_norm_out``). The training-only weights of a VA-VAE checkpoint
are left out: ``loss.*`` (LPIPS and the discriminator), ``foundation_model.*`` (DINOv2) and
``linear_proj.*`` (the projection of the vision-foundation alignment).

VA-VAE has no scaling factor: LightningDiT normalises its latents per channel with the mean and
standard deviation of the training set. The directory says ``scaling_factor: 1.0``; a latent store
of it should use `extract --latent_norm channel_stats`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Union

import torch

from ..atomic import replace_directory
from ..safe_read import FileKind, read_weights

VAVAE_FILE = FileKind("VA-VAE checkpoint", "VA-VAE checkpoint", "Copy / download the checkpoint again.")
# training-only weights of a VA-VAE checkpoint (LDM's AutoencoderKL with use_vf): not part of the VAE
IGNORED_PREFIXES = ("loss.", "foundation_model.", "linear_proj.")
_NETWORK_PREFIXES = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.")
_ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_RESNET = {"nin_shortcut": "conv_shortcut"}


class NotConvertibleError(ValueError):
    """A VA-VAE / LDM autoencoder that diffusers' ``AutoencoderKL`` cannot represent exactly."""


def read_vavae_config(path: Union[str, os.PathLike[str]]) -> dict[str, Any]:
    """``model.params`` of an LDM / VA-VAE yaml (``ddconfig`` and ``embed_dim``), read with ``yaml.safe_load``."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"--config {path} does not exist: give VA-VAE's yaml (vavae_f16d32.yaml)") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path} is not valid yaml ({type(e).__name__}): give VA-VAE's yaml") from None
    params = (data.get("model") or {}).get("params") if isinstance(data, dict) else None
    if not isinstance(params, dict) or not isinstance(params.get("ddconfig"), dict) or "embed_dim" not in params:
        raise ValueError(
            f"--config {path} has no model.params.ddconfig and model.params.embed_dim: give the yaml of an LDM "
            "AutoencoderKL (LightningDiT's tokenizer/configs/vavae_f16d32.yaml)"
        )
    return params


def diffusers_vae_config(params: dict[str, Any]) -> dict[str, Any]:
    """The ``AutoencoderKL`` arguments of an LDM autoencoder's ``model.params``; refuses what diffusers
    cannot represent exactly (:class:`NotConvertibleError`, naming the setting)."""
    dd = params["ddconfig"]
    ch, mult, embed = int(dd["ch"]), [int(m) for m in dd["ch_mult"]], int(params["embed_dim"])
    resolution, attn = int(dd["resolution"]), {int(r) for r in dd.get("attn_resolutions") or ()}
    wrong = []
    if mult[0] != 1:
        wrong.append(f"ch_mult[0] {mult[0]} (diffusers' conv_in outputs ch * ch_mult[0]; LDM's ch: needs 1)")
    if not dd.get("double_z", True):
        wrong.append("double_z false (diffusers' encoder outputs mean and log-variance)")
    if embed != int(dd["z_channels"]):
        wrong.append(f"embed_dim {embed} != z_channels {dd['z_channels']} (diffusers' quant convs keep the width)")
    if dd.get("use_linear_attn") or dd.get("attn_type", "vanilla") != "vanilla":
        wrong.append("linear attention (diffusers' AutoencoderKL has softmax attention only)")
    for key in ("tanh_out", "give_pre_end"):
        if dd.get(key):
            wrong.append(f"{key} true")
    if not dd.get("resamp_with_conv", True):
        wrong.append("resamp_with_conv false (diffusers resamples with convolutions)")
    levels = [resolution // 2**i for i in range(len(mult))]
    if attn - set(levels):
        wrong.append(f"attn_resolutions {sorted(attn - set(levels))} match no level (resolutions {levels})")
    if any(ch * m % 32 for m in mult):
        wrong.append(f"channels {[ch * m for m in mult]} not multiples of 32 (LDM's GroupNorm has 32 groups)")
    if wrong:
        raise NotConvertibleError(
            "this autoencoder has no exact diffusers AutoencoderKL: " + "; ".join(wrong) + ". Use it through "
            "LightningDiT's own tokenizer, or convert a configuration without these settings"
        )
    attends = [r in attn for r in levels]
    return {
        "in_channels": int(dd.get("in_channels", 3)),
        "out_channels": int(dd.get("out_ch", 3)),
        "down_block_types": ["AttnDownEncoderBlock2D" if a else "DownEncoderBlock2D" for a in attends],
        "up_block_types": ["AttnUpDecoderBlock2D" if a else "UpDecoderBlock2D" for a in reversed(attends)],
        "block_out_channels": [ch * m for m in mult],
        "layers_per_block": int(dd["num_res_blocks"]),
        "act_fn": "silu",
        "latent_channels": embed,
        "norm_num_groups": 32,
        "sample_size": resolution,
        "scaling_factor": 1.0,  # per-channel statistics instead (the module docstring)
        "mid_block_add_attention": True,
    }


def _rename(key: str, levels: int) -> str:
    """The diffusers name of an LDM autoencoder weight (``encoder.``, ``decoder.`` or a quant conv)."""
    part, _, rest = key.partition(".")
    if part not in ("encoder", "decoder"):
        return key
    rest = rest.replace("norm_out.", "conv_norm_out.", 1) if rest.startswith("norm_out.") else rest
    m = re.match(r"(down|up)\.(\d+)\.(block|attn|downsample|upsample)\.(.*)", rest)
    if m:
        kind, level, what, tail = m.groups()
        index = int(level) if kind == "down" else levels - 1 - int(level)
        prefix = f"{kind}_blocks.{index}"
        if what == "downsample":
            return f"{part}.{prefix}.downsamplers.0.{tail}"
        if what == "upsample":
            return f"{part}.{prefix}.upsamplers.0.{tail}"
        j, _, name = tail.partition(".")
        if what == "block":
            return f"{part}.{prefix}.resnets.{j}.{_renamed(name, _RESNET)}"
        return f"{part}.{prefix}.attentions.{j}.{_renamed(name, _ATTENTION)}"
    m = re.match(r"mid\.(block_1|attn_1|block_2)\.(.*)", rest)
    if m:
        which, name = m.groups()
        if which == "attn_1":
            return f"{part}.mid_block.attentions.0.{_renamed(name, _ATTENTION)}"
        return f"{part}.mid_block.resnets.{0 if which == 'block_1' else 1}.{_renamed(name, _RESNET)}"
    return f"{part}.{rest}"


def _renamed(name: str, table: dict[str, str]) -> str:
    module, _, param = name.rpartition(".")
    return f"{table.get(module, module)}.{param}"


def vavae_state_dict(state: Any, levels: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The diffusers ``AutoencoderKL`` weights of an LDM / VA-VAE checkpoint (``{"state_dict": ...}``
    as LightningDiT's ``tokenizer/vavae.py`` reads it, or the state dict itself) and the prefixes of
    the training-only weights left out."""
    sd = state.get("state_dict", state) if isinstance(state, dict) else None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError("the VA-VAE checkpoint holds no state dict of tensors (its 'state_dict', or itself)")
    unknown = [k for k in sd if not k.startswith(_NETWORK_PREFIXES + IGNORED_PREFIXES)]
    if unknown:
        raise ValueError(
            f"the VA-VAE checkpoint has weights of no LDM AutoencoderKL part: {', '.join(sorted(unknown)[:4])}"
            f"{' ...' if len(unknown) > 4 else ''}; expected encoder., decoder., quant_conv., post_quant_conv. "
            f"(and the training-only {', '.join(IGNORED_PREFIXES)})"
        )
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key.startswith(IGNORED_PREFIXES):
            continue
        name = _rename(key, levels)
        if ".attentions." in name and value.ndim == 4:  # LDM's 1x1 convolutions -> diffusers' linear layers
            value = value[:, :, 0, 0]
        out[name] = value.detach().clone().contiguous()
    ignored = sorted({p for p in IGNORED_PREFIXES if any(k.startswith(p) for k in sd)})
    return out, ignored


def convert_vavae(checkpoint: Union[str, Path], config: Union[str, Path], output: Union[str, Path]) -> dict[str, Any]:
    """Write the VA-VAE ``checkpoint`` (LDM ``AutoencoderKL`` of yaml ``config``) as a diffusers
    ``AutoencoderKL`` directory ``output`` (built beside it and renamed into place). Returns the
    diffusers config and the training-only weight prefixes left out."""
    from diffusers.models import AutoencoderKL

    params = read_vavae_config(config)
    cfg = diffusers_vae_config(params)
    state = read_weights(checkpoint, VAVAE_FILE)
    weights, ignored = vavae_state_dict(state, len(cfg["block_out_channels"]))
    vae = AutoencoderKL(**cfg)
    expected = {k: tuple(v.shape) for k, v in vae.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if expected != got:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        shapes = [f"{k} {got[k]} (config: {expected[k]})" for k in expected if k in got and got[k] != expected[k]]
        detail = "; ".join(
            f"{what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
            for what, names in (("missing", missing), ("unexpected", extra), ("shapes", shapes))
            if names
        )
        raise ValueError(
            f"checkpoint '{checkpoint}' does not match --config {config} ({detail}): give the yaml the checkpoint "
            "was trained with"
        )
    vae.load_state_dict(weights, strict=True)
    with replace_directory(Path(output)) as tmp:
        vae.save_pretrained(str(tmp), safe_serialization=True)
    return {"config": cfg, "ignored": ignored}
