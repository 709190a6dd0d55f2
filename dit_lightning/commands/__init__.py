"""The ``dit-lightning`` tools besides fit/validate/test/predict: one module per tool, each thin
over library functions. :data:`TOOLS` is the one table the CLI builds its tool list from."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# tool name -> (module under dit_lightning.commands, function, one-line summary); a tool's module is
# imported only when it runs.
TOOLS: dict[str, tuple[str, str, str]] = {
    "extract": ("extract", "extract", "an ImageFolder -> a latent store (VAE posteriors), resumable, multi-GPU"),
    "prepare-digits": ("prepare_digits", "prepare_digits", "the demo's store from scikit-learn's bundled digits"),
    "export": (
        "export",
        "export",
        "a checkpoint -> reference {model, ema, opt, args}, raw, .safetensors or diffusers DiTPipeline",
    ),
    "consolidate": ("consolidate", "consolidate", "a sharded (FSDP) checkpoint directory -> one file"),
    "prune": ("prune", "prune", "a smaller DiT: fewer blocks, MLP channels or heads"),
    "plan": ("plan", "plan", "predicted GPU memory; --fit: the fastest setting that fits a GPU"),
    "sample": ("sample", "sample", "images from a checkpoint: PNGs, grid, ADM .npz; keyed, resumable"),
    "evaluate": ("evaluate", "evaluate", "sample, then FID / IS / KID (or the digits metrics)"),
    "verify": ("verify", "verify", "check a latent store (sizes, checksums, NaN) or a checkpoint's weights"),
    "convert-vavae": (
        "convert_vavae",
        "convert_vavae",
        "LightningDiT's VA-VAE checkpoint -> a diffusers AutoencoderKL",
    ),
}


def tool(name: str) -> Callable:
    """The function of tool ``name``."""
    module, function, _ = TOOLS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), function)


def run_tool(name: str, args: list[str], **parser_options: Any) -> Any:
    """Run tool ``name`` on its command line ``args``: through its module's own ``command_line`` where
    it has one (``plan``: a flag per field of the planner's options object), else jsonargparse's CLI
    of the function."""
    own = getattr(importlib.import_module(f"{__name__}.{TOOLS[name][0]}"), "command_line", None)
    if own is not None:
        return own(args, **parser_options)
    from jsonargparse import CLI

    return CLI(tool(name), args=args, **parser_options)


def tool_parser(name: str, **parser_options: Any) -> Any:
    """The argument parser of tool ``name`` (for "did you mean" after a bad option)."""
    own = getattr(importlib.import_module(f"{__name__}.{TOOLS[name][0]}"), "parser", None)
    if own is not None:
        return own(**parser_options)
    from jsonargparse import auto_parser

    return auto_parser(tool(name), **parser_options)
