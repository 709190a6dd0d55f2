"""Gradient communication for DDP: PyTorch's compression hooks, PowerSGD's state in checkpoints, and a
counter of the bytes each collective hands over (for the planner's validation).

The names (``none``, ``bf16``, ``fp16``, ``powersgd``, ``powersgd:R``) and their checks are
:mod:`dit_lightning.communication`'s, which the planner reads too.

* :func:`comm_hook` -- the DDP comm hook (and its state) of a ``communication`` setting: PyTorch's own
  ``bf16_compress_hook`` / ``fp16_compress_hook`` (gradients cast to 16 bits, all-reduced, cast back) and
  ``powerSGD_hook`` (rank-r low-rank approximation of every matrix-shaped gradient, with error feedback).
* :class:`PowerSGDCheckpoint` -- PowerSGD's state (error feedback, warm-start P/Q, iteration, RNG) as plain
  tensors keyed by parameter name, so a checkpoint loads with ``torch.load(weights_only=True)`` and a
  resumed run continues bit for bit. PyTorch keys that state by DDP *bucket*, and DDP rebuilds its
  buckets after the first iteration of every process (in gradient-ready order), so a resumed process
  sees other buckets than the run that saved: the hook wrapper re-slices the state by parameter
  whenever the layout can change (the first two iterations of a process).
* :func:`count_collectives` -- wraps ``torch.distributed``'s collectives and counts their payloads.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..communication import Communication, communication_setting


def check_communication(communication: str, rank: Optional[int], warmup: Optional[int]) -> tuple[Communication, int]:
    """(kind, PowerSGD rank) of a DDP strategy's settings (the vocabulary of
    :mod:`dit_lightning.communication`); a setting the hooks cannot run is refused, naming the fix."""
    kind, rank = communication_setting(communication, rank)
    if warmup is not None and kind != "powersgd":
        raise ValueError(
            f"powersgd_warmup_steps applies only to communication powersgd (communication is '{communication}'): "
            "set communication powersgd or drop powersgd_warmup_steps"
        )
    if warmup is not None and warmup < 2:
        raise ValueError(
            f"powersgd_warmup_steps must be >= 2 (got {warmup}): DDP rebuilds its buckets after its first step, "
            "and PowerSGD's error feedback can only start once they are final"
        )
    return kind, rank


def check_backend(communication: str, backend: Optional[str]) -> None:
    """16-bit compression needs a backend that reduces 16-bit tensors (NCCL >= 2.10 for bf16, gloo)."""
    if communication == "bf16" and backend == "nccl":
        version = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        if version is not None and tuple(version) < (2, 10):
            raise ValueError(
                f"communication: bf16 needs NCCL >= 2.10 (this is {version}): use communication: fp16 or powersgd"
            )


@dataclass
class CollectiveBytes:
    """Payload bytes handed to each kind of collective (one rank's view) and the number of calls."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    min_bytes: int = 64  # smaller payloads (logged scalars, flags) are not gradient traffic: skipped

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        if n >= self.min_bytes:
            self.bytes[kind] += n
            self.calls[kind] += 1

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def wire_bytes(self, world_size: int) -> float:
        """Bytes one rank sends with ring algorithms: all-reduce 2(W-1)/W x payload, all-gather and
        reduce-scatter (W-1)/W x the full (gathered / unreduced) tensor."""
        f = (world_size - 1) / world_size
        return sum(b * (2 * f if k == "all_reduce" else f) for k, b in self.bytes.items())


# name in torch.distributed -> (kind, which argument is the full-size payload)
_COLLECTIVES: dict[str, tuple[str, str]] = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
}


@contextlib.contextmanager
def count_collectives(counter: Optional[CollectiveBytes] = None) -> Iterator[CollectiveBytes]:
    """Count what this rank hands to ``torch.distributed``'s all-reduce, all-gather and reduce-scatter
    while the block runs (payload: the all-reduced tensor, the gathered output, the unreduced input).

    The callers look the functions up on ``torch.distributed`` at call time (PyTorch's DDP comm hooks,
    FSDP2), so wrapping the module attributes sees them. DDP without a comm hook reduces inside its C++
    reducer, invisible here: count it with ``communication`` "none" by registering PyTorch's
    ``allreduce_hook`` (what the reducer does, in Python)."""
    counter = counter if counter is not None else CollectiveBytes()
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def wrap(name: str, fn: Callable) -> Callable:
        kind, arg = _COLLECTIVES[name]

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = kwargs.get(arg, args[0] if args else None)
            if isinstance(tensor, torch.Tensor):
                counter.add(kind, tensor)
            return fn(*args, **kwargs)

        return counted

    try:
        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
        yield counter
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


# ---- PowerSGD and checkpoints -------------------------------------------------------------------------


def _compressed(shape: torch.Size, rank: int, min_compression_rate: float) -> Optional[tuple[int, int, int]]:
    """(rows, cols, rank) of a gradient PowerSGD compresses, None for one it all-reduces as is
    (``powerSGD_hook``'s rule: the matrix view ``(shape[0], -1)`` when ``(rows + cols) x rank`` is
    at least ``min_compression_rate`` times smaller)."""
    n = shape[0] if len(shape) else 1
    m = 1
    for s in shape[1:]:
        m *= s
    r = min(n, m, rank)
    return (n, m, r) if (n + m) * r * min_compression_rate < n * m else None


def _pq_offsets(layout: list[tuple[str, torch.Size]], state: Any) -> list[tuple[str, int, int, int, int]]:
    """(name, P offset, P size, Q offset, Q size) of the compressed gradients of one bucket, in the order
    ``powerSGD_hook`` lays out its P and Q memory: grouped by matrix shape (first appearance), then in
    bucket order."""
    groups: dict[tuple[int, int], list[tuple[str, int]]] = {}
    for name, shape in layout:
        c = _compressed(shape, state.matrix_approximation_rank, state.min_compression_rate)
        if c is not None:
            groups.setdefault((c[0], c[1]), []).append((name, c[2]))
    out, p_off, q_off = [], 0, 0
    for (n, m), members in groups.items():
        for name, r in members:
            out.append((name, p_off, n * r, q_off, m * r))
            p_off, q_off = p_off + n * r, q_off + m * r
    return out


class PowerSGDCheckpoint:
    """PyTorch's ``powerSGD_hook`` with its state in checkpoints (see the module docstring).

    ``hook`` is the DDP comm hook (state: this object). :meth:`state_dict` is this rank's state keyed by
    parameter name; the P / Q memories are all-reduced, hence equal on every rank, the error feedback
    is each rank's own.
    """

    def __init__(self, module: nn.Module, rank: int, warmup_steps: int, **powersgd: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        self.state = PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=warmup_steps, **powersgd
        )
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.layouts: dict[int, list[tuple[str, torch.Size]]] = {}
        self.pending: Optional[dict[str, Any]] = None  # per-parameter state to slice into the next buckets
        self._calls = 0  # hooks called in this iteration
        self._iterations = 0  # iterations of this process

    # the hook --------------------------------------------------------------------------------------

    @staticmethod
    def hook(owner: PowerSGDCheckpoint, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

        index = bucket.index()
        layout = [(owner.names[id(p)], p.shape) for p in bucket.parameters()]
        if owner._calls == 0 and owner._iterations < 2 and owner.pending is None:
            # DDP's buckets may have changed since the last iteration (rebuilt after a process's first):
            # carry the state over by parameter. Afterwards the layout is fixed.
            owner.pending = owner._by_parameter() or None
            owner._clear()
        elif owner._iterations >= 2 and owner.layouts.get(index, layout) != layout:
            raise RuntimeError(
                f"DDP bucket {index} changed its parameters after the rebuild: PowerSGD keys its state by bucket"
            )
        owner.layouts[index] = layout
        if owner.pending is not None:
            owner._assemble(index, layout, bucket.buffer())
        owner._calls += 1
        if bucket.is_last():
            owner._calls, owner.pending = 0, None
            owner._iterations += 1
        return powerSGD_hook(owner.state, bucket)

    def _clear(self) -> None:
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()

    def _assemble(self, index: int, layout: list[tuple[str, torch.Size]], buffer: torch.Tensor) -> None:
        """The bucket's state from the per-parameter one (what it was under the saving run's buckets)."""
        assert self.pending is not None
        s, errors, p, q = self.state, self.pending["error"], self.pending["p"], self.pending["q"]
        if layout and all(name in errors for name, _ in layout):
            s.error_dict[index] = torch.cat([errors[name].reshape(-1) for name, _ in layout]).to(buffer)
        pq = _pq_offsets(layout, s)
        if pq and all(name in p and name in q for name, *_ in pq):
            s.p_memory_dict[index] = torch.cat([p[name] for name, *_ in pq]).to(buffer)
            s.q_memory_dict[index] = torch.cat([q[name] for name, *_ in pq]).to(buffer)

    def _by_parameter(self) -> dict[str, Any]:
        """The bucket-keyed state sliced by parameter ({} when there is none yet)."""
        if self.pending is not None:
            return self.pending
        s = self.state
        errors: dict[str, torch.Tensor] = {}
        p: dict[str, torch.Tensor] = {}
        q: dict[str, torch.Tensor] = {}
        for index, layout in self.layouts.items():
            if index in s.error_dict:
                offset = 0
                for name, shape in layout:
                    numel = shape.numel()
                    errors[name] = s.error_dict[index][offset : offset + numel].clone()
                    offset += numel
            if index in s.p_memory_dict:
                for name, po, pn, qo, qn in _pq_offsets(layout, s):
                    p[name] = s.p_memory_dict[index][po : po + pn].clone()
                    q[name] = s.q_memory_dict[index][qo : qo + qn].clone()
        return {"error": errors, "p": p, "q": q} if errors or p else {}

    # checkpoints -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: tensors, numbers and dicts only (``weights_only`` loads it)."""
        rng: Any = self.state.rng.get_state(legacy=True)  # ("MT19937", keys, pos, has_gauss, cached_gaussian)
        _, keys, pos, has_gauss, cached = rng
        by_param = self._by_parameter()
        return {
            "iter": int(self.state.iter),
            "rank": int(self.state.matrix_approximation_rank),
            "rng": {
                "keys": torch.from_numpy(keys.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "error": {k: v.cpu() for k, v in by_param.get("error", {}).items()},
            "p": {k: v.cpu() for k, v in by_param.get("p", {}).items()},
            "q": {k: v.cpu() for k, v in by_param.get("q", {}).items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (this rank's); applied to the buckets as the hook sees them."""
        import numpy as np

        s = self.state
        if int(state["rank"]) != s.matrix_approximation_rank:  # other P / Q shapes: keep only the error feedback
            state = {**state, "p": {}, "q": {}}
        s.iter = int(state["iter"])
        rng = state.get("rng")
        if rng is not None:
            keys = rng["keys"].numpy().astype(np.uint32)
            s.rng.set_state(("MT19937", keys, rng["pos"], rng["has_gauss"], rng["cached_gaussian"]))
        self._clear()
        self.pending = {k: dict(state.get(k) or {}) for k in ("error", "p", "q")}
        if not (self.pending["error"] or self.pending["p"]):
            self.pending = None
        self._calls = 0
        self._iterations = 0


def comm_hook(communication: str) -> tuple[Any, Optional[Callable]]:
    """(state, hook) of a 16-bit compression setting for ``DistributedDataParallel.register_comm_hook``
    (the state of PyTorch's default hooks is the process group; None: the default group)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if communication == "bf16":
        return None, default_hooks.bf16_compress_hook
    if communication == "fp16":
        return None, default_hooks.fp16_compress_hook
    return None, None


# DDP checks a hook's annotations at run time, against the objects: `from __future__ import annotations`
# made them strings.
PowerSGDCheckpoint.hook.__annotations__["bucket"] = dist.GradBucket
PowerSGDCheckpoint.hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
