"""The ``dit-lightning`` command: ``fit | validate | test | predict`` through LightningCLI
(:mod:`dit_lightning.lightning_cli`), and the tools of :mod:`dit_lightning.commands`.

Errors a user can fix (a missing store, a bad setting, a checkpoint of another architecture...)
print one message that names the problem and the fix, without a traceback; ``--debug`` (or
``DIT_LIGHTNING_DEBUG=1``) shows the traceback. Lightning is imported only for the training
subcommands, so the tools start fast.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import traceback
from typing import NoReturn, Optional

from .commands import TOOLS
from .signals import SignalGuard, signal_behind

SUBCOMMANDS = ("fit", "validate", "test", "predict")
DEBUG_ENV = "DIT_LIGHTNING_DEBUG"
# Flags that read better without a value on the command line (`plan --fit`; `plan --fit true` as well).
_FLAG_ALIASES = {"plan": {"--fit": "--fit=true", "--json": "--format=json"}}
# Where the model's options are listed (`fit --help` shows only its class; --model.help needs a dotted path).
_MODEL_HELP = "--model.help dit_lightning.module.DiTModule"


def usage() -> str:
    """The top-level help: the training subcommands and every tool, one line each."""
    lines = [
        "usage: dit-lightning {fit,validate,test,predict} [--config CONFIG ...] [--OPTION VALUE ...]",
        "       dit-lightning TOOL [--OPTION VALUE ...]",
        "",
        "Train DiT (Peebles & Xie) on VAE latents with PyTorch Lightning.",
        "",
        "training (LightningCLI; `dit-lightning fit --help` lists every option):",
        "  fit        train (or resume with --ckpt_path last)",
        "  validate   held-out loss of a checkpoint",
        "  test       held-out loss and generated-image metrics (FID / IS / KID, or the digits metrics)",
        "  predict    sample images through Lightning (with a PredictionWriter callback)",
        "",
        "tools (`dit-lightning TOOL --help`):",
    ]
    for name, (_, _, summary) in TOOLS.items():
        lines.append(f"  {name:<16}{summary}")
    lines += [
        "",
        f"--debug (or {DEBUG_ENV}=1) shows the traceback of an error.",
        "Configs: configs/{model,data,hardware,experiment}/*.yaml, merged left to right; see README.md.",
    ]
    return "\n".join(lines)


def _unknown(command: str) -> NoReturn:
    close = difflib.get_close_matches(command, [*SUBCOMMANDS, *TOOLS], n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise SystemExit(
        f"dit-lightning: unknown command '{command}'.{hint}\n"
        f"Commands: {', '.join(SUBCOMMANDS)}; tools: {', '.join(TOOLS)} (dit-lightning --help)."
    )


def _message(error: BaseException) -> str:
    """The message of an error and of what caused it, without repeating the same text."""
    parts: list[str] = []
    seen: set[int] = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e).strip() or type(e).__name__
        if isinstance(e, (AttributeError, KeyError, TypeError, NameError, IndexError, AssertionError)):
            text = f"{type(e).__name__}: {text}"  # likely a bug, not a setting: say what kind
        for note in getattr(e, "__notes__", None) or []:  # the diagnosis added on the way (e.g. a lost rank)
            if str(note) not in parts:
                parts.insert(0, str(note))
        if not any(text in p for p in parts):
            parts.append(text)
        e = e.__cause__ or (e.__context__ if not e.__suppress_context__ else None)
    return "\n  caused by: ".join(parts)


_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _join_negative_values(args: list[str]) -> list[str]:
    """``--model.optimizer.lr -1e-3`` -> ``--model.optimizer.lr=-1e-3``: argparse takes a negative
    number in scientific notation for an option ("expected one argument"), so the value reaches
    the check that says what is wrong with it."""
    out: list[str] = []
    for a in args:
        if out and _NEGATIVE_NUMBER.match(a) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def _with_aliases(command: str, args: list[str]) -> list[str]:
    """``plan --fit`` -> ``--fit=true``, unless a value follows (``plan --fit true``)."""
    aliases = _FLAG_ALIASES.get(command, {})
    return [
        aliases[a] if a in aliases and (i + 1 == len(args) or args[i + 1].startswith("-")) else a
        for i, a in enumerate(args)
    ]


def _closest(given: str, options: list[str]) -> Optional[str]:
    """The option a misspelled or abbreviated ``given`` most likely means, with the others it
    abbreviates: ``--trainer.max_step`` -> ``--trainer.max_steps``; ``--trainer.acc`` ->
    ``--trainer.accelerator (or --trainer.accumulate_grad_batches)``; None if nothing is close."""
    options = [o for o in options if not o.endswith((".help", "+")) or o.startswith(given)]
    prefixed = [o for o in options if o.startswith(given)]
    ranked = difflib.get_close_matches(given, prefixed or options, n=3, cutoff=0.0 if prefixed else 0.6)
    if not ranked:
        return None
    others = ranked[1:] if prefixed else []
    return ranked[0] + (f" (or {', '.join(others)})" if others else "")


def _class(class_path: str) -> type:
    """The class ``class_path`` names (one jsonargparse has just resolved)."""
    import importlib

    module, name = class_path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _class_options(class_path: str) -> list[str]:
    """The init arguments jsonargparse accepts for ``class_path`` (a class it has just resolved)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(_class(class_path), fail_untyped=False)
    return [a.dest for a in parser._actions if a.dest != "help"]


def _option_error(error: BaseException, command: str) -> Optional[tuple[str, str]]:
    """(message, where the options are listed) for an option that does not exist, with the closest
    that does, or a bad value of a class's option (``--model.depth abc``) without jsonargparse's
    nesting of the ``model`` union; None for other errors. Options are never abbreviated
    (``allow_abbrev=False``): a prefix is refused with the option it abbreviates."""
    chain: list[BaseException] = []
    e: Optional[BaseException] = error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = [str(e) for e in chain]
    listed = f"dit-lightning {command} --help lists the options"
    unrecognized = re.match(r"unrecognized arguments: (-\S+)", text[0])
    if unrecognized:
        given = unrecognized.group(1).split("=", 1)[0]
        parser = getattr(error, "parser", None)
        close = _closest(given, [o for a in getattr(parser, "_actions", []) for o in a.option_strings])
        if command in SUBCOMMANDS:
            listed += f"; the model's: dit-lightning {command} {_MODEL_HELP}"
        hint = f"; did you mean {close}?" if close else ""
        return f"unknown option {given}{hint} (options are not abbreviated)", listed
    # an option of a class chosen by class_path (--model.hiden_size, --model.depth abc), wrapped by jsonargparse
    prefix = re.match(r'Parser key "([^"]+)"', text[0])
    nested = re.findall(r"NestedArg\(key='([^']+)'", text[0])  # the last one is the outermost's own
    class_paths = [m for t in text for m in re.findall(r"class_path[ =]'([\w.]+)'", t)]
    if prefix is None or not nested or not class_paths:
        return None
    given, class_path = f"--{prefix.group(1)}.{nested[-1]}", class_paths[-1]
    name = class_path.rsplit(".", 1)[1]
    at = ".".join(k for k in (prefix.group(1), nested[-1].rpartition(".")[0].replace(".init_args", "")) if k)
    listed = f"dit-lightning {command} --{at}.help {class_path} lists the options of {name}"
    inner = text[-1]  # the innermost: what is wrong with the value
    # a plain subtype's mismatch (trainer.strategy is Union[str, Strategy]): the class's own error is listed
    if inner.startswith("Expected a <class '"):
        from .lightning_cli import class_error_in_union

        inner = class_error_in_union(text[0]) or inner
    unknown = re.search(r"Option '([^']+)' is not accepted", inner)
    if unknown and given.endswith(unknown.group(1)):
        key = unknown.group(1)
        close = _closest(key, _class_options(class_path))
        hint = f"; did you mean {given[: -len(key)]}{close}?" if close else ""
        known = getattr(_class(class_path), "unknown_option_hints", {}).get(key)  # what the option is called there
        return f"{given}: {name} has no option '{key}'{hint}" + (f": {known}" if known else ""), listed
    reason = re.sub(r'^Parser key "[^"]+":\s*', "", inner).strip()
    return f"{given}: {reason}", listed


def _run(args: list[str]) -> None:
    command = args[0]
    if command in TOOLS:
        from jsonargparse import ArgumentError

        from .commands import run_tool, tool_parser

        options: dict = {"as_positional": False, "prog": f"dit-lightning {command}", "exit_on_error": False}
        options["allow_abbrev"] = False  # --num_step is not --num_steps: refused, with the option it abbreviates
        try:
            run_tool(command, _with_aliases(command, args[1:]), **options)
        except ArgumentError as e:
            e.parser = tool_parser(command, **options)  # type: ignore[attr-defined]  # for "did you mean"
            raise
        return
    from .lightning_cli import run_lightning_cli

    run_lightning_cli(args)


def main(argv: Optional[list[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0", "false")
    args = _join_negative_values([a for a in args if a != "--debug"])
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return
    if args[0] not in SUBCOMMANDS and args[0] not in TOOLS:
        if args[0].startswith("-"):  # e.g. `dit-lightning --config x.yaml`: LightningCLI needs a subcommand
            raise SystemExit(f"dit-lightning: a command comes first ({', '.join(SUBCOMMANDS)} or a tool); see --help")
        _unknown(args[0])
    try:
        with SignalGuard(f"dit-lightning {args[0]}"):  # SIGTERM / Ctrl-C: exit 143 / 130, nothing half-written
            _run(args)
    except KeyboardInterrupt:
        print(f"\ndit-lightning {args[0]}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as error:  # every other error: one clear message, the traceback on request
        stop = signal_behind(error)
        if stop is not None:  # a second signal stopped a library's write, which then failed on its half-written file
            stop.report(f"dit-lightning {args[0]}")
            raise stop from None
        if debug:
            raise
        name = type(error).__name__
        if name == "ArgumentError":  # jsonargparse: a bad option or value
            known = _option_error(error, args[0])
            message, listed = known or (_message(error), f"dit-lightning {args[0]} --help lists the options")
            print(f"dit-lightning {args[0]}: error: {message}", file=sys.stderr)
            print(f"({listed})", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"dit-lightning {args[0]}: error: {_message(error)}", file=sys.stderr)
        print(f"(add --debug, or set {DEBUG_ENV}=1, for the traceback)", file=sys.stderr)
        if os.environ.get(DEBUG_ENV) is None and not isinstance(error, (ValueError, OSError, RuntimeError)):
            # an unexpected kind of error is more likely a bug: keep its last frame visible
            frame = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
            for f in frame:
                print(f"  at {f.filename}:{f.lineno} ({f.name})", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
