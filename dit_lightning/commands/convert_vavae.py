"""``dit-lightning convert-vavae``: LightningDiT's VA-VAE checkpoint -> a diffusers ``AutoencoderKL`` directory."""

from __future__ import annotations

import os
from typing import Any, Optional

from ..checkpoints.vavae import convert_vavae as convert
from .output import check_new_output


def _check_replaceable(output: str) -> None:
    """Only an earlier conversion (a diffusers VAE directory) or an empty directory is replaced."""
    if not os.path.isdir(output) or not os.listdir(output):
        return
    if os.path.isfile(os.path.join(output, "config.json")) and any(
        name.startswith("diffusion_pytorch_model") for name in os.listdir(output)
    ):
        return
    raise FileExistsError(f"--output {output} exists and is not a diffusers VAE directory: choose another --output")


def convert_vavae(checkpoint: str, config: str, output: str, overwrite: bool = False) -> str:
    """Convert LightningDiT's VA-VAE (an LDM AutoencoderKL, e.g. vavae-imagenet256-f16d32-dinov2.pt)
    into a diffusers ``AutoencoderKL`` directory that ``extract --vae``, ``sample`` and the
    diffusers export load like any other VAE. Exact: the same images and encoder moments.

    Args:
        checkpoint: the VA-VAE ``.pt`` (``{"state_dict": ...}``, read weights-only). Its training-only
            weights (``loss.*``, ``foundation_model.*``, ``linear_proj.*``) are left out.
        config: its yaml (LightningDiT's ``tokenizer/configs/vavae_f16d32.yaml``): ``model.params``
            ``ddconfig`` and ``embed_dim``.
        output: the directory to write (built beside it and renamed into place).
        overwrite: replace an existing ``output`` (only an earlier conversion or an empty directory).
    """
    check_new_output(output, overwrite, directory=True)
    _check_replaceable(output)
    result = convert(checkpoint, config, output)
    cfg = result["config"]
    attends = [b.startswith("Attn") for b in cfg["down_block_types"]]
    print(
        f"converted {checkpoint} -> {output}: diffusers AutoencoderKL, {cfg['latent_channels']} latent channels, "
        f"f{2 ** (len(attends) - 1)}, attention at level(s) {[i for i, a in enumerate(attends) if a]} and mid"
    )
    if result["ignored"]:
        print(f"left out the training-only weights {', '.join(p + '*' for p in result['ignored'])}")
    print(
        "scaling_factor 1.0: VA-VAE has no scale factor (LightningDiT normalises its latents per channel with the "
        "training set's mean and std); extract its store with --latent_norm channel_stats"
    )
    return output


def parser(**options: Any) -> Any:
    """The command line of ``convert-vavae``: its own, because ``--config`` is VA-VAE's yaml here (in
    jsonargparse's CLI of a function ``--config`` reads the flags from a file)."""
    from jsonargparse import ArgumentParser

    options.pop("as_positional", None)  # (an option of jsonargparse's CLI, not of a parser)
    p = ArgumentParser(description=(convert_vavae.__doc__ or "").split("\n")[0], **options)
    p.add_function_arguments(convert_vavae, as_group=False)
    return p


def command_line(args: list[str], **parser_options: Any) -> Optional[str]:
    """``dit-lightning convert-vavae ARGS``: parse, then :func:`convert_vavae`; ``--print_config`` prints
    the parsed options and stops, as every tool's (here by hand: ``--config`` is not a file of flags)."""
    p = parser(**parser_options)
    cfg = p.parse_args([a for a in args if a != "--print_config"])
    if "--print_config" in args:
        print(p.dump(cfg).rstrip("\n"))
        return None
    return convert_vavae(**cfg.as_dict())
