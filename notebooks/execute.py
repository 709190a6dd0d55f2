"""Execute the notebooks in place, keeping their outputs (for maintainers, before committing).

    python notebooks/execute.py                      # all notebooks/*.ipynb, FAST settings
    python notebooks/execute.py 03_sampling.ipynb    # one
    python notebooks/execute.py --full               # DIT_NOTEBOOK_FAST=0: the real sizes (slow on CPU)
    python notebooks/execute.py --check              # only report absolute paths in the committed outputs

Each notebook runs top to bottom in a fresh kernel of *this* interpreter (a temporary
``python3`` kernelspec pointing at ``sys.executable`` is put first on ``JUPYTER_PATH``, so the
ipykernel of this environment is used whatever kernels are installed elsewhere), with the
notebooks' folder as its working directory, as Jupyter would start it. A cell that raises
stops the run with the cell's traceback and leaves the file untouched.

Committed outputs must not leak this machine's paths: after a run, paths under the repository,
the Python installation, the home directory or the temporary directory found in text outputs are
replaced by ``<repo>``, ``<python>``, ``~`` and ``<tmp>`` and listed (a notebook should not print
them in the first place). ``tests/test_notebooks.py`` uses the same functions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

NOTEBOOKS = Path(__file__).resolve().parent
ROOT = NOTEBOOKS.parent


@contextlib.contextmanager
def current_python_kernel() -> Iterator[str]:
    """A ``python3`` kernelspec running ``sys.executable -m ipykernel_launcher``, first on JUPYTER_PATH."""
    old = os.environ.get("JUPYTER_PATH")
    with tempfile.TemporaryDirectory(prefix="dit-kernel-") as d:
        spec_dir = Path(d, "kernels", "python3")
        spec_dir.mkdir(parents=True)
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (ipykernel)",
            "language": "python",
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1))
        os.environ["JUPYTER_PATH"] = os.pathsep.join([d] + ([old] if old else []))
        try:
            yield "python3"
        finally:
            if old is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = old


def _machine_paths() -> list[tuple[str, str]]:
    """(absolute prefix, placeholder), longest first, so nested prefixes are replaced correctly."""
    pairs = {
        str(ROOT): "<repo>",
        os.path.realpath(ROOT): "<repo>",
        sys.prefix: "<python>",
        sys.base_prefix: "<python>",
        os.path.realpath(sys.prefix): "<python>",
        tempfile.gettempdir(): "<tmp>",
        os.path.realpath(tempfile.gettempdir()): "<tmp>",
        "/tmp": "<tmp>",
    }
    home = os.path.expanduser("~")
    if home not in ("", "/", "~"):
        pairs[home] = "~"
    return sorted(((k, v) for k, v in pairs.items() if k and k != "/"), key=lambda kv: -len(kv[0]))


def _text_fields(output: dict) -> Iterator[tuple[dict, str]]:
    """(container, key) of every text field of a cell output (images are skipped)."""
    if output.get("output_type") == "stream":
        yield output, "text"
    elif output.get("output_type") == "error":
        for i in range(len(output.get("traceback", []))):
            yield output["traceback"], i  # type: ignore[misc]
    for mime in ("text/plain", "text/markdown", "text/html"):
        if mime in output.get("data", {}):
            yield output["data"], mime


def find_machine_paths(nb: Any, prefixes: Optional[list[str]] = None, allowed: Optional[list[str]] = None) -> list[str]:
    """``"cell N: <snippet>"`` for every absolute path of this machine in the outputs of ``nb``
    (``prefixes``: default every machine path; a path under one of ``allowed`` is not reported)."""
    allowed = [a for a in (allowed or []) if a]
    prefixes = sorted(set(prefixes or [p for p, _ in _machine_paths()]) | set(allowed), key=len, reverse=True)
    hits = []
    for n, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            for container, key in _text_fields(output):
                value = container[key]
                text = "".join(value) if isinstance(value, list) else str(value)
                seen: set[int] = set()  # positions already reported under a longer prefix
                for p in prefixes:
                    start = 0
                    while (at := text.find(p, start)) >= 0:
                        start = at + 1
                        end = at + len(p)
                        if at in seen or not (end == len(text) or text[end] in "/\\'\" :\n"):
                            continue
                        seen.add(at)
                        if p in allowed:
                            continue
                        hits.append(f"cell {n}: ...{text[max(0, at - 20) : end + 40]!r}...")
    return hits


def scrub_machine_paths(nb: Any) -> list[str]:
    """Replace this machine's absolute paths in the text outputs of ``nb``; returns what was found."""
    found = find_machine_paths(nb)
    pairs = _machine_paths()
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            for container, key in _text_fields(output):
                value = container[key]
                is_list = isinstance(value, list)
                text = "".join(value) if is_list else str(value)
                for p, placeholder in pairs:
                    text = text.replace(p, placeholder)
                container[key] = text.splitlines(keepends=True) if is_list else text
    return found


def execute_notebook(path: Path, cwd: Path = NOTEBOOKS, timeout: int = 600, output: Optional[Path] = None) -> Any:
    """Run ``path`` top to bottom in a fresh kernel with working directory ``cwd``; write the
    executed notebook to ``output`` (None: do not write). Raises on the first failing cell."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    with current_python_kernel() as kernel_name:
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name=kernel_name,
            record_timing=False,  # no per-cell timestamps: committed notebooks diff only when outputs change
            resources={"metadata": {"path": str(cwd)}},
        )
        client.execute()
    nb.metadata.get("language_info", {}).pop("version", None)  # do not record this machine's Python version
    if output is not None:
        nbformat.write(nb, output)
    return nb


def main(argv: Optional[list[str]] = None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*", help="notebook files (default: notebooks/*.ipynb)")
    parser.add_argument("--full", action="store_true", help="DIT_NOTEBOOK_FAST=0: the real sizes")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    parser.add_argument("--check", action="store_true", help="only report machine paths in the committed outputs")
    args = parser.parse_args(argv)
    paths = [Path(p) if Path(p).exists() else NOTEBOOKS / p for p in args.notebooks] or sorted(
        NOTEBOOKS.glob("*.ipynb")
    )
    status = 0
    if args.check:
        for path in paths:
            hits = find_machine_paths(nbformat.read(path, as_version=4))
            print(f"{path.name}: {'clean' if not hits else f'{len(hits)} machine path(s)'}")
            for h in hits:
                print("   ", h)
            status |= bool(hits)
        return status
    os.environ["DIT_NOTEBOOK_FAST"] = "0" if args.full else "1"
    for path in paths:
        load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
        start = time.perf_counter()
        nb = execute_notebook(path, timeout=args.timeout)
        seconds = time.perf_counter() - start
        scrubbed = scrub_machine_paths(nb)
        nbformat.write(nb, path)
        print(
            f"{path.name}: {seconds:.1f} s (load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})", flush=True
        )
        for h in scrubbed:
            print("    scrubbed", h)
    return status


if __name__ == "__main__":
    sys.exit(main())
