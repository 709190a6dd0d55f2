"""The ``dit-lightning`` tools besides fit/validate/test/predict: one module per tool, each thin
over library functions. :data:`TOOLS` is the one table the CLI builds its tool list from."""

from __future__ import annotations

import importlib
from collections.abc import Callable

# tool name -> (module under dit_lightning.commands, function), imported only when the tool runs.
TOOLS: dict[str, tuple[str, str]] = {
    "extract": ("extract", "extract"),
    "prepare-digits": ("prepare_digits", "prepare_digits"),
    "export": ("export", "export"),
    "consolidate": ("consolidate", "consolidate"),
    "prune": ("prune", "prune"),
    "plan": ("plan", "plan"),
    "sample": ("sample", "sample"),
    "evaluate": ("evaluate", "evaluate"),
}


def tool(name: str) -> Callable:
    """The function of tool ``name``."""
    module, function = TOOLS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), function)
