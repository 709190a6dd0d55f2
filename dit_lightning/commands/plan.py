"""``dit-lightning plan``: the planner as a command (a rich table in the terminal, JSON, or with
``--fit`` a hardware profile as YAML).

:func:`plan` takes the planner's one options object (:class:`~dit_lightning.planner.PlanOptions`);
the command line (:func:`parser`) has a flag per field of it (``--model``, ``--micro_batch``,
``--strategy``...) beside plan's own (``--gpu``, ``--fit``...), and ``--run PATH`` takes the model and
the levers of a fit run (its directory, its ``config.yaml`` or a checkpoint: :mod:`dit_lightning.planner.runs`)
for whatever the command line leaves unset.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from typing import Any, Literal, Optional, Union

from ..planner.hardware import gpu_names, gpu_spec, local_gpu
from ..planner.memory import PLAN_DEFAULTS, MemoryPlan, PlanOptions, plan_memory
from ..planner.profiles import fit_command, render_yaml
from ..planner.recommend import Recommendation, recommend, step_time
from ..planner.report import communication_line, render_memory, render_recommendation

# The settings --fit searches: a run's values for them are not pinned there (the command line's are).
_SEARCHED = ("micro_batch", "accumulate_grad_batches", "precision", "activation_checkpointing", "strategy", "sharding")
_OPTIONS = tuple(f.name for f in dataclasses.fields(PlanOptions))


def plan(
    options: Optional[PlanOptions] = None,
    gpu: Optional[str] = None,
    memory_gib: Optional[float] = None,
    fit: bool = False,
    global_batch: int = 256,
    steps: int = 400_000,
    mfu: Optional[float] = None,
    price_per_gpu_hour: Optional[float] = None,
    format: Literal["table", "json", "yaml"] = "table",
    fsdp2: bool = False,
) -> Union[MemoryPlan, Recommendation]:
    """Plan the GPU memory of DiT training, or (``--fit``) recommend the fastest setup that fits.

    Args:
        options: the run and its memory levers (default: DiT-XL/2 at 256px); in plan mode its unset
            settings are plan_memory's defaults, with --fit recommend searches them.
        gpu: GPU_NAMES; the name torch.cuda.get_device_name() prints ("NVIDIA H100 80GB HBM3"); or auto (this
            machine's first GPU).
        memory_gib: a memory budget in GiB per GPU (instead of, or overriding, the GPU's memory).
        fit: recommend micro-batch, accumulation, precision, checkpointing and strategy.
        global_batch: target global batch for --fit (micro x world x accumulation, exactly).
        steps: optimiser steps of the run, for the time and cost estimate.
        mfu: measured utilisation of executed FLOPs (default 0.35 for 16-bit, 0.12 for fp32/TF32).
        price_per_gpu_hour: price of one GPU-hour, for the cost estimate.
        format: table (rich), json, or yaml (with --fit: a hardware profile to pass as --config).
        fsdp2: --format yaml writes FSDP as FSDP2 (DiTFSDP2Strategy) rather than FSDP1.
    """
    options = options if options is not None else PlanOptions()
    if format == "yaml" and not fit:
        raise ValueError("--format yaml writes a hardware profile of a recommendation: add --fit")
    if gpu is not None and gpu.strip().lower() == "auto":
        name, spec, total_gib = local_gpu()
        if spec is not None:
            gpu = spec.name
        else:  # a GPU the table does not list: its memory, with a nominal compute model
            gpu = None
            memory_gib = total_gib if memory_gib is None else memory_gib
        print(
            f"--gpu auto: {name} ({spec.name if spec else f'{total_gib:.1f} GiB, not in the table'})", file=sys.stderr
        )
    elif gpu is not None:
        gpu = gpu_spec(gpu).name  # any spelling the table knows, or a clear error
    result: Union[MemoryPlan, Recommendation]
    if fit:
        rec = recommend(
            options,
            gpu=gpu,
            global_batch=global_batch,
            memory_gib=memory_gib,
            mfu=mfu,
            steps=steps,
            price_per_gpu_hour=price_per_gpu_hour,
        )
        rec.command = fit_command(rec)
        result = rec
    else:
        result = plan_memory(options, gpu=gpu, memory_gib=memory_gib)
    if format == "json":
        sys.stdout.write(result.to_json() + "\n")
    elif format == "yaml" and isinstance(result, Recommendation):
        if options.world_size % options.num_nodes:
            raise ValueError(f"--world_size {options.world_size} is not a multiple of --num_nodes {options.num_nodes}")
        sys.stdout.write(render_yaml(result, num_nodes=options.num_nodes, fsdp2=fsdp2, shard_group=options.shard_group))
    elif isinstance(result, Recommendation):
        render_recommendation(result)
    else:
        render_memory(result)
        if gpu is not None and options.world_size > 1:  # the step's communication on this GPU's links
            from rich.console import Console

            o = options.planned()
            assert o.micro_batch is not None and o.accumulate_grad_batches is not None
            timing = step_time(options, gpu_spec(gpu), o.micro_batch * o.world_size * o.accumulate_grad_batches)
            Console().print(communication_line(timing.communication, timing.step_s), soft_wrap=True)
    return result


# The help lists the GPU table as it is (one source: planner/hardware.py).
plan.__doc__ = (plan.__doc__ or "").replace("GPU_NAMES", gpu_names())

RUN_HELP = (
    "a fit run to plan: its directory (outputs/demo/version_N), its config.yaml or a checkpoint. The network, the "
    "devices, the strategy and the levers come from it, the flags given here win; with --fit, its micro-batch, "
    "accumulation, precision, recomputed blocks and strategy are searched unless given here."
)


def parser(**options: Any) -> Any:
    """The command line of ``plan``: a flag per :class:`PlanOptions` field and per setting of
    :func:`plan` (``options`` excepted), ``--run``, ``--fit_micro_batch`` (what ``--micro_batch``
    was called with ``--fit``) and ``--config`` (a YAML of these flags)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    options.pop("as_positional", None)  # (an option of jsonargparse's CLI, not of a parser)
    p = ArgumentParser(description=(plan.__doc__ or "").split("\n")[0], **options)
    p.add_argument("--config", action=ActionConfigFile, help="a YAML of these options (a fit run's config: --run)")
    p.add_argument("--run", type=Optional[str], default=None, help=RUN_HELP)
    p.add_class_arguments(PlanOptions, as_group=False)
    p.add_function_arguments(plan, skip={"options"}, as_group=False)
    p.add_argument("--fit_micro_batch", type=Optional[int], default=None, help="with --fit: --micro_batch (pinned)")
    return p


def _given(args: list[str], flag: str) -> Optional[str]:
    """The value of ``flag`` on the command line (``--run X`` or ``--run=X``; the last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _refuse_a_fit_config(args: list[str]) -> None:
    """``plan --config <run>/config.yaml`` read a fit config as plan's own options (a parser dump)."""
    from pathlib import Path

    import yaml

    config = _given(args, "--config")
    if config is None or not Path(config).is_file():
        return
    try:
        loaded = yaml.safe_load(Path(config).read_text())
    except (OSError, yaml.YAMLError):
        return  # jsonargparse says what is wrong with it
    if isinstance(loaded, dict) and {"trainer", "model", "data"} & {
        k for k, v in loaded.items() if isinstance(v, dict)
    }:
        raise ValueError(
            f"--config {config} is a fit config; --config takes plan's own options. To plan that run: "
            f"dit-lightning plan --run {config}"
        )


def command_line(args: list[str], **parser_options: Any) -> Union[MemoryPlan, Recommendation]:
    """``dit-lightning plan ARGS``: parse (a run's values under the command line's), then :func:`plan`."""
    _refuse_a_fit_config(args)
    p = parser(**parser_options)
    first = p.parse_args(args)  # the flags checked (and --print_config answered) before the run is read
    run: Optional[str] = first.run
    recorded_flags: dict[str, Any] = {}
    notes: list[str] = []
    if run is not None:
        from ..planner.runs import read_run

        recorded = read_run(run)
        recorded_flags = {k: v for k, v in recorded.options.items() if not (first.fit and k in _SEARCHED)}
        recorded_flags["fsdp2"] = recorded.fsdp2
        if recorded.global_batch is not None:
            recorded_flags["global_batch"] = recorded.global_batch
        p.set_defaults(recorded_flags)
        notes = [f"from {', '.join(recorded.sources)}", *recorded.notes]
    cfg = (p.parse_args(args) if run is not None else first).as_dict()
    cfg.pop("config", None)
    cfg.pop("run", None)
    fit_micro_batch = cfg.pop("fit_micro_batch")
    levers = {k: cfg.pop(k) for k in _OPTIONS}
    if fit_micro_batch is not None:
        if levers["micro_batch"] not in (None, fit_micro_batch) and _given(args, "--micro_batch") is not None:
            raise ValueError("--fit_micro_batch and --micro_batch differ: give one (they pin the same micro-batch)")
        levers["micro_batch"] = fit_micro_batch
    if run is not None and not cfg["fit"] and levers["micro_batch"] is None:
        # the run's micro-batch: its global batch over its devices and accumulation steps
        accumulate = levers["accumulate_grad_batches"] or PLAN_DEFAULTS["accumulate_grad_batches"]
        per_step = levers["world_size"] * accumulate
        if cfg["global_batch"] % per_step:
            raise ValueError(
                f"--run {run}: global batch {cfg['global_batch']} is not divisible by {levers['world_size']} device(s) "
                f"x {accumulate} accumulation steps: give --micro_batch"
            )
        levers["micro_batch"] = recorded_flags["micro_batch"] = cfg["global_batch"] // per_step
    if run is not None:  # what the run gave, as the flags that plan it (on stderr: stdout may be JSON)
        spelled = {
            k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in recorded_flags.items() if v is not None
        }
        shown = " ".join(f"--{k} {shlex.quote(v)}" for k, v in spelled.items())
        print(f"--run {run}: {shown} ({'; '.join(notes)})", file=sys.stderr)
    return plan(PlanOptions(**levers), **cfg)
