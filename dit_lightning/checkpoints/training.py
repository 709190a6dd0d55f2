"""Training checkpoints, the files and directories ``dit-lightning fit`` writes, read in one place:
the step, the settings (hyper-parameters, callback states such as auto-fit's recorded setting) and,
on first use, the weights.

A training checkpoint is a Lightning checkpoint: one file (``torch.save`` of a dict holding
``state_dict`` and ``pytorch-lightning_version``), or a sharded directory (FSDP: the shards and their
``.metadata`` written by ``torch.distributed.checkpoint``, and Lightning's ``meta.pt`` holding
everything but the weights and optimiser states). :func:`read_training_state` reads both the same
way, with ``torch.load(weights_only=True)``, tensors memory-mapped, and a sharded directory's
``.metadata`` vetted (:func:`~.safe_load.check_dcp_metadata`), so the directory is safe to hand to
Lightning afterwards. ``--ckpt_path``, auto-fit's resume and the fault-tolerance messages read
training checkpoints only through it; the DiT weights of any format are :func:`~.formats.read_checkpoint`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from .formats import StateDict

# The entries of a Lightning checkpoint that hold tensors of the model and optimisers: what a
# sharded directory keeps in its shards rather than in meta.pt.
_WEIGHT_ENTRIES = ("state_dict", "optimizer_states")
_VERSION = "pytorch-lightning_version"


class NotATrainingCheckpointError(ValueError):
    """A readable checkpoint that is not one a Lightning run wrote; ``kind`` says what it is instead
    (e.g. "a raw DiT checkpoint"), so that callers can say what to do with it."""

    def __init__(self, path: str, kind: str) -> None:
        self.path, self.kind = path, kind
        super().__init__(
            f"'{path}' is {kind}, not a Lightning training checkpoint (the checkpoints `dit-lightning fit` writes)"
        )


@dataclass
class TrainingState:
    """What a training checkpoint records, without its weights until they are asked for.

    ``meta`` is every entry of the checkpoint but the weights and optimiser states (Lightning's
    bookkeeping: loops, schedulers, ``callbacks``, ``hyper_parameters``...; for a sharded
    directory, its ``meta.pt``); ``step``, ``epoch``, ``hyper_parameters`` and ``callbacks`` are
    read from it (0 and empty when absent).
    """

    path: str
    sharded: bool
    step: int
    epoch: int
    hyper_parameters: dict[str, Any]
    callbacks: dict[str, Any]
    meta: dict[str, Any] = field(repr=False)
    _state_dict: Optional[StateDict] = field(default=None, repr=False)

    def callback_state(self, key: str) -> Optional[Any]:
        """The state the callback with this ``state_key`` saved (its class name unless it says
        otherwise, e.g. ``"AutoFit"``), None when the run had no such callback."""
        return self.callbacks.get(key)

    def state_dict(self, tmp_dir: Optional[Union[str, Path]] = None) -> StateDict:
        """The LightningModule's weights as saved (``model.*``, ``ema.*``...): memory-mapped from a
        file; merged from the shards of a directory on the first call (through a temporary file in
        ``tmp_dir``, default next to the checkpoint: :func:`~.sharded.load_sharded_checkpoint`)."""
        if self._state_dict is None:
            from .sharded import load_sharded_checkpoint

            self._state_dict = load_sharded_checkpoint(self.path, tmp_dir=tmp_dir)["state_dict"]
        return self._state_dict


def _kind_of(path: Path) -> str:
    """What a checkpoint that is not a training one is, for :class:`NotATrainingCheckpointError`;
    raises read_checkpoint's error when it is no DiT checkpoint at all."""
    from .formats import read_checkpoint

    fmt = read_checkpoint(path, finite=False).format  # only on this error path: the file is read again
    if fmt == "lightning":  # a state_dict without Lightning's bookkeeping (e.g. saved by hand)
        return f"a file of Lightning-style weights without a training state (no '{_VERSION}' entry)"
    return f"a {fmt} DiT checkpoint"


def read_training_state(path: Union[str, Path]) -> TrainingState:
    """Read a training checkpoint (a Lightning ``.ckpt`` file or a sharded checkpoint directory):
    its step, epoch, settings and callback states now, its weights on request.

    Raises ``FileNotFoundError`` for a missing path, :class:`NotATrainingCheckpointError` for a
    checkpoint of another kind (a raw, reference, safetensors or diffusers DiT; shards without
    ``meta.pt``), :class:`~.safe_load.UnsafeCheckpointError` for a pickle naming code, and a
    ``ValueError`` that says what is wrong for anything else (empty, truncated, not a checkpoint).
    """
    from .diffusers_format import is_diffusers_checkpoint, is_safetensors_file
    from .safe_load import check_dcp_metadata, load_file
    from .sharded import is_sharded_checkpoint, read_sharded_meta

    path = Path(path)
    name = str(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    sharded = is_sharded_checkpoint(path)
    weights: Optional[StateDict] = None
    if sharded:
        check_dcp_metadata(path)  # torch and Lightning unpickle it with plain pickle: vetted before either does
        sharded_meta = read_sharded_meta(path)
        if sharded_meta is None:
            raise NotATrainingCheckpointError(name, "a sharded checkpoint directory without meta.pt (weights only)")
        meta = sharded_meta
    elif path.is_dir():
        if is_diffusers_checkpoint(path):
            raise NotATrainingCheckpointError(name, "a diffusers DiT checkpoint")
        raise ValueError(
            f"'{path}' is a directory but not a checkpoint: a sharded checkpoint directory has a .metadata file"
        )
    elif is_safetensors_file(path):  # no training state in a safetensors file (torch.load cannot read it)
        raise NotATrainingCheckpointError(name, _kind_of(path))
    else:
        ckpt = load_file(path, mmap=True)
        if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
            raise NotATrainingCheckpointError(name, _kind_of(path))
        weights = ckpt["state_dict"]  # memory-mapped: nothing is read until a tensor is used
        meta = {k: v for k, v in ckpt.items() if k not in _WEIGHT_ENTRIES}
    if _VERSION not in meta:
        kind = f"a sharded checkpoint directory whose meta.pt has no '{_VERSION}'" if sharded else _kind_of(path)
        raise NotATrainingCheckpointError(name, kind)
    hp, callbacks = meta.get("hyper_parameters"), meta.get("callbacks")
    return TrainingState(
        path=name,
        sharded=sharded,
        step=int(meta.get("global_step") or 0),
        epoch=int(meta.get("epoch") or 0),
        hyper_parameters=dict(hp) if isinstance(hp, dict) else {},
        callbacks=dict(callbacks) if isinstance(callbacks, dict) else {},
        meta=meta,
        _state_dict=weights,
    )
