"""Which objective a run trains, by one rule: built from the module's settings
(:class:`ObjectiveSettings`, ``model.objective`` and its options), read back from what a checkpoint
records (this project's hyper-parameters, SiT's or DiT's training arguments), or declared for a file
that records nothing (a released raw state dict).

Adding an objective: its class (a :class:`~.objective.TrainingObjective`) and its entry in
:data:`_BUILDERS` / ``ObjectiveName`` here.

Pure PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, Optional, get_args

from .flow import FlowMatching, PathType, Prediction, TimeDistribution
from .objective import DDPMObjective, TrainingObjective

ObjectiveName = Literal["ddpm", "flow"]
LossWeighting = Literal["none", "min_snr", "velocity", "likelihood"]
OBJECTIVE_NAMES: tuple[str, ...] = get_args(ObjectiveName)


@dataclass(frozen=True)
class ObjectiveSettings:
    """The settings of the training objective, as ``DiTModule`` takes them (``model.objective``,
    ``model.path_type``...; their help is the module's). Each objective reads its own and refuses
    the other's, which would do nothing."""

    objective: ObjectiveName = "ddpm"
    noise_schedule: str = "linear"
    diffusion_steps: int = 1000
    learn_sigma: bool = True
    path_type: PathType = "linear"
    prediction: Prediction = "velocity"
    time_distribution: TimeDistribution = "uniform"
    time_mean: float = 0.0
    time_std: float = 1.0
    cosine_loss: bool = False
    train_eps: Optional[float] = None
    sample_eps: Optional[float] = None
    loss_weighting: LossWeighting = "none"
    min_snr_gamma: float = 5.0

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def changed(self, names: tuple[str, ...]) -> list[str]:
        """``model.NAME VALUE`` of each of ``names`` that differs from its default."""
        default = ObjectiveSettings()
        return [f"model.{k} {getattr(self, k)}" for k in names if getattr(self, k) != getattr(default, k)]


_FLOW_ONLY = (
    "path_type",
    "prediction",
    "time_distribution",
    "time_mean",
    "time_std",
    "cosine_loss",
    "train_eps",
    "sample_eps",
)


def _ddpm(s: ObjectiveSettings) -> DDPMObjective:
    changed = s.changed(_FLOW_ONLY)
    if s.loss_weighting in ("velocity", "likelihood"):
        changed.append(f"model.loss_weighting {s.loss_weighting}")
    if changed:
        raise ValueError(
            f"{', '.join(changed)}: settings of flow matching, and model.objective is ddpm: set model.objective flow "
            "to use them (a flow run resumes with model.objective flow, as its config.yaml says)"
        )
    if s.loss_weighting != "min_snr" and s.min_snr_gamma != ObjectiveSettings.min_snr_gamma:
        raise ValueError(
            f"model.min_snr_gamma {s.min_snr_gamma} shapes model.loss_weighting min_snr, which is off: set "
            "model.loss_weighting min_snr to use it, or drop model.min_snr_gamma"
        )
    return DDPMObjective(
        noise_schedule=s.noise_schedule,
        diffusion_steps=int(s.diffusion_steps),
        learn_sigma=bool(s.learn_sigma),
        loss_weighting=s.loss_weighting,  # type: ignore[arg-type]  # none / min_snr checked there
        min_snr_gamma=float(s.min_snr_gamma),
    )


def _flow(s: ObjectiveSettings) -> FlowMatching:
    if s.loss_weighting == "min_snr" or s.min_snr_gamma != ObjectiveSettings.min_snr_gamma:
        raise ValueError(
            "model.loss_weighting min_snr / model.min_snr_gamma weight the DDPM objective's epsilon MSE; flow matching "
            "takes none, or velocity / likelihood with noise or score prediction"
        )
    if s.time_distribution == "uniform" and (s.time_mean, s.time_std) != (0.0, 1.0):
        raise ValueError("model.time_mean / model.time_std shape time_distribution logit_normal, not uniform")
    return FlowMatching(
        path_type=s.path_type,
        prediction=s.prediction,
        loss_weight=s.loss_weighting,
        train_eps=s.train_eps,
        sample_eps=s.sample_eps,
        time_distribution=s.time_distribution,
        time_mean=float(s.time_mean),
        time_std=float(s.time_std),
        cosine_loss=bool(s.cosine_loss),
    )


_BUILDERS: dict[str, Callable[[ObjectiveSettings], TrainingObjective]] = {"ddpm": _ddpm, "flow": _flow}
if set(_BUILDERS) != set(OBJECTIVE_NAMES):  # pragma: no cover - for whoever adds one
    raise RuntimeError("ObjectiveName and _BUILDERS disagree")


def build_objective(settings: ObjectiveSettings) -> TrainingObjective:
    """The objective ``settings`` describe; settings of another objective are refused."""
    builder = _BUILDERS.get(settings.objective)
    if builder is None:
        raise ValueError(f"model.objective must be one of {', '.join(OBJECTIVE_NAMES)}, got {settings.objective!r}")
    return builder(settings)


def recorded_objective_name(args: Mapping[str, Any]) -> Optional[str]:
    """The objective a checkpoint's settings name, else None: this project's ``objective`` (a run
    without it trained DDPM), SiT's training arguments (``path_type`` and ``prediction``: flow), the
    DiT reference script's (``model: DiT-...``: DDPM)."""
    objective = args.get("objective")
    if objective in OBJECTIVE_NAMES:
        return str(objective)
    if isinstance(args.get("path_type"), str) and isinstance(args.get("prediction"), str):
        return "flow"
    if "noise_schedule" in args or "diffusion_steps" in args:  # a DiTModule run before flow matching
        return "ddpm"
    model = args.get("model")
    if isinstance(model, str) and model.startswith("DiT-"):
        return "ddpm"
    return None


def objective_from_record(args: Mapping[str, Any]) -> Optional[TrainingObjective]:
    """The objective a checkpoint records (None: the file does not say): this project's
    hyper-parameters or export record, SiT's training arguments (``path_type`` Linear / GVP / VP,
    ``prediction``, ``loss_weight``, the epsilons), the DiT reference script's."""
    name = recorded_objective_name(args)
    if name is None:
        return None
    given = {k: args[k] for k in ObjectiveSettings.names() if k in args and args[k] is not None}
    given["objective"] = name
    if name == "flow":
        path = str(args.get("path_type") or "linear").lower()
        if path not in get_args(PathType):
            raise ValueError(f"the checkpoint records flow path_type {args.get('path_type')!r}: not linear, gvp or vp")
        given.update(path_type=path, prediction=str(args.get("prediction") or "velocity").lower())
        weight = args.get("loss_weighting", args.get("loss_weight")) or "none"  # SiT: loss_weight, None for none
        given["loss_weighting"] = str(weight).lower()
        if given["prediction"] == "velocity" and path in ("linear", "gvp"):  # SiT ignores the epsilons then
            given.pop("train_eps", None), given.pop("sample_eps", None)
        for key in ("learn_sigma", "noise_schedule", "diffusion_steps", "min_snr_gamma"):
            given.pop(key, None)  # DDPM's, recorded by every DiTModule run
    else:
        for key in _FLOW_ONLY:
            given.pop(key, None)
        if given.get("loss_weighting") not in (None, "none", "min_snr"):
            given.pop("loss_weighting")
        if given.get("loss_weighting", "none") != "min_snr":
            given.pop("min_snr_gamma", None)
    return build_objective(ObjectiveSettings(**given))


def declared_objective(
    recorded: Optional[TrainingObjective],
    declared: Optional[str],
    path_type: Optional[str] = None,
    prediction: Optional[str] = None,
    source: str = "the checkpoint",
) -> TrainingObjective:
    """The objective to sample a file with: the one it records; else the declared one (a raw file
    records nothing: ``flow`` for SiT's released weights, with ``path_type`` / ``prediction``, unset:
    SiT's linear / velocity); else DDPM. A declaration that contradicts the record is refused."""
    given = {k: v for k, v in (("path_type", path_type), ("prediction", prediction)) if v is not None}
    if recorded is not None:
        if declared is not None and declared != recorded.name:
            raise ValueError(
                f"--objective {declared}: {source} records {recorded.describe()}; drop --objective (it is for files "
                "that record nothing, like a released raw state dict)"
            )
        theirs = recorded.shared_settings()
        wrong = [f"--{k} {v}" for k, v in given.items() if theirs.get(k) != v]
        if wrong:
            raise ValueError(
                f"{' '.join(wrong)}: {source} records {recorded.describe()}; drop them (they declare what trained a "
                "file that records nothing)"
            )
        return recorded
    if declared == "flow":
        return FlowMatching(**given)  # type: ignore[arg-type]  # checked there
    if given:
        raise ValueError(f"--path_type / --prediction declare a flow model: add --objective flow ({source})")
    return DDPMObjective()
