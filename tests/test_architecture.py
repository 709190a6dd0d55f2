"""The package's imports follow the layers of docs/architecture.md (read from its table): a module
imports only its own layer or lower ones, only the Lightning layers import Lightning, models/ and
diffusion/ import nothing above the foundation, and there are no import cycles."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dit_lightning"
DOC = ROOT / "docs" / "architecture.md"
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def layer_table() -> dict[str, tuple[int, bool]]:
    """{module prefix (without 'dit_lightning.'): (layer, may import Lightning)} from the doc."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*(\d+) \w+\s*\|(.+)\|\s*(yes|no)\s*\|", line)
        if m:
            for name in re.findall(r"`([\w.]+)`", m.group(2)):
                rows[name] = (int(m.group(1)), m.group(3) == "yes")
    return rows


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _skipped(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` blocks never run (names for type checkers only). Everything else counts,
    imports under ``if __name__ == "__main__":`` too: running a module as a script imports them."""
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Absolute names of everything ``path`` imports (lazy, in-function imports included)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _skipped(node):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            # `from . import store` / `from .. import x` import submodules
            found.update(f"{mod}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in (root / "dit_lightning").rglob("*.py")}


def classify(name: str, table: dict[str, tuple[int, bool]]) -> tuple[int, bool]:
    """The row of the most specific table entry covering ``dit_lightning.<name>``."""
    rel = name.removeprefix("dit_lightning").lstrip(".")
    best = None
    for key in table:
        if rel == key or rel.startswith(key + "."):
            if best is None or len(key) > len(best):
                best = key
    if best is None:
        raise KeyError(rel)
    return table[best]


def package_imports(known: dict[str, Path], root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the package modules it imports (a name that is an attribute of a module, like
    ``dit_lightning.models.DiT``, resolves to that module)."""
    graph = {}
    for name, path in known.items():
        targets = set()
        for imported in imports_of(path, root):
            while imported and imported not in known:
                imported = imported.rpartition(".")[0]
            if imported.startswith("dit_lightning") and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def test_the_table_covers_every_module():
    table = layer_table()
    assert len(table) >= 20, "docs/architecture.md lost its layer table"
    for name in modules():
        if name == "dit_lightning":
            continue
        try:
            classify(name, table)
        except KeyError:
            pytest.fail(f"{name} is in no layer of docs/architecture.md: add it to the table")


def layer_violations(root: Path = ROOT) -> list[str]:
    table = layer_table()
    known = modules(root)
    graph = package_imports(known, root)
    wrong = []
    for name, path in sorted(known.items()):
        if name == "dit_lightning":
            continue
        layer, lightning_ok = classify(name, table)
        for target in sorted(graph[name]):
            if target == "dit_lightning":
                continue
            target_layer, _ = classify(target, table)
            if target_layer > layer:
                wrong.append(f"{name} (layer {layer}) imports {target} (layer {target_layer})")
        if not lightning_ok:
            for imported in imports_of(path, root):
                if imported.split(".")[0] in LIGHTNING:
                    wrong.append(f"{name} (layer {layer}) imports {imported}")
    return wrong


def test_imports_go_down_the_layers_and_only_lightning_layers_import_lightning():
    wrong = layer_violations()
    assert not wrong, "imports against docs/architecture.md:\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", ["models", "diffusion"])
def test_network_packages_import_only_themselves_and_the_foundation(package):
    table = layer_table()
    graph = package_imports(modules())
    prefix = f"dit_lightning.{package}"
    for name, targets in graph.items():
        if name == prefix or name.startswith(prefix + "."):
            outside = [t for t in targets if not t.startswith(prefix) and classify(t, table)[0] > 0]
            assert not outside, f"{name} imports {outside}"


def test_no_import_cycles():
    graph = package_imports(modules())
    # a package's __init__ re-exports its submodules; a submodule importing a sibling through
    # the package is not a cycle of code, so edges into one's own package __init__ are dropped
    edges = {
        name: {
            t
            for t in targets
            if not (name.startswith(t + ".") and (PACKAGE.parent / (t.replace(".", "/") + "/__init__.py")).exists())
        }
        for name, targets in graph.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def strongconnect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_a_wrong_import(tmp_path):
    """The checker is not vacuous: in a copy of the package, a model module importing Lightning
    and the LightningModule is reported twice."""
    import shutil

    shutil.copytree(PACKAGE, tmp_path / "dit_lightning", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "dit_lightning" / "models" / "probe.py").write_text(
        "import lightning\nfrom ..module import DiTModule\n"
    )
    wrong = layer_violations(tmp_path)
    assert wrong == [
        "dit_lightning.models.probe (layer 1) imports dit_lightning.module (layer 3)",
        "dit_lightning.models.probe (layer 1) imports lightning",
    ]


def test_weights_files_are_read_only_by_safe_read_and_the_two_library_weights_files():
    """``torch.load`` is called once by ``safe_read`` (the foundation's reader of foreign files:
    every checkpoint, through ``checkpoints/safe_load.py``, and REPA encoder weights, which
    ``models/`` may read without importing ``checkpoints/``) and, outside it, once each for the
    InceptionV3 weights and the VAE's (both with ``weights_only=True``)."""
    calls = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                calls.append(name)
    assert sorted(calls) == ["dit_lightning.evaluation.fid", "dit_lightning.safe_read", "dit_lightning.vae"], calls
