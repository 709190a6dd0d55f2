"""A fit run as the planner sees it: what ``dit-lightning plan --run PATH`` reads.

``PATH`` is a run's directory (``outputs/demo/version_N``), its ``config.yaml`` (or any fit config
with a ``trainer`` / ``model`` / ``data`` section, e.g. ``configs/hardware/8gpu.yaml``) or a
checkpoint (a run's ``.ckpt``, a sharded directory, or any DiT file ``sample`` reads). The network comes
from the best record there is: the checkpoint's weights when ``PATH`` is one (the one architecture
rule of :mod:`dit_lightning.checkpoints`); for a run, its ``hparams.yaml`` (written by the CSV and
TensorBoard loggers: the model's settings and the store's latent shape), else its newest checkpoint;
for a config alone, its model section and the store at ``data.path``. The levers come from the
config: devices x nodes, precision, accumulation, the strategy (DDP or FSDP1 / FSDP2, sharding,
hybrid group, communication, FSDP's ``param_dtype`` as the compute precision) and the global batch.
Nothing here imports Lightning or a strategy: class paths are read as names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import yaml

from ..communication import FSDP_REDUCE_DTYPES, communication_setting
from ..precision import TRAINING_PRECISIONS, lightning_precision, to_dtype
from .memory import PlanOptions

RUN_CONFIG = "config.yaml"
RUN_HPARAMS = "hparams.yaml"
# The network's settings a run records, by PlanOptions field
_SHAPE = (
    "model",
    "depth",
    "hidden_size",
    "num_heads",
    "patch_size",
    "mlp_ratio",
    "learn_sigma",
    "qk_norm",
    "norm",
    "mlp",
    "pos_embed",
    "wo_shift",
    "class_token_dim",
)


@dataclasses.dataclass
class RunLevers:
    """What a run says, in the planner's terms: ``options`` (:class:`~.memory.PlanOptions` fields),
    ``global_batch`` and ``fsdp2`` (the ``plan`` command's settings), what was read (``sources``) and
    what could not be (``notes``)."""

    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    global_batch: Optional[int] = None
    fsdp2: bool = False
    sources: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def _section(config: dict[str, Any], name: str) -> dict[str, Any]:
    """A config section's settings: its ``init_args`` when it names a class, else the section itself."""
    section = config.get(name)
    if not isinstance(section, dict):
        return {}
    init = section.get("init_args", section if "class_path" not in section else {})
    return dict(init) if isinstance(init, dict) else {}


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--run: cannot read {path} ({e})") from None


def _locate(path: Path) -> tuple[Optional[Path], Optional[Path], Path]:
    """(the fit config, the checkpoint, the run directory) that ``path`` names."""
    if not path.exists():
        raise FileNotFoundError(
            f"--run {path} does not exist: give a fit run's directory (e.g. outputs/demo/version_0), its "
            f"{RUN_CONFIG} or a checkpoint"
        )
    if path.is_dir() and (path / RUN_CONFIG).is_file():
        return path / RUN_CONFIG, None, path
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        return path, None, path.parent
    run = path.parent.parent if path.parent.name == "checkpoints" else path.parent  # <run>/checkpoints/x.ckpt
    return (run / RUN_CONFIG if (run / RUN_CONFIG).is_file() else None), path, run


def _run_checkpoint(run: Path) -> Optional[Path]:
    """The run's own checkpoint to read the network from: ``last.ckpt``, else the newest one."""
    directory = run / "checkpoints"
    if (directory / "last.ckpt").exists():
        return directory / "last.ckpt"
    found = sorted(directory.glob("*.ckpt"), key=lambda p: p.stat().st_mtime) if directory.is_dir() else []
    return found[-1] if found else None


def _network_of_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(PlanOptions fields of the network, the settings the file records, what had to be guessed) of
    any DiT checkpoint."""
    from ..checkpoints import dit_config_of, read_checkpoint

    ckpt = read_checkpoint(path, finite=False)  # nothing is computed from the weights: NaN is sample's concern
    cfg, guessed = dit_config_of(ckpt)
    if cfg.get("attn_dim") not in (None, cfg["hidden_size"]):
        raise ValueError(f"{path} holds a head-pruned DiT (attn_dim): the planner does not model it")
    network = {k: cfg[k] for k in _SHAPE[1:] if k in cfg}
    network.update(model="custom", latent_size=cfg["input_size"], in_channels=cfg["in_channels"])
    network["num_classes"] = cfg["num_classes"]
    settings = {**dict(ckpt.meta.get("datamodule") or {}), **ckpt.args}
    return network, settings, guessed


def _network_of_settings(settings: dict[str, Any], data_path: Optional[str]) -> tuple[dict[str, Any], list[str]]:
    """(PlanOptions fields of the network, notes) from recorded model settings (``hparams.yaml`` or the
    config's model section), the latent shape from them or from the store at ``data_path``."""
    if settings.get("attn_dim") not in (None, settings.get("hidden_size")):
        raise ValueError("the run's DiT is head-pruned (attn_dim): the planner does not model it")
    network = {k: settings[k] for k in _SHAPE if settings.get(k) is not None}
    shape, classes = settings.get("latent_shape"), settings.get("num_classes")
    if shape is None and data_path:
        from ..data import store as st

        if st.is_store(data_path):
            spec = st.load_plan(data_path)
            shape, classes = spec.latent_shape, classes or len(spec.class_names)
    notes = []
    if shape is not None:
        c, h, w = (int(x) for x in shape)
        if h != w:
            raise ValueError(f"the run's latents are {c}x{h}x{w}: the planner plans square latents")
        network.update(in_channels=c, latent_size=h)
    else:
        notes.append(
            "records no latent shape (no checkpoint, hparams.yaml or store found): give --latent_size, --in_channels"
        )
    if classes is not None:
        network["num_classes"] = int(classes)
    return network, notes


def _precision(value: Any) -> str:
    """A recorded Lightning precision as the planner's (32-true, 16-mixed or bf16-mixed)."""
    name = str(value)
    if name in TRAINING_PRECISIONS:
        return name
    planned = lightning_precision(to_dtype(name))
    if name.endswith("-true") and planned != "32-true":
        raise ValueError(f"the run trains in precision {name}: the planner plans 32-true, 16-mixed or bf16-mixed")
    return planned


def _levers_of_settings(settings: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """The memory levers the model's settings hold."""
    levers: dict[str, Any] = {}
    if settings.get("activation_checkpointing") is not None:
        levers["activation_checkpointing"] = settings["activation_checkpointing"]
    if settings.get("attention_backend") == "math":
        levers["attention"] = "math"
    if isinstance(settings.get("fused_optimizer"), bool):
        levers["fused_optimizer"] = settings["fused_optimizer"]
    if isinstance(settings.get("ema"), bool):
        levers["ema"] = settings["ema"]
    name = str(optimizer.get("class_path", "") if isinstance(optimizer, dict) else optimizer or "")
    if name:
        levers["optimizer"] = "sgd" if name.endswith("SGD") else ("adamw8bit" if "8bit" in name.lower() else "adamw")
    repa = settings.get("repa")
    if isinstance(repa, dict) and repa.get("encoder"):
        if repa.get("projector_dim") is not None:
            levers["repa_projector_dim"] = int(repa["projector_dim"])
        if repa.get("feature_dim") is not None:
            levers["repa_feature_dim"] = int(repa["feature_dim"])
        if float(repa.get("class_token_weight") or 0) > 0:  # REG: the encoder's class token, its feature width
            levers["class_token_dim"] = int(repa.get("feature_dim") or PlanOptions.repa_feature_dim)
    return levers


def _levers_of_strategy(strategy: Any, devices: Optional[int]) -> tuple[dict[str, Any], bool]:
    """(PlanOptions fields, whether FSDP2) of a recorded ``trainer.strategy``: a name or a class path."""
    if isinstance(strategy, str):
        return ({"strategy": "fsdp"} if "fsdp" in strategy.lower() else {"strategy": "ddp"}), False
    if not isinstance(strategy, dict):
        return {}, False
    name = str(strategy.get("class_path", "")).rsplit(".", 1)[-1]
    init = strategy.get("init_args") or {}
    by_dtype = {dtype: kind for kind, dtype in FSDP_REDUCE_DTYPES.items()}
    levers: dict[str, Any] = {}
    if name in ("DiTFSDP2Strategy", "ModelParallelStrategy"):
        levers["strategy"] = "fsdp"
        levers["sharding"] = "FULL_SHARD" if init.get("reshard_after_forward", True) else "SHARD_GRAD_OP"
        if init.get("hybrid_shard_size"):
            levers["shard_group"] = int(init["hybrid_shard_size"])
        reduce_dtype = init.get("reduce_dtype", "float32" if name == "DiTFSDP2Strategy" else None)
    elif "FSDP" in name:
        levers["strategy"] = "fsdp"
        sharding = str(init.get("sharding_strategy", "FULL_SHARD"))
        levers["sharding"] = "SHARD_GRAD_OP" if "GRAD_OP" in sharding or "ZERO2" in sharding else "FULL_SHARD"
        if "HYBRID" in sharding and devices:
            levers["shard_group"] = devices  # hybrid: shard within a node
        reduce_dtype = init.get("reduce_dtype") or init.get("param_dtype")
    else:
        levers["strategy"] = "ddp"
        kind, rank = communication_setting(str(init.get("communication", "none")), init.get("powersgd_rank"))
        levers["communication"] = f"{kind}:{rank}" if kind == "powersgd" else kind
        levers["ddp_gradient_as_bucket_view"] = bool(init.get("gradient_as_bucket_view", name == "DiTDDPStrategy"))
        return levers, False
    if reduce_dtype is not None and str(reduce_dtype) in by_dtype:
        levers["communication"] = by_dtype[str(reduce_dtype)]
    if init.get("param_dtype"):  # FSDP computes in param_dtype, whatever trainer.precision says
        levers["precision"] = lightning_precision(to_dtype(init["param_dtype"]))
    return levers, name in ("DiTFSDP2Strategy", "ModelParallelStrategy")


def _count(devices: Any) -> Optional[int]:
    """The number of devices ``trainer.devices`` names (None for "auto" / -1: known only on the machine)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    try:
        n = int(devices)
    except (TypeError, ValueError):
        return None
    return n if n > 0 else None


def read_run(path: str) -> RunLevers:
    """The planner's view of the run at ``path`` (see the module docstring)."""
    config_file, checkpoint, run = _locate(Path(path))
    out = RunLevers()
    config: dict[str, Any] = {}
    if config_file is not None:
        loaded = _read_yaml(config_file)
        if not isinstance(loaded, dict) or not {"trainer", "model", "data"} & set(loaded):
            raise ValueError(f"--run {config_file} is not a fit config (no trainer, model or data section)")
        config = loaded
        out.sources.append(str(config_file))
    model, data, trainer = _section(config, "model"), _section(config, "data"), _section(config, "trainer")
    if checkpoint is None and config_file is not None and config_file.parent == run:
        # the run's own records of its network: hparams.yaml (cheap), else its checkpoint
        hparams = _read_yaml(run / RUN_HPARAMS) if (run / RUN_HPARAMS).is_file() else None
        if isinstance(hparams, dict) and hparams.get("latent_shape") is not None:
            model, data = {**model, **hparams}, {**hparams, **data}
            out.sources.append(str(run / RUN_HPARAMS))
        else:
            checkpoint = _run_checkpoint(run)
    if checkpoint is not None:
        network, recorded, out.notes = _network_of_checkpoint(checkpoint)
        model = {**recorded, **model}
        data = {**recorded, **data}
        out.sources.append(str(checkpoint))
    else:
        network, out.notes = _network_of_settings(model, data.get("path"))
    out.options.update(network)
    out.options.update(_levers_of_settings(model, model.get("optimizer")))
    if "class_token_dim" in network:  # the weights' own width beats the settings' reading of it
        out.options["class_token_dim"] = network["class_token_dim"]
    devices = _count(trainer.get("devices", 1))
    nodes = int(trainer.get("num_nodes") or 1)
    if trainer.get("precision") is not None:
        out.options["precision"] = _precision(trainer["precision"])
    if trainer.get("accumulate_grad_batches") is not None:
        out.options["accumulate_grad_batches"] = int(trainer["accumulate_grad_batches"])
    strategy, out.fsdp2 = _levers_of_strategy(trainer.get("strategy"), devices)
    out.options.update(strategy)
    if devices is None:
        out.notes.append(f"trainer.devices {trainer.get('devices')!r} is known only on the machine: give --world_size")
    elif config:
        out.options.update(world_size=devices * nodes, num_nodes=nodes)
    if data.get("global_batch_size") is not None:
        out.global_batch = int(data["global_batch_size"])
    return out
