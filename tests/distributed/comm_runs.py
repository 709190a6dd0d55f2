"""Two-process (gloo) runs for tests/distributed/test_communication.py and benchmarks/bench_communication.py.

``python tests/distributed/comm_runs.py --data D --out O [--runs a,b]``: the first ``Trainer(devices=2)``
starts the second rank (Lightning's launcher re-runs this script), later runs reuse both processes.
Each run writes ``O/<run>.pt`` from rank 0: the weights, and per optimiser step the payload bytes this
rank handed to each kind of collective (``count_collectives``) -- DDP's bucket all-reduces through the
comm hook, FSDP2's all-gathers and reduce-scatters.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from dit_lightning.data import LatentDataModule  # noqa: E402
from dit_lightning.distributed import DiTDDPStrategy, DiTFSDP2Strategy, full_state_dict  # noqa: E402
from dit_lightning.distributed.communication import CollectiveBytes, count_collectives  # noqa: E402
from dit_lightning.module import DiTModule  # noqa: E402
from dit_lightning.plugins import AtomicCheckpointIO  # noqa: E402
from tests.helpers.scripted_runs import run_main  # noqa: E402

GLOBAL_BATCH = 16
STEPS = 6
WARMUP = 2  # PowerSGD's plain all-reduce steps (the fewest PyTorch allows)
CKPT_STEP = 4  # PowerSGD is running by then: error feedback, P and Q exist
# The network the byte counts are planned for (tests/distributed/test_communication.py): small, with
# matrices large enough that PowerSGD compresses them.
NET: dict[str, Any] = dict(model="custom", depth=2, hidden_size=64, num_heads=4, patch_size=2)


def build(data: str) -> tuple[DiTModule, LatentDataModule]:
    L.seed_everything(0, verbose=False)
    dm = LatentDataModule(data, global_batch_size=GLOBAL_BATCH, val_size=32, num_workers=0, random_flip=False)
    module = DiTModule(
        **NET,
        latent_shape=dm.latent_shape,
        num_classes=dm.num_classes,
        ema_decay=0.9,
        vae=dm.spec.vae,
        tf32=False,
        sample_steps=2,
    )
    return module, dm


class CountBytes(Callback):
    """The payload bytes this rank hands to collectives in each training batch (one optimiser step
    with accumulation 1)."""

    def __init__(self, register_allreduce_hook: bool = False) -> None:
        self.steps: list[dict[str, int]] = []
        self.calls: list[dict[str, int]] = []
        self._register = register_allreduce_hook
        self._ctx: Any = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._register:
            # DDP without a hook reduces in its C++ reducer, out of sight: PyTorch's allreduce_hook is
            # what it does (divide by the world size, all-reduce the bucket), in Python.
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            trainer.strategy.model.register_comm_hook(None, allreduce_hook)  # type: ignore[union-attr, operator]

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._counter = CollectiveBytes()
        self._ctx = count_collectives(self._counter)
        self._ctx.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._ctx.__exit__(None, None, None)
        self.steps.append(dict(self._counter.bytes))
        self.calls.append(dict(self._counter.calls))


def trainer(out: Path, strategy: Any, callbacks: list, max_steps: int = STEPS, accumulate: int = 1) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
        precision="32-true",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate,
    )


def _run(
    args: argparse.Namespace,
    name: str,
    strategy: Any,
    steps: int = 2,
    ckpt_path: Optional[str] = None,
    save_at: Optional[int] = None,
    accumulate: int = 1,
    register_allreduce_hook: bool = False,
) -> None:
    module, dm = build(args.data)
    count = CountBytes(register_allreduce_hook)
    callbacks: list = [count]
    if save_at:
        callbacks.append(
            ModelCheckpoint(dirpath=str(args.out / name), every_n_train_steps=save_at, save_top_k=-1, save_last=False)
        )
    t = trainer(args.out, strategy, callbacks, max_steps=steps, accumulate=accumulate)
    t.fit(module, dm, ckpt_path=ckpt_path)
    state: dict[str, Any] = {"model": full_state_dict(module.model), "ema": full_state_dict(module.ema)}  # type: ignore[arg-type]
    if t.global_rank == 0:
        state.update(steps=count.steps, calls=count.calls, world_size=t.world_size, global_step=t.global_step)
        torch.save(state, args.out / f"{name}.pt")


def ddp(communication: str = "none", **options: Any) -> DiTDDPStrategy:
    return DiTDDPStrategy(process_group_backend="gloo", communication=communication, **options)


RUNS = {
    "ddp_none": lambda a: _run(a, "ddp_none", ddp(), register_allreduce_hook=True),
    "ddp_none_accum": lambda a: _run(a, "ddp_none_accum", ddp(), accumulate=2, register_allreduce_hook=True),
    "ddp_bf16": lambda a: _run(a, "ddp_bf16", ddp("bf16")),
    "ddp_fp16": lambda a: _run(a, "ddp_fp16", ddp("fp16")),
    # the uninterrupted run saves at CKPT_STEP; the resumed one starts there in a new DDP (new buckets)
    "powersgd": lambda a: _run(
        a, "powersgd", ddp("powersgd", powersgd_warmup_steps=WARMUP, powersgd_rank=2), STEPS, save_at=CKPT_STEP
    ),
    "powersgd_resume": lambda a: _run(
        a,
        "powersgd_resume",
        ddp("powersgd", powersgd_warmup_steps=WARMUP, powersgd_rank=2),
        STEPS,
        ckpt_path=str(a.out / "powersgd" / f"epoch=0-step={CKPT_STEP}.ckpt"),
    ),
    "fsdp2": lambda a: _run(a, "fsdp2", DiTFSDP2Strategy(process_group_backend="gloo")),
    "fsdp2_accum": lambda a: _run(a, "fsdp2_accum", DiTFSDP2Strategy(process_group_backend="gloo"), accumulate=2),
    "fsdp2_no_reshard": lambda a: _run(
        a, "fsdp2_no_reshard", DiTFSDP2Strategy(process_group_backend="gloo", reshard_after_forward=False)
    ),
    "fsdp2_bf16_reduce": lambda a: _run(
        a, "fsdp2_bf16_reduce", DiTFSDP2Strategy(process_group_backend="gloo", reduce_dtype="bfloat16")
    ),
}


def main(argv: Optional[list[str]] = None) -> None:
    run_main(__doc__, RUNS, ",".join(RUNS), argv)


if __name__ == "__main__":
    main()
