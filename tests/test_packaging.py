"""The extras of pyproject.toml hold what their users run: ``[notebooks]`` everything the notebooks
and ``notebooks/execute.py`` import, the kernel, and Jupyter itself (README.md: "Jupyter"; JupyterLab
to open them, nbconvert to execute them from the command line); ``[test]`` what executes them
headless in the test suite."""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _extra(name: str) -> set[str]:
    """The distributions an extra brings (its references to other extras of this project expanded)."""
    out: set[str] = set()
    for req in PROJECT["optional-dependencies"][name]:
        extras = re.search(r"\[(.*)\]", req)
        if _name(req) == "dit-lightning" and extras:
            for inner in extras.group(1).split(","):
                out |= _extra(inner.strip())
        else:
            out.add(_name(req))
    return out


def _closure(names: set[str]) -> set[str]:
    """``names`` and, for those installed here, every distribution they require (any extra markers ignored)."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def _notebook_imports() -> set[str]:
    """Top-level modules the notebooks and notebooks/execute.py import (at any depth of their code)."""
    sources = [(ROOT / "notebooks" / "execute.py").read_text()]
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "code":
                code = "".join(cell["source"])
                sources.append(
                    "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
                )
    modules: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules.add(node.module.split(".")[0])
    return {m for m in modules if m not in sys.stdlib_module_names and m not in ("dit_lightning", "__future__")}


def test_the_notebooks_extra_brings_what_the_notebooks_use_and_jupyter():
    notebooks = _extra("notebooks")
    assert {"jupyterlab", "nbconvert", "ipykernel", "nbclient", "nbformat", "matplotlib", "scikit-learn"} <= notebooks
    provided = _closure(notebooks | {_name(r) for r in PROJECT["dependencies"]})
    by_module = md.packages_distributions()
    missing = {
        module: by_module.get(module, ["?"])
        for module in _notebook_imports()
        if not {d.lower().replace("_", "-") for d in by_module.get(module, [])} & provided
    }
    assert not missing, f"imported by the notebooks but in no dependency of [notebooks]: {missing}"


def test_the_test_extra_executes_the_notebooks_headless():
    assert {"nbclient", "nbformat", "ipykernel", "matplotlib", "scikit-learn", "pytest"} <= _extra("test")
