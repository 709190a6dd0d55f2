"""Sharded checkpoint directories (``torch.distributed.checkpoint``, as the FSDP strategies save
them), read into one process without a process group."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

from .safe_load import check_dcp_metadata, load_file

# What Lightning writes beside the shards of a sharded checkpoint (on rank 0): everything of the
# checkpoint but the weights and the optimiser states (step, loops, hyper-parameters, callback states).
META_FILE = "meta.pt"


def is_sharded_checkpoint(path: Union[str, Path]) -> bool:
    """A torch.distributed.checkpoint directory (as saved by FSDP/ModelParallel strategies)."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def optimizer_by_index(opt: dict[str, Any]) -> dict[str, Any]:
    """An FQN-keyed optimiser state dict (torch.distributed.checkpoint) re-keyed to parameter
    positions, as ``torch.optim.Optimizer.state_dict()`` (and the reference checkpoints) store it:
    position i = the i-th parameter of the param groups, in order."""
    index: dict[str, int] = {}
    groups = []
    for group in opt.get("param_groups", []):
        ids = []
        for name in group["params"]:
            index.setdefault(name, len(index))
            ids.append(index[name])
        groups.append({**group, "params": ids})
    state = {index[name]: value for name, value in opt.get("state", {}).items() if name in index}
    return {"state": state, "param_groups": groups}


def read_sharded_meta(path: Union[str, Path]) -> Optional[dict[str, Any]]:
    """The ``meta.pt`` of a sharded checkpoint directory (read weights-only), None when it has none
    (a directory of shards alone, e.g. written by ``torch.distributed.checkpoint.save`` directly)."""
    meta = Path(path) / META_FILE
    if not meta.is_file():
        return None
    data = load_file(meta)
    if not isinstance(data, dict):
        raise ValueError(f"'{meta}' holds a {type(data).__name__}, not the dict of a Lightning checkpoint's metadata")
    return data


def load_sharded_checkpoint(path: Union[str, Path], tmp_dir: Optional[Union[str, Path]] = None) -> dict[str, Any]:
    """Read a sharded (DCP) Lightning checkpoint directory into one process: returns
    ``{"state_dict": full tensors, "optimizer_states": [position-keyed], **metadata}``.

    The shards are merged through a temporary file in ``tmp_dir`` (default: next to the
    checkpoint) with ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise ValueError(f"'{path}' is not a sharded checkpoint directory (no .metadata file)")
    check_dcp_metadata(path)  # torch unpickles .metadata with plain pickle: vet it first
    fd, tmp = tempfile.mkstemp(prefix=".consolidate.", suffix=".tmp", dir=str(tmp_dir or path.parent))
    os.close(fd)
    try:
        dcp_to_torch_save(path, tmp)
        data = load_file(tmp, mmap=True)
    finally:
        os.unlink(tmp)
    # ModelParallelStrategy (FSDP2) stores the weights under "state_dict", FSDPStrategy (FSDP1) under "model"
    weights = data.pop("state_dict", None)
    out: dict[str, Any] = {"state_dict": weights if weights is not None else data.pop("model", {})}
    keys = sorted((k for k in data if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    out["optimizer_states"] = [optimizer_by_index(data.pop(k)) for k in keys]
    out.update({k: v for k, v in (read_sharded_meta(path) or {}).items() if k not in out})
    return out
