"""LightningCLI for DiT: ``fit | validate | test | predict``, with the model linked to the data store,
every standard Lightning knob working, and one directory per run.

- The model's latent shape, classes, VAE and latent scale come from the data store (links), so a
  model and a store that do not match cannot be configured.
- Optimiser and learning-rate schedule are arguments of the model (``model.optimizer``,
  ``model.lr_scheduler``: any ``torch.optim`` class and any scheduler, defaults shown by
  ``--print_config``); LightningCLI's automatic top-level ``--optimizer`` is off, so nothing can
  silently do nothing.
- Checkpointing and the progress bar are on by default and configurable (``checkpoint.*``,
  ``progress_bar.*``); ``--trainer.enable_checkpointing false`` / ``enable_progress_bar false``,
  or another progress bar in ``trainer.callbacks``, turn the defaults off.
- The sample grid of a fit is the ``sample_grid`` section (a :class:`SampleGrid`, off unless a config
  enables it, as the demo's does): ``--sample_grid.enabled false``, ``--sample_grid.num_steps 20``...
  A ``SampleGrid`` listed in ``trainer.callbacks`` replaces it.
- Each ``fit`` is a run directory of the logger (``outputs/demo/version_N`` with its checkpoints,
  config, samples and logs), named in its first line and with its last checkpoint when the fit
  ends; ``outputs/demo/last.ckpt`` links the last checkpoint of the newest run that has saved one
  (only a write moves it) and ``--ckpt_path last`` reads it (or the newest ``last.ckpt`` in
  ``--checkpoint.dirpath`` when that is set), saying which run and step it found. Resuming a run's
  checkpoint continues in that run's directory; ``validate`` / ``test`` / ``predict`` of it log
  there too, at the checkpoint's step. Every CSV logger is a ``RunCSVLogger``: a continued run
  appends to the ``metrics.csv`` it finds, whatever the layout. A command refused before its first
  batch removes the directories it created.
- ``data.prepare: digits`` builds the digits store only at the path of the config that asks for it
  (a mistyped ``--data.path`` is refused); the ``digits`` metrics are left out, with a note, on
  any other store.
- Errors a class raises while it is built (a model setting that does not work, a bad ``init_from``)
  are reported as themselves, without jsonargparse's wrapping of the ``model`` union; options are
  never abbreviated; a GPU accelerator on a machine without one is refused before anything is built.
- ``--ckpt_path`` takes the architecture and settings the checkpoint was trained with for
  whatever the configs and the command line leave unset: settings given explicitly win.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from jsonargparse import ArgumentError
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import BasePredictionWriter, ModelSummary
from lightning.pytorch.callbacks.progress import ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from .autofit import AutoFitConfig
from .callbacks.checkpoint import (
    LATEST,
    DiTModelCheckpoint,
    newest_last_checkpoint,
    newest_run_checkpoint,
    run_directory_of,
)
from .callbacks.config_logger import ConfigLogger
from .callbacks.fault_tolerance import FaultTolerance, NonFiniteLossError
from .callbacks.generation import GenerationMetrics
from .callbacks.progress import DiTProgressBar
from .callbacks.samples import PredictionWriter, SampleGrid
from .checkpoints import NotATrainingCheckpointError, TrainingState, UnsafeCheckpointError, read_training_state
from .data import LatentDataModule
from .module import DiTModule
from .plugins import AtomicCheckpointIO, RunCSVLogger
from .ranks import close_process_group
from .signals import SignalExit
from .vae import vae_reference

# Lightning's CSV logger deletes a directory's metrics.csv: the CLI logs with RunCSVLogger
_CSV_LOGGERS = ("lightning.pytorch.loggers.CSVLogger", "lightning.pytorch.loggers.csv_logs.CSVLogger")
_RUN_CSV_LOGGER = f"{RunCSVLogger.__module__}.{RunCSVLogger.__name__}"

# Classes a checkpoint's hyper-parameters may name (``_class_path``): this package's, and the
# prefixes a user trusts explicitly (comma-separated). Naming a class imports its module.
TRUSTED_CLASSES_ENV = "DIT_LIGHTNING_TRUSTED_CLASSES"
_TRUSTED = ("dit_lightning.",)
_EVAL = ("validate", "test", "predict")


def _store_vae(data: LatentDataModule) -> str:
    return vae_reference(data.spec.vae)  # a store's local VAE directory, readable from any directory


def _shown(path: Union[str, Path]) -> str:
    """A path as a user would type it: relative to the working directory when inside it."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


# How jsonargparse wraps what a class raised while it was built (the model is a union with None).
_UNION = "Does not validate against any of the Union subtypes"
_WRAPPERS = (_UNION, "Problem with given class_path")
# A plain subtype's mismatch ("Expected a <class 'str'>"): what jsonargparse chains as the cause of a
# union's error when that subtype comes first (trainer.strategy is Union[str, Strategy])
_PLAIN_MISMATCH = "Expected a <class '"


def class_error_in_union(text: str) -> Optional[str]:
    """What the class subtype of a union option said, out of jsonargparse's listing of every
    subtype's error (``Errors:`` then ``- ...`` per subtype): the class's own check or the option it
    does not accept, without the plain subtypes' mismatches and jsonargparse's headers; None when
    the listing holds no such error. (jsonargparse chains only the first subtype's error as the
    cause: for ``Union[str, Strategy]``, "Expected a <class 'str'>".)"""
    listing = re.search(r"\n\s*Errors:\n(.*?)\n\s*Given value type:", text, re.S)
    if listing is None:
        return None
    lines = listing.group(1).splitlines()
    bullet = re.match(r"(\s*)- ", lines[0]) if lines else None
    if bullet is None:
        return None
    indent = bullet.group(1)
    entries: list[list[str]] = []
    for line in lines:
        if line.startswith(indent + "- "):
            entries.append([line[len(indent) + 2 :]])
        elif entries:
            entries[-1].append(line.strip())
    for entry in entries:
        if entry[0].startswith(_PLAIN_MISMATCH):
            continue
        kept = [line for line in entry if line and not re.match(r"(Problem with given class_path|Parser key)", line)]
        said = " ".join(kept)
        expected = re.findall(r"Expected a <class '(?:[\w]+\.)*(\w+)'>", said)
        if _UNION in said and expected:  # an option of the class that is itself a union (Optional[int]...)
            said = "expected " + " or ".join("None" if e == "NoneType" else e for e in expected)
        return said or None
    return None


def _raised_by_the_class(error: BaseException) -> BaseException:
    """The error a class raised in ``__init__`` (a model setting that does not work, a bad
    ``init_from``, a strategy's check...) out of jsonargparse's wrappers, which repeat it among the
    subtypes' errors followed by the whole configuration."""
    while error.__cause__ is not None and str(error).startswith(_WRAPPERS):
        cause = error.__cause__
        if str(error).startswith(_UNION) and str(cause).startswith(_PLAIN_MISMATCH):
            # the class's error is only in the listing: say it, with the class it came from
            said = class_error_in_union(str(error))
            if said is not None:
                named = re.search(r"Given value: Namespace\(class_path='[\w.]*?(\w+)'", str(error))
                return ValueError(f"{named.group(1)}: {said}" if named else said)
        error = cause
    return error


def _strategy_class(trainer: Any) -> None:
    """``--trainer.strategy dit_lightning.distributed.DiTDDPStrategy`` alone (no ``.init_args``): jsonargparse
    keeps the string (``Union[str, Strategy]`` tries str first) and Lightning reads it as a registered
    name, lower-cased. A dotted name is a class path: resolved here, and given to jsonargparse as one."""
    strategy = trainer.get("strategy") if hasattr(trainer, "get") else None
    if not isinstance(strategy, str) or "." not in strategy:
        return  # Lightning's registered names (ddp, fsdp, deepspeed_stage_2...) have no dot
    from jsonargparse import Namespace
    from lightning.pytorch.strategies import Strategy

    module, _, name = strategy.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"--trainer.strategy {strategy}: no such class ({e}); give a Lightning strategy name (ddp, fsdp...) or "
            "a Strategy's class path, e.g. dit_lightning.distributed.DiTDDPStrategy"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ValueError(f"--trainer.strategy {strategy} is not a Lightning Strategy class")
    trainer["strategy"] = Namespace(class_path=strategy)


def _check_accelerator(trainer: Any) -> None:
    """A GPU accelerator where PyTorch sees no GPU: one line with what to use instead (Lightning
    says "No supported gpu backend found!")."""
    accelerator = trainer.get("accelerator") if hasattr(trainer, "get") else None
    if not isinstance(accelerator, str) or accelerator.lower() not in ("gpu", "cuda", "mps"):
        return
    import torch

    name = accelerator.lower()
    cuda = torch.cuda.is_available()
    mps = hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    if (name == "gpu" and (cuda or mps)) or (name == "cuda" and cuda) or (name == "mps" and mps):
        return
    why = "this PyTorch is a CPU-only build" if name == "cuda" and torch.version.cuda is None else "none is visible"
    raise ValueError(
        f"--trainer.accelerator {accelerator}: this machine has no GPU PyTorch can use ({why}); "
        "use --trainer.accelerator cpu, or auto (a GPU where there is one, else the CPU)"
    )


def _quiet_third_party() -> None:
    """Silence what users cannot act on: torch's LeafSpec deprecation raised from inside Lightning
    2.6's own pytree code, LightningCLI's note about ``args`` (our ``main`` passes them on purpose),
    Lightning's advertisements for its cloud products, and its "Seed set to N" (the config has it;
    a fit's first line is its run directory)."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended")

    class _NoTips(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "Tip: For seamless cloud" not in record.getMessage()

    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_NoTips())
    # "Seed set to 0" came before everything, the run directory included: the seed is in the run's config
    logging.getLogger("lightning.fabric.utilities.seed").addFilter(lambda r: not r.getMessage().startswith("Seed set"))


class DiTModelSummary(ModelSummary):
    """Lightning's model summary with the DiT's analytic forward FLOPs per image in place of the
    "Total FLOPs: 0" that an ``example_input_array``-less module gets."""

    def __init__(self, max_depth: int = 1, **kwargs: Any) -> None:
        super().__init__(max_depth=max_depth, **kwargs)
        self._flops = 0

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        macs = getattr(pl_module, "forward_macs_per_image", None)
        self._flops = 2 * int(macs()) if callable(macs) else 0
        super().on_fit_start(trainer, pl_module)

    def summarize(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        if self._flops:
            if "total_flops" in kwargs:
                kwargs["total_flops"] = self._flops
            elif len(args) >= 6:
                args = (*args[:5], self._flops, *args[6:])
        return super().summarize(*args, **kwargs)


class DiTCLI(LightningCLI):
    """LightningCLI for DiTModule (or a subclass) and LatentDataModule; see the module docstring."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        # Subclass mode: DiTModule or a subclass (DistillationModule) chosen by model.class_path;
        # plain model arguments in a config mean DiTModule. Their arguments live under init_args.
        model = "model.init_args." if self.subclass_mode_model else "model."
        # (a list, not the store's tuple: hparams.yaml must read back with yaml.safe_load)
        parser.link_arguments("data.latent_shape", model + "latent_shape", compute_fn=list, apply_on="instantiate")
        parser.link_arguments("data.num_classes", model + "num_classes", apply_on="instantiate")
        parser.link_arguments("data", model + "vae", compute_fn=_store_vae, apply_on="instantiate")
        parser.link_arguments("data.scale_factor", model + "scale_factor", apply_on="instantiate")
        parser.link_arguments("data.latent_transform", model + "latent_transform", apply_on="instantiate")
        optimizers = {
            "optimizer": {
                "class_path": "torch.optim.AdamW",
                "init_args": {"lr": 1e-4, "betas": [0.9, 0.999], "weight_decay": 0.0},  # the paper's
            },
            "lr_scheduler": {"class_path": "dit_lightning.schedules.WarmupDecayLR"},
        }
        if self.subclass_mode_model:
            parser.set_defaults({"model": {"class_path": "dit_lightning.module.DiTModule", "init_args": optimizers}})
        else:
            parser.set_defaults({f"model.{k}": v for k, v in optimizers.items()})
        # Checkpointing (every N optimiser steps, plus last.ckpt) and the run-level progress bar
        # are on by default and configurable; the Trainer's switches turn them off.
        parser.add_lightning_class_args(DiTModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.every_n_train_steps": 1000})
        parser.add_lightning_class_args(DiTProgressBar, "progress_bar")
        # The end-of-fit sample grid: off unless a config enables it (the demo's does)
        parser.add_lightning_class_args(SampleGrid, "sample_grid")
        parser.set_defaults({"sample_grid.enabled": False})
        # What `test` measures besides the held-out loss: FID / IS / KID or the digits metrics of
        # freshly sampled images (`evaluation.metrics`; off while the list is empty).
        parser.add_lightning_class_args(GenerationMetrics, "evaluation")
        # --auto_fit true (or --auto_fit.memory_gib 6 ...): fit the run to its memory, recover from OOM.
        parser.add_argument(
            "--auto_fit",
            type=Optional[Union[bool, AutoFitConfig]],
            default=None,
            help="fit: choose micro-batch, accumulation, recomputed blocks (and precision if unset) from the memory "
            "each device has, and back off instead of dying on out-of-memory (docs/auto-fit.md)",
        )
        # Signals -> last.ckpt and a non-zero exit; a NaN loss stops the run; outputs checked up front.
        parser.add_lightning_class_args(FaultTolerance, "fault_tolerance")

    # ---- --ckpt_path ------------------------------------------------------------------------
    def parse_arguments(self, parser: Any, args: Any) -> None:
        self._args = list(args) if args is not None else sys.argv[1:]
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as e:  # the subcommand's options, for the CLI's "did you mean"
            subcommand = self._args[0] if self._args else ""
            e.parser = self._subcommand_parsers.get(subcommand, parser)  # type: ignore[attr-defined]
            raise

    def _logger_root(self, subconfig: Any) -> Optional[Path]:
        """``save_dir/name`` of the first configured logger with directories (TensorBoard, CSV...)."""
        logger = subconfig.get("trainer", {}).get("logger")
        if isinstance(logger, list):
            logger = logger[0] if logger else None
        if logger is None or logger is True:
            default_root = subconfig.get("trainer", {}).get("default_root_dir") or os.getcwd()
            return Path(default_root) / "lightning_logs"
        init = logger.get("init_args", {}) if hasattr(logger, "get") else {}
        save_dir = init.get("save_dir") if hasattr(init, "get") else None
        if not save_dir:
            return None
        name = init.get("name", "lightning_logs")
        return Path(save_dir) / (name or "")

    def _parse_ckpt_path(self) -> None:
        """Resolve ``--ckpt_path`` (``last``, a run's checkpoint), refuse what is not a Lightning
        checkpoint of this package, and take the checkpoint's settings for what is left unset."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        sub = self.config[subcommand]
        ckpt_path = sub_ckpt_path = sub.get("ckpt_path")
        root = self._logger_root(sub)
        if ckpt_path == "last":
            ckpt_path = str(self._last_checkpoint(sub, root))
        elif ckpt_path is None and subcommand in _EVAL:
            model = sub.get("model", {})
            init_from = model.get("init_args", model).get("init_from") if hasattr(model, "get") else None
            if not init_from:
                raise ValueError(
                    f"dit-lightning {subcommand} needs --ckpt_path: a checkpoint file, or `last` for the newest run "
                    "of this config. (To measure weights that are not a training checkpoint, pass them as "
                    "--model.init_from FILE.)"
                )
        if ckpt_path is None:
            return
        sub.ckpt_path = ckpt_path = str(Path(ckpt_path).resolve()) if Path(ckpt_path).exists() else ckpt_path
        self._continue_run(sub, subcommand, ckpt_path, root)
        state = self._training_state(ckpt_path)
        self._resumed_step = state.step  # names the config record of a resumed run
        if (
            sub_ckpt_path == "last" and subcommand != "fit"
        ):  # say which run the shared link found (fit's first line does)
            run = run_directory_of(ckpt_path, root) if root is not None else None
            rank_zero_info(f"--ckpt_path last: {f'run {run}, ' if run else ''}step {state.step} ({_shown(ckpt_path)})")
        hparams = self._checkpoint_hparams(state)
        if hparams:
            # defaults < the checkpoint's settings < configs and command line (in their order)
            recorded = json.dumps({"model": hparams}, default=lambda v: list(v) if isinstance(v, tuple) else str(v))
            self.config = self.parser.parse_args([self._args[0], "--config", recorded, *self._args[1:]])
            self.config[subcommand].ckpt_path = ckpt_path
            self._continue_run(self.config[subcommand], subcommand, ckpt_path, root)

    @staticmethod
    def _last_checkpoint(sub: Any, root: Optional[Path]) -> Path:
        """What ``--ckpt_path last`` reads: the newest ``last*.ckpt`` in ``--checkpoint.dirpath`` when
        the config sets one (where its fits write), else the newest run's under the logger's root."""
        checkpoint = sub.get("checkpoint")
        dirpath = checkpoint.get("dirpath") if hasattr(checkpoint, "get") else None
        if dirpath:
            found = newest_last_checkpoint(dirpath)
            looked = f"{Path(dirpath) / LATEST} (--checkpoint.dirpath)"
        else:
            found = newest_run_checkpoint(root) if root is not None else None
            looked = f"{root}/{LATEST} and {root}/version_*/checkpoints/{LATEST}"
        if found is None:
            raise FileNotFoundError(
                f"--ckpt_path last: no checkpoint of this config yet (looked for {looked}); train first, or give "
                "the checkpoint's path"
            )
        return found

    @staticmethod
    def _training_state(ckpt_path: str) -> TrainingState:
        """The checkpoint ``--ckpt_path`` names (a file or a sharded directory, whose ``.metadata``
        is vetted before Lightning unpickles it), or an error that says what to pass instead."""
        try:
            return read_training_state(ckpt_path)
        except FileNotFoundError:
            raise FileNotFoundError(f"--ckpt_path {ckpt_path} does not exist") from None
        except NotATrainingCheckpointError as e:
            raise ValueError(
                f"--ckpt_path {ckpt_path} is {e.kind}, not a Lightning training checkpoint: --ckpt_path resumes or "
                f"evaluates checkpoints written by `dit-lightning fit`. To start from these weights use "
                f"--model.init_from {ckpt_path}; to sample them, `dit-lightning sample --checkpoint {ckpt_path}`."
            ) from None
        except UnsafeCheckpointError:
            raise  # its message names the file and the code it would run
        except ValueError as e:  # empty, truncated, not a checkpoint at all
            raise ValueError(f"--ckpt_path {ckpt_path} is not a checkpoint: {e}") from None

    @staticmethod
    def _checkpoint_hparams(state: TrainingState) -> dict[str, Any]:
        """The model settings the checkpoint was trained with, as a config (a class path only if trusted)."""
        hparams = dict(state.hyper_parameters)
        hparams.pop("_instantiator", None)
        class_path = hparams.pop("_class_path", None)
        if class_path is None:
            return {k: v for k, v in hparams.items() if k not in ("optimizer", "lr_scheduler")}
        trusted = _TRUSTED + tuple(p.strip() for p in os.environ.get(TRUSTED_CLASSES_ENV, "").split(",") if p.strip())
        if not class_path.startswith(trusted):
            raise ValueError(
                f"--ckpt_path {state.path} names the class {class_path!r}, which is not one of this package's: "
                f"loading it would import (and run) that module. If you trust it, set {TRUSTED_CLASSES_ENV}="
                f"{class_path.rsplit('.', 1)[0]}."
            )
        return {"class_path": class_path, "init_args": hparams}

    def _continue_run(self, sub: Any, subcommand: str, ckpt_path: str, root: Optional[Path]) -> None:
        """A checkpoint inside ``<root>/version_K/checkpoints`` continues (fit) or is evaluated in the
        directory of that run, unless the logger's version is set explicitly."""
        if root is None:
            return
        version = run_directory_of(ckpt_path, root)
        logger = sub.get("trainer", {}).get("logger")
        if version is None or not hasattr(logger, "get") or "init_args" not in logger:
            return
        if logger["init_args"].get("version") is None:
            logger["init_args"]["version"] = version
            self._resumed_run = version

    def _keep_metrics_history(self, sub: Any) -> None:
        """Every CSV logger is a :class:`RunCSVLogger`: a continued run (a resumed fit, validate / test /
        predict) appends to the ``metrics.csv`` it finds, whatever the layout (Lightning's deletes it);
        a new fit starts its directory's file anew, as Lightning's does."""
        append = self.subcommand != "fit" or sub.get("ckpt_path") is not None
        logger = sub.get("trainer", {}).get("logger")
        for lg in logger if isinstance(logger, list) else [logger]:
            if hasattr(lg, "get") and lg.get("class_path") in (*_CSV_LOGGERS, _RUN_CSV_LOGGER) and lg.get("init_args"):
                lg["class_path"] = _RUN_CSV_LOGGER
                lg["init_args"]["append"] = append

    # ---- settings checked before anything is built ---------------------------------------------
    def _check_settings(self, sub: Any) -> None:
        """Values no class checks before work starts: a GPU accelerator without a GPU, learning
        rates, and the output directories the configs name (the run's own directories are checked
        again once they are known)."""

        def get(node: Any, key: str) -> Any:
            return node.get(key) if hasattr(node, "get") else None

        _check_accelerator(get(sub, "trainer"))
        self._check_digits_path(get(sub, "data"))
        model = get(sub, "model")
        lr = get(get(get(get(model, "init_args") or model, "optimizer"), "init_args"), "lr")
        if isinstance(lr, (int, float)) and not isinstance(lr, bool) and (lr < 0 or lr != lr):
            raise ValueError(
                f"--model.optimizer.lr {lr}: a learning rate must be a number >= 0 (the paper's is 1e-4; write it as "
                "--model.optimizer.lr=1e-4)"
            )
        if self.subcommand != "fit":
            return
        from .atomic import check_writable

        trainer = sub.get("trainer", {})
        places = []
        if trainer.get("default_root_dir"):
            places.append((trainer["default_root_dir"], "default root directory", "--trainer.default_root_dir"))
        logger = trainer.get("logger")
        for lg in logger if isinstance(logger, list) else [logger]:
            init_args = lg.get("init_args", {}) if hasattr(lg, "get") else {}
            save_dir = init_args.get("save_dir") if hasattr(init_args, "get") else None
            if save_dir and "://" not in str(save_dir):
                places.append((save_dir, "log directory", "--trainer.logger.save_dir"))
        checkpoint = sub.get("checkpoint", {})
        if (
            trainer.get("enable_checkpointing") is not False
            and hasattr(checkpoint, "get")
            and checkpoint.get("dirpath")
        ):
            places.append((checkpoint["dirpath"], "checkpoint directory", "--checkpoint.dirpath"))
        for where, what, option in places:
            check_writable(where, what, f"Set {option} to a writable location (nothing was trained yet).")

    def _setters(self, key: str) -> list[tuple[str, Any]]:
        """(where, value) of each setting of ``data.<key>``, in the order jsonargparse applies them: each
        ``--config`` file that has it, and ``--data.<key>`` on the command line (as ``command line``)."""
        found: list[tuple[str, Any]] = []
        args = self._args[1:]
        for i, arg in enumerate(args):
            option, equals, value = arg.partition("=")
            if not equals and i + 1 < len(args):
                value = args[i + 1]
            if option == f"--data.{key}":
                found.append(("command line", value))
            elif option == "--config" and value:
                try:
                    with open(value) as f:
                        config = yaml.safe_load(f)
                except (OSError, yaml.YAMLError):
                    continue  # not a file (a JSON string: the checkpoint's settings) or not readable
                data = config.get("data") if isinstance(config, dict) else None
                data = (data.get("init_args") or data) if isinstance(data, dict) else {}
                if key in data:
                    found.append((value, data[key]))
        return found

    def _check_digits_path(self, data: Any) -> None:
        """``data.prepare: digits`` builds the bundled 8x8 digits store where ``data.path`` points when
        nothing is there: only at the path the config that asks for it gives (or wherever the command
        line says ``--data.prepare digits``). A typo in ``--data.path`` on top of configs/demo.yaml built
        the digits at the typo and trained on them."""
        if not hasattr(data, "get") or data.get("prepare") != "digits" or not data.get("path"):
            return
        path = str(data["path"])
        if os.path.exists(path):
            return  # a store (the digits one is checked when prepared) or another directory (refused then)
        paths, prepares = self._setters("path"), self._setters("prepare")
        if not paths or not prepares or prepares[-1][0] == "command line":
            return
        asking = prepares[-1][0]  # the config that asks for the digits store, and the path it gives
        own = [value for where, value in paths if where == asking]
        if own and os.path.abspath(str(own[-1])) == os.path.abspath(path):
            return
        where = "--data.path" if paths[-1][0] == "command line" else f"data.path in {_shown(paths[-1][0])}"
        raise FileNotFoundError(
            f"{where} {path} does not exist, and {_shown(asking)} builds the bundled 8x8 digits store "
            f"(data.prepare: digits) only at its own data.path{f' ({own[-1]})' if own else ''}. If {path} is your "
            "store, check the path (a typo?); to build the digits store there, add --data.prepare digits."
        )

    # ---- the Trainer --------------------------------------------------------------------------
    def before_instantiate_classes(self) -> None:
        sub = self.config[self.subcommand]
        self._check_settings(sub)
        _strategy_class(sub.get("trainer"))
        self._keep_metrics_history(sub)
        logger = sub.get("trainer", {}).get("logger")
        loggers = logger if isinstance(logger, list) else [logger]
        for lg in loggers:
            # hp_metric = -1 in TensorBoard's hparams tab says nothing: off unless asked for
            if hasattr(lg, "get") and str(lg.get("class_path", "")).endswith("TensorBoardLogger"):
                if lg["init_args"].get("default_hp_metric") is None or lg["init_args"].get("default_hp_metric") is True:
                    lg["init_args"]["default_hp_metric"] = False
        # One config record per subcommand; a resumed or evaluated run keeps the fit's record.
        name = "config.yaml" if self.subcommand == "fit" else f"{self.subcommand}-config.yaml"
        if self.subcommand == "fit" and getattr(self, "_resumed_run", None) is not None:
            name = f"config-resumed-from-step-{getattr(self, '_resumed_step', 0)}.yaml"
        self.save_config_kwargs = {**self.save_config_kwargs, "config_filename": name, "overwrite": True}

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as e:
            error = _raised_by_the_class(e)
            if error is e:
                raise
            raise error from error.__cause__  # its own cause stays; the wrappers go

    # ---- nothing refused before work leaves a directory ------------------------------------------
    def _run_subcommand(self, subcommand: str) -> None:
        created = self._directories_to_create()
        try:
            super()._run_subcommand(subcommand)
        except Exception:
            self._remove_unused(created)
            raise

    def _directories_to_create(self) -> list[Path]:
        """The topmost directories that the run directory and the checkpoint directory would create
        (on rank 0; local paths only)."""
        if getattr(rank_zero_only, "rank", 0) != 0:
            return []
        trainer = self.trainer
        targets = []
        logger = trainer.loggers[0] if trainer.loggers else None
        if isinstance(logger, (TensorBoardLogger, CSVLogger)):
            targets.append(logger.log_dir)
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None) if self.subcommand == "fit" else None
        if dirpath:
            targets.append(dirpath)
        tops: list[Path] = []
        for target in targets:
            if "://" in str(target):
                continue
            path = Path(target).absolute()
            if path.exists():
                continue
            while not path.parent.exists():
                path = path.parent
            if path not in tops:
                tops.append(path)
        return tops

    def _remove_unused(self, created: list[Path]) -> None:
        """A command refused before its first batch (a store that does not fit, a checkpoint of another
        architecture...) removes the directories it created on its way there: the run directory of a
        run that never ran would take the next version number."""
        trainer = self.trainer
        loops: list[Any] = [trainer.fit_loop.epoch_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop]
        if trainer.global_step > 0 or any(loop.batch_progress.total.started for loop in loops):
            return
        for path in created:
            shutil.rmtree(path, ignore_errors=True)

    def after_fit(self) -> None:
        """Name the run and its last checkpoint: the path that reads this run, whatever another run
        does to the shared ``last.ckpt`` link."""
        trainer = self.trainer
        run = trainer.log_dir or trainer.default_root_dir  # a broadcast from rank 0: every rank asks
        if not trainer.is_global_zero:
            return
        last = getattr(trainer.checkpoint_callback, "last_model_path", "")
        saved = f"last checkpoint {_shown(last)}" if last and os.path.exists(last) else "no checkpoint saved"
        print(f"fit: run {_shown(run)} ended at step {trainer.global_step}; {saved}", flush=True)

    def _measure_what_the_metrics_fit(self, evaluation: Any) -> None:
        """The ``digits`` metrics score the bundled 8x8 digits only (their classifier and reference are
        those digits): on another store they are left out, with a notice naming the fix."""
        metrics = list(getattr(evaluation, "metrics", None) or [])
        if "digits" not in metrics or self.subcommand == "predict":
            return
        from .evaluation.digits import digits_data_mismatch

        why = digits_data_mismatch(self.datamodule.spec)
        if why is None:
            return
        evaluation.metrics = [m for m in metrics if m != "digits"]
        if getattr(rank_zero_only, "rank", 0) == 0:
            print(
                f"dit-lightning {self.subcommand}: note: the digits metrics score only the bundled 8x8 digits "
                f"(data.prepare: digits); {why}: not measured. For your own images use --evaluation.metrics "
                "[fid] with --evaluation.reference DIR (or store: the store's held-out split), or --evaluation.metrics "
                "[] for the held-out loss alone.",
                file=sys.stderr,
                flush=True,
            )

    def _announce_run(self, trainer_config: Any, checkpoint: Any, resumed: Optional[str]) -> None:
        """The first line of a fit: its run directory (where the logger writes, as ``trainer.log_dir``
        will say), its checkpoint directory when that lies elsewhere, and the step it resumes."""
        if getattr(rank_zero_only, "rank", 0) != 0:
            return
        root = trainer_config.get("default_root_dir") or os.getcwd()
        logger = trainer_config.get("logger")
        first = (logger[0] if logger else None) if isinstance(logger, list) else logger
        if first is None or first is True:  # Lightning's default logger: <default_root_dir>/lightning_logs/version_N
            first = CSVLogger(root)
        if first is False:
            run = str(root)
        elif isinstance(first, (TensorBoardLogger, CSVLogger)):
            run = first.log_dir  # picks the next version_N (nothing is created yet)
        else:
            run = str(getattr(first, "save_dir", None) or root)
        where = [f"fit: run {_shown(run)}"]
        dirpath = getattr(checkpoint, "dirpath", None)
        if dirpath and not Path(dirpath).resolve().is_relative_to(Path(run).resolve()):
            where.append(f"checkpoints in {_shown(dirpath)}")
        if resumed is not None:
            where.append(f"resuming step {getattr(self, '_resumed_step', 0)} of {_shown(resumed)}")
        print("; ".join(where), flush=True)

    def _explicit_settings(self) -> dict[str, Any]:
        """The levers auto-fit must keep: those the configs or the command line set (defaults excluded)."""
        try:
            given = self.parser.parse_args(self._args, defaults=False).get(str(self.subcommand))
        except Exception:
            given = None
        trainer = (given.get("trainer") if given is not None else None) or {}
        model = (given.get("model") if given is not None else None) or {}
        init = model.get("init_args", model) if hasattr(model, "get") else {}
        return {
            "precision": trainer.get("precision"),
            "accumulate_grad_batches": trainer.get("accumulate_grad_batches"),
            "activation_checkpointing": init.get("activation_checkpointing") if hasattr(init, "get") else None,
        }

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer_config = self._get(self.config_init, "trainer", default={})
        parser = self._parser(self.subcommand)
        user_callbacks = trainer_config.get("callbacks") or []
        user_callbacks = user_callbacks if isinstance(user_callbacks, list) else [user_callbacks]
        dropped = set()
        if trainer_config.get("enable_checkpointing") is False:
            dropped.add("checkpoint")
        if trainer_config.get("enable_progress_bar") is False or any(
            isinstance(c, ProgressBar) for c in user_callbacks
        ):
            dropped.add("progress_bar")  # the user's bar, or none: ours would clash
        grid = self._get(self.config_init, "sample_grid", default=None)
        if self.subcommand in _EVAL or not getattr(grid, "enabled", False):
            dropped.add("sample_grid")
        elif any(isinstance(c, SampleGrid) for c in user_callbacks):
            dropped.add("sample_grid")  # the user's grid replaces the section's
        parser.callback_keys = [k for k in parser.callback_keys if k not in dropped]
        if "evaluation" in parser.callback_keys:
            self._measure_what_the_metrics_fit(self._get(self.config_init, "evaluation"))
        if self.subcommand == "fit":
            checkpoint = self._get(self.config_init, "checkpoint") if "checkpoint" in parser.callback_keys else None
            resumed = self.config[self.subcommand].get("ckpt_path")
            for cb in [checkpoint, *user_callbacks]:
                if isinstance(cb, DiTModelCheckpoint):
                    cb.resumed_from = resumed
            self._announce_run(trainer_config, checkpoint, resumed)
        # ---- auto-fit (issue 19): decide before the Trainer exists; the callback applies and recovers
        auto_fit = AutoFitConfig.of(self._get(self.config_init, "auto_fit", default=None))
        if self.subcommand == "fit" and auto_fit is not None:
            from .callbacks.autofit import prepare_cli_fit

            callback, settings = prepare_cli_fit(
                auto_fit,
                self.model,
                self.datamodule,
                trainer_config,
                self._explicit_settings(),
                self.config[self.subcommand].get("ckpt_path"),
            )
            kwargs.update(settings)
            user_callbacks = [*user_callbacks, callback]
            kwargs["callbacks"] = user_callbacks
        # ----
        if self.subcommand == "predict" and not any(isinstance(c, BasePredictionWriter) for c in user_callbacks):
            user_callbacks = [*user_callbacks, PredictionWriter()]  # predictions are kept, in the run's directory
            kwargs["callbacks"] = user_callbacks
        if trainer_config.get("enable_model_summary", True) is not False and not any(
            isinstance(c, ModelSummary) for c in user_callbacks
        ):
            kwargs["callbacks"] = [*user_callbacks, DiTModelSummary()]
            kwargs["enable_model_summary"] = False  # Lightning's own default summary: ours replaces it
        # Atomic checkpoint writes unless the user configured their own CheckpointIO plugin.
        plugins = kwargs.get("plugins") or trainer_config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        return super().instantiate_trainer(**kwargs)


def run_lightning_cli(args: list[str]) -> None:
    """``dit-lightning fit|validate|test|predict ...``."""
    _quiet_third_party()
    try:
        DiTCLI(
            DiTModule,
            LatentDataModule,
            subclass_mode_model=True,  # DiTModule or a subclass (dit_lightning.distill.DistillationModule)
            save_config_callback=ConfigLogger,
            auto_configure_optimizers=False,  # optimiser and schedule are the model's arguments
            parser_kwargs={"exit_on_error": False, "allow_abbrev": False},  # --trainer.max_step is not max_steps
            args=args,
        )
    except (SignalExit, NonFiniteLossError) as stop:
        # Every rank agreed on this stop in one all-reduce and left from the same step: none waits in a
        # collective, so the group closes as after a success (or its exit status could become -6).
        if not getattr(stop, "at_once", False):
            close_process_group()
        raise
    # Not after other errors: a peer may be stuck in a collective, and destroying a group waits for
    # this rank's queued work (Lightning leaves the group alone on errors too).
    close_process_group()
