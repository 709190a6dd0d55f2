"""Every ``dit-lightning`` command line the documentation shows still parses: README.md, docs/,
notebooks/README.md and the usage comments of configs/ are read, each command line (in code blocks
and inline code, continuation lines joined, ``torchrun ... -m dit_lightning.cli`` included) is run
in this process up to its argument parsing (``--print_config``: fit / validate / test / predict
resolve their configs and options and stop before any work; a tool parses its options and stops
before it runs), so an option renamed or removed fails here, not in a reader's terminal.

A ``...`` stands for what the reader fills in: it is dropped, with the option before it. Lines of
output in code blocks (``dit-lightning fit: ...``) are not commands and are skipped.
"""

from __future__ import annotations

import inspect
import re
import shlex
from pathlib import Path

import pytest

from dit_lightning.cli import SUBCOMMANDS, main
from dit_lightning.commands import TOOLS, tool

ROOT = Path(__file__).resolve().parents[1]
# What the documentation is; benchmarks' result tables record the commands of past runs, not usage.
DOC_FILES = sorted(
    [
        ROOT / "README.md",
        ROOT / "notebooks" / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "configs").rglob("*.yaml"),
    ]
)
_FENCE = re.compile(r"^\s*```")
_INLINE = re.compile(r"`([^`\n]*dit-lightning [^`\n]*)`")
_ASSIGN = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$")
_SHELL_END = {">", ">>", "|", "&&", "||", ";", "2>&1", "&"}


def _logical_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines that may hold commands: a YAML file's comments, a Markdown
    file's code blocks and inline code spans; continuation lines (ending in a backslash) joined."""
    lines = path.read_text().splitlines()
    out: list[tuple[int, str]] = []
    if path.suffix == ".yaml":
        candidates = [
            (i, re.sub(r"^\s*#\s?", "", line)) for i, line in enumerate(lines, 1) if line.lstrip().startswith("#")
        ]
    else:
        candidates, fenced = [], False
        for i, line in enumerate(lines, 1):
            if _FENCE.match(line):
                fenced = not fenced
            elif fenced:
                candidates.append((i, line))
            else:
                candidates += [(i, span) for span in _INLINE.findall(line)]
    pending: tuple[int, str] | None = None
    for i, text in candidates:
        if pending is not None:
            pending = (pending[0], pending[1] + " " + text.strip())
        else:
            pending = (i, text)
        if pending[1].rstrip().endswith("\\"):
            pending = (pending[0], pending[1].rstrip()[:-1])
            continue
        out.append(pending)
        pending = None
    if pending is not None:
        out.append(pending)
    return out


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, arguments after ``dit-lightning``) of every documented command line."""
    found: list[tuple[str, list[str]]] = []
    for path in DOC_FILES:
        variables: dict[str, str] = {}
        for number, text in _logical_lines(path):
            text = text.strip().removeprefix("$ ")
            assignment = _ASSIGN.match(text)
            if assignment:  # PAPER="--config ..." in the same file
                variables[assignment.group(1)] = " ".join(shlex.split(assignment.group(2)))
                continue
            for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):  # $PAPER_X before $PAPER
                text = text.replace(f"${{{name}}}", value).replace(f"${name}", value)
            try:
                tokens = shlex.split(text, comments=True)
            except ValueError:
                continue
            for start, token in enumerate(tokens):
                if token == "dit-lightning" or (token == "dit_lightning.cli" and start and tokens[start - 1] == "-m"):
                    break
            else:
                continue
            args: list[str] = []
            for token in tokens[start + 1 :]:
                if token in _SHELL_END:
                    break
                if token == "...":  # a placeholder, and the option it is the value of
                    if args and args[-1].startswith("--") and "=" not in args[-1]:
                        args.pop()
                    continue
                args.append(token)
            if len(args) == 1 and args[0] != "--help":
                continue  # the name of a command in a sentence ("`dit-lightning sample` turns..."), not a command line
            if args and (args[0] in SUBCOMMANDS or args[0] in TOOLS or args[0] in ("-h", "--help")):
                found.append((f"{path.relative_to(ROOT)}:{number}", args))
    return found


COMMANDS = documented_commands()


def _parse_only(args: list[str]) -> list[str]:
    """``args`` made to stop after parsing: ``--print_config``, and for a tool a placeholder for each
    required argument a fragment of a command (``sample ... --rank 3``) leaves out."""
    if args[0] in TOOLS:
        given = {a.split("=")[0] for a in args if a.startswith("--")}
        required = [
            name
            for name, p in inspect.signature(tool(args[0])).parameters.items()
            if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
        ]
        args = [*args, *(x for name in required if f"--{name}" not in given for x in (f"--{name}", "PLACEHOLDER"))]
    if any(a in ("-h", "--help") or a.endswith(".help") for a in args):
        return args  # a help request stops after parsing by itself (exit 0)
    return [*args, "--print_config"] if args[0] in (*SUBCOMMANDS, *TOOLS) else args


def test_the_documentation_shows_commands():
    """The extraction finds them (a change of the docs' layout must not turn this test into a no-op)."""
    where = {w.split(":")[0] for w, _ in COMMANDS}
    assert len(COMMANDS) > 60 and {"README.md", "docs/sampling.md", "docs/shrinking.md", "docs/planner.md"} <= where
    kinds = {args[0] for _, args in COMMANDS}
    assert {"fit", "test", "sample", "evaluate", "export", "prune", "plan", "verify", "extract"} <= kinds


@pytest.fixture
def one_parser(monkeypatch):
    """The LightningCLI parser built once for all the lines (building it is most of a parse's time):
    the same parser ``dit-lightning fit`` builds, reused; each line is still parsed from scratch."""
    from dit_lightning.lightning_cli import DiTCLI

    built: dict[bool, tuple] = {}
    setup = DiTCLI.setup_parser

    def setup_once(self, add_subcommands, main_kwargs, subparser_kwargs):
        if add_subcommands not in built:
            setup(self, add_subcommands, main_kwargs, subparser_kwargs)
            built[add_subcommands] = (self.parser, getattr(self, "_subcommand_method_arguments", None))
        self.parser, methods = built[add_subcommands]
        if methods is not None:
            self._subcommand_method_arguments = methods

    monkeypatch.setattr(DiTCLI, "setup_parser", setup_once)


def test_every_documented_command_line_parses(capsys, monkeypatch, one_parser):
    monkeypatch.chdir(ROOT)  # the docs' paths (configs/...) are relative to the repository
    failures = []
    done: set[tuple[str, ...]] = set()
    for where, args in COMMANDS:
        if tuple(args) in done:
            continue
        done.add(tuple(args))
        try:
            main(_parse_only(args))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        err = capsys.readouterr().err
        if code != 0:
            failures.append(
                f"{where}: dit-lightning {shlex.join(args)}\n    {err.strip().splitlines()[0] if err else code}"
            )
    assert not failures, f"{len(failures)} documented command line(s) no longer parse:\n" + "\n".join(failures)


def test_a_removed_option_is_caught(capsys, monkeypatch, one_parser):
    """The check itself: an option that does not exist fails parsing (not only when the run starts)."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        main(_parse_only(["fit", "--config", "configs/demo.yaml", "--trainer.gpus", "1"]))
    assert e.value.code != 0 and "trainer.gpus" in capsys.readouterr().err
