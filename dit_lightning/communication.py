"""Gradient communication in one place: the names a run and the planner speak, and what each means.

DDP all-reduces the gradients once per optimiser step, through PyTorch's comm hooks
(:mod:`dit_lightning.distributed.communication`): ``none`` (fp32, DDP's own reducer), ``bf16`` /
``fp16`` (cast to 16 bits, all-reduced, cast back), ``powersgd`` (a rank-R approximation of every
matrix-shaped gradient with error feedback; ``powersgd:R`` names the rank). FSDP has no comm hook: it
reduce-scatters in its ``reduce_dtype`` (``none``: float32, ``bf16``: bfloat16, ``fp16``: float16)
and has no PowerSGD. The strategies (``DiTDDPStrategy(communication=...)``) and the planner
(``PlanOptions.communication``, ``dit-lightning plan --communication``) read the same spellings
through :func:`parse_communication`, and refuse the same ones with the same words.
"""

from __future__ import annotations

from typing import Literal, Optional, get_args

Communication = Literal["none", "bf16", "fp16", "powersgd"]
COMMUNICATIONS: tuple[Communication, ...] = get_args(Communication)
SPELLINGS = "none, bf16, fp16, powersgd or powersgd:R (R >= 1)"
# Rank 4: PowerSGD's paper (Vogels et al., 2019) needed rank 4 for its LSTM language model (rank 2 sufficed
# for ResNets). For DiT-XL/2 rank 4 still sends ~190x less than fp32 (14 MB per step, rank 1: 5 MB, the
# uncompressed biases and adaLN vectors being a fixed part): hidden on any link, so the closer
# approximation costs no measurable time.
POWERSGD_RANK = 4
POWERSGD_WARMUP_STEPS = 1000  # PyTorch's default start_powerSGD_iter: plain all-reduce while the loss falls fast
# FSDP's reduce dtype for each communication it can do (torch's dtype names, as the FSDP strategies take them)
FSDP_REDUCE_DTYPES: dict[str, str] = {"none": "float32", "bf16": "bfloat16", "fp16": "float16"}
FSDP_NO_POWERSGD = (
    "FSDP has no comm hook: it reduce-scatters its gradients in its reduce_dtype (float32, bfloat16 or float16: "
    "communication none, bf16 or fp16); PowerSGD is DDP's (dit_lightning.distributed.DiTDDPStrategy)"
)


def parse_communication(value: str) -> tuple[Communication, Optional[int]]:
    """(kind, the PowerSGD rank the spelling names or None) of ``none``, ``bf16``, ``fp16``, ``powersgd``
    or ``powersgd:R`` (case and surrounding spaces aside); a ValueError naming the spellings otherwise.

    >>> parse_communication("bf16"), parse_communication("PowerSGD:2")
    (('bf16', None), ('powersgd', 2))
    """
    kind, colon, rank = str(value).strip().lower().partition(":")
    if kind not in COMMUNICATIONS or (colon and (kind != "powersgd" or not rank.isdigit() or int(rank) < 1)):
        raise ValueError(f"communication '{value}' is not understood: choose {SPELLINGS}")
    return kind, int(rank) if colon else None


def communication_setting(communication: str, powersgd_rank: Optional[int] = None) -> tuple[Communication, int]:
    """(kind, PowerSGD rank) of a DDP run's ``communication`` and its separate ``powersgd_rank``
    (unset: the rank ``powersgd:R`` names, else :data:`POWERSGD_RANK`); a ValueError for a rank
    without PowerSGD, a rank below 1 or two different ranks."""
    kind, named = parse_communication(communication)
    if powersgd_rank is not None:
        if kind != "powersgd":
            raise ValueError(
                f"powersgd_rank applies only to communication powersgd (communication is '{communication}'): "
                "set communication powersgd or drop powersgd_rank"
            )
        if powersgd_rank < 1:
            raise ValueError(f"powersgd_rank must be >= 1 (got {powersgd_rank}); 1-4 is usual")
        if named is not None and named != powersgd_rank:
            raise ValueError(
                f"communication '{communication}' names rank {named} and powersgd_rank is {powersgd_rank}: "
                "give the rank once"
            )
    return kind, named or powersgd_rank or POWERSGD_RANK


def fsdp_reduce_dtype(communication: str) -> str:
    """The ``reduce_dtype`` that does ``communication`` under FSDP (``bf16``: ``bfloat16``...); a
    ValueError for PowerSGD, which FSDP cannot do."""
    kind, _ = parse_communication(communication)
    if kind == "powersgd":
        raise ValueError(f"communication '{communication}': {FSDP_NO_POWERSGD}")
    return FSDP_REDUCE_DTYPES[kind]
