"""Distributed training runs of a tiny DiT on the digits store, for tests/distributed/test_distributed.py.

Launched as a plain script, ``python tests/distributed/parity.py --data D --out O``: the first
``Trainer(devices=2)`` starts the second rank itself (Lightning's subprocess launcher re-runs
this script with LOCAL_RANK=1), and the following runs reuse the same two processes and
process group. Under ``torchrun`` (e.g. ``--nnodes 2 --nproc_per_node 1`` for a multi-node
layout) the processes come from torchrun instead.

Each run trains ``--steps`` optimiser steps with a global batch of 16, then rank 0 writes
``O/<run>.pt``: the full (gathered) weights of the model and the EMA, the logged losses and
gradient norms, and facts about the layout (whether parameters and EMA were sharded...).
``reference()`` is the same run in one process (imported by the test, not run here).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from dit_lightning.callbacks import GenerationMetrics  # noqa: E402
from dit_lightning.data import LatentDataModule  # noqa: E402
from dit_lightning.distributed import DiTDDPStrategy, DiTFSDP2Strategy, full_state_dict, is_fsdp2  # noqa: E402
from dit_lightning.module import DiTModule  # noqa: E402
from dit_lightning.plugins import AtomicCheckpointIO  # noqa: E402
from tests.helpers.scripted_runs import run_main  # noqa: E402

GLOBAL_BATCH = 16
STEPS = 4
CKPT_STEP = 2  # the sharded run saves here; the resumed run starts from it
CLIP = 0.05  # small enough that every step clips
GENERATED = 21  # samples `test` measures: odd, so the ranks' shares differ and padding is exercised


def test_generation(trainer_: L.Trainer, module: DiTModule, dm: LatentDataModule) -> dict[str, Any]:
    """`test` with the digits metrics of GENERATED keyed samples, sampled over all ranks."""
    metrics = GenerationMetrics(metrics=["digits"], num_samples=GENERATED, labels="0-9", batch_size=4)
    trainer_.callbacks.append(metrics)  # type: ignore[attr-defined]  # set by the callback connector
    logged_ = trainer_.test(module, dm, verbose=False)[0]
    return {"logged": logged_, "details": metrics.last}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, foreach=True)


def sgd(params):
    # Clipping runs use SGD: AdamW is nearly invariant to a uniform gradient scale, so it
    # would hide whether the clipping happened.
    return torch.optim.SGD(params, lr=0.5)


def repa_encoder_file(data: str) -> str:
    """A random digits encoder's weights (with a class token, for REG), the same in every process
    (written atomically by each)."""
    from tests.helpers.reg_encoder import ClassTokenDigitsEncoder

    path = Path(data).parent / "repa_encoder.pt"
    if not path.exists():
        with torch.random.fork_rng():
            torch.manual_seed(123)
            net = ClassTokenDigitsEncoder()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(net.state_dict(), tmp)
        os.replace(tmp, path)
    return str(path)


def build(
    data: str, seed: int = 0, optimizer: str = "adamw", recipe: str = "ddpm"
) -> tuple[DiTModule, LatentDataModule]:
    """The tiny DiT on the digits; ``recipe="flow-repa"``: flow matching with REPA (block 1, a random
    digits encoder), whose projector must train alike under every strategy, with REG's class token
    (its layers and keyed noise) and the alignment cut off at step 3 (the projector stays in DDP's
    graph with zero gradients)."""
    L.seed_everything(seed, verbose=False)
    dm = LatentDataModule(data, global_batch_size=GLOBAL_BATCH, val_size=32, num_workers=0, random_flip=False)
    objective: dict[str, Any] = {}
    if recipe == "flow-repa":
        from dit_lightning.models.repa import REPAOptions

        repa = REPAOptions(encoder="tests.helpers.reg_encoder.ClassTokenDigitsEncoder", weights=repa_encoder_file(data))
        reg = dataclasses.replace(repa, depth=1, projector_dim=32, class_token_weight=0.03, until_step=3)
        objective = dict(objective="flow", repa=reg)
    module = DiTModule(
        model="custom",
        latent_shape=dm.latent_shape,
        num_classes=dm.num_classes,
        depth=2,
        hidden_size=32,
        num_heads=4,
        patch_size=2,
        ema_decay=0.9,  # moves visibly in a few steps, so EMA equality means something
        optimizer=sgd if optimizer == "sgd" else adamw,
        tf32=False,  # exact fp32 matmuls on GPUs too
        vae=dm.spec.vae,
        sample_steps=2,
        **objective,
    )
    return module, dm


def trainer(
    out: Path,
    name: str,
    strategy: Any = "auto",
    devices: int = 1,
    num_nodes: int = 1,
    callbacks=(),
    accelerator: str = "cpu",
    **kw,
) -> L.Trainer:
    return L.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=kw.pop("max_steps", STEPS),
        precision="32-true",
        logger=CSVLogger(save_dir=str(out), name=name, version=""),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        plugins=[AtomicCheckpointIO()],
        val_check_interval=STEPS,  # one validation (of the EMA) at the end
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        **kw,
    )


def logged(out: Path, name: str) -> dict[str, dict[int, float]]:
    path = out / name / "metrics.csv"
    result: dict[str, dict[int, float]] = {
        "train/loss": {},
        "train/grad_norm": {},
        "val/loss": {},
        "train/class_token": {},
    }
    if not path.exists():
        return result
    with open(path) as f:
        for row in csv.DictReader(f):
            for key in result:
                if row.get(key):
                    result[key][int(row["step"])] = float(row[key])
    return result


def dump(trainer_: L.Trainer, module: DiTModule, out: Path, name: str, **facts: Any) -> None:
    """Gather the weights (a collective under FSDP: every rank calls it), write them on rank 0."""
    assert module.ema is not None
    state: dict[str, Any] = {"model": full_state_dict(module.model), "ema": full_state_dict(module.ema)}
    # sampling from the (sharded) EMA is a collective too: with and without guidance
    state["samples"] = torch.cat([module.sample([1, 2], num_steps=2, cfg_scale=c, seed=0) for c in (1.0, 2.0)]).cpu()
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in module.model.parameters())
    facts.setdefault(
        "ema_local_numel", sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in module.ema.parameters())
    )
    full = sum(v.numel() for v in state["model"].values())
    if trainer_.global_rank == 0:
        state.update(
            facts,
            world_size=trainer_.world_size,
            global_step=trainer_.global_step,
            model_sharded=is_fsdp2(module.model),
            ema_sharded=is_fsdp2(module.ema),
            local_numel=local,
            full_numel=full,
            logged=logged(out, name),
        )
        torch.save(state, out / f"{name}.pt")


def run_ddp(
    args: argparse.Namespace, name: str = "ddp", accumulate: int = 1, static_graph: bool = False, recipe: str = "ddpm"
) -> None:
    module, dm = build(args.data, recipe=recipe)
    strategy = DiTDDPStrategy(static_graph=static_graph, process_group_backend="gloo")
    t = trainer(args.out, name, strategy, args.devices, args.num_nodes, accumulate_grad_batches=accumulate)
    t.fit(module, dm)
    generation = test_generation(t, module, dm) if name == "ddp" else None
    dump(
        t,
        module,
        args.out,
        name,
        static_graph=t.strategy._ddp_kwargs["static_graph"],  # type: ignore[attr-defined]
        micro_batch=dm.micro_batch_size,
        generation=generation,
    )


def run_ddp_accum(args: argparse.Namespace) -> None:
    # static_graph=True with accumulation would crash in DDP: the strategy must switch it off.
    run_ddp(args, "ddp_accum", accumulate=2, static_graph=True)


def _fsdp2(
    args: argparse.Namespace,
    name: str,
    ckpt_path: Optional[str] = None,
    clip: Optional[float] = None,
    save_every: Optional[int] = None,
    recipe: str = "ddpm",
    **options: Any,
) -> None:
    module, dm = build(args.data, optimizer="sgd" if clip else "adamw", recipe=recipe)
    strategy = DiTFSDP2Strategy(process_group_backend="gloo", **options)
    callbacks = []
    if save_every:
        callbacks.append(
            ModelCheckpoint(dirpath=str(args.out / name / "ckpt"), every_n_train_steps=save_every, save_top_k=-1)
        )
    kw = {"gradient_clip_val": clip, "gradient_clip_algorithm": "norm"} if clip else {}
    t = trainer(args.out, name, strategy, args.devices, args.num_nodes, callbacks=callbacks, **kw)  # type: ignore[arg-type]
    t.fit(module, dm, ckpt_path=ckpt_path)
    generation = test_generation(t, module, dm) if name == "fsdp2" else None  # sampling is a collective here
    p = next(module.model.parameters())
    dump(
        t,
        module,
        args.out,
        name,
        param_dtype=str(p.dtype),
        placements=str(getattr(p, "placements", None)),
        mesh=str(getattr(p, "device_mesh", None)),
        generation=generation,
    )


def run_fsdp2(args: argparse.Namespace) -> None:
    _fsdp2(args, "fsdp2", save_every=CKPT_STEP)


def run_fsdp2_resume(args: argparse.Namespace) -> None:
    ckpt = args.out / "fsdp2" / "ckpt" / f"epoch=0-step={CKPT_STEP}.ckpt"
    _fsdp2(args, "fsdp2_resume", ckpt_path=str(ckpt))


def run_fsdp2_clip(args: argparse.Namespace) -> None:
    _fsdp2(args, "fsdp2_clip", clip=CLIP)


def run_fsdp2_bf16(args: argparse.Namespace) -> None:
    _fsdp2(args, "fsdp2_bf16", param_dtype="bfloat16", reduce_dtype="float32")


def run_hsdp(args: argparse.Namespace) -> None:
    _fsdp2(args, "hsdp", hybrid_shard_size=1)  # 2 replicas of a 1-rank shard group


def _fsdp1(
    args: argparse.Namespace,
    name: str,
    ckpt_path: Optional[str] = None,
    clip: Optional[float] = None,
    save_every: Optional[int] = None,
    **options: Any,
) -> None:
    """FSDP1 (Lightning's FSDPStrategy): GPU only."""
    from dit_lightning.distributed import DiTFSDPStrategy

    module, dm = build(args.data, optimizer="sgd" if clip else "adamw")
    strategy = DiTFSDPStrategy(**options)
    callbacks = []
    if save_every:
        callbacks.append(
            ModelCheckpoint(dirpath=str(args.out / name / "ckpt"), every_n_train_steps=save_every, save_top_k=-1)
        )
    kw = {"gradient_clip_val": clip, "gradient_clip_algorithm": "norm"} if clip else {}
    t = trainer(args.out, name, strategy, args.devices, args.num_nodes, callbacks=callbacks, accelerator="gpu", **kw)
    t.fit(module, dm, ckpt_path=ckpt_path)
    assert module.ema is not None
    dump(t, module, args.out, name, ema_local_numel=sum(p.numel() for p in module.ema.parameters()))


def run_fsdp1(args: argparse.Namespace) -> None:
    _fsdp1(args, "fsdp1", save_every=CKPT_STEP, sharding_strategy="FULL_SHARD", state_dict_type="sharded")


def run_fsdp1_resume(args: argparse.Namespace) -> None:
    ckpt = args.out / "fsdp1" / "ckpt" / f"epoch=0-step={CKPT_STEP}.ckpt"
    _fsdp1(args, "fsdp1_resume", ckpt_path=str(ckpt), sharding_strategy="FULL_SHARD", state_dict_type="sharded")


def run_fsdp1_clip(args: argparse.Namespace) -> None:
    _fsdp1(args, "fsdp1_clip", clip=CLIP, sharding_strategy="SHARD_GRAD_OP", activation_checkpointing=True)


def run_ddp_flow_repa(args: argparse.Namespace) -> None:
    run_ddp(args, "ddp_flow_repa", recipe="flow-repa")


def run_fsdp2_flow_repa(args: argparse.Namespace) -> None:
    _fsdp2(args, "fsdp2_flow_repa", recipe="flow-repa")


RUNS = {
    "ddp": run_ddp,
    "ddp_flow_repa": run_ddp_flow_repa,
    "fsdp2_flow_repa": run_fsdp2_flow_repa,
    "ddp_accum": run_ddp_accum,
    "fsdp2": run_fsdp2,
    "fsdp2_resume": run_fsdp2_resume,
    "fsdp2_clip": run_fsdp2_clip,
    "fsdp2_bf16": run_fsdp2_bf16,
    "hsdp": run_hsdp,
}
GPU_RUNS = {"fsdp1": run_fsdp1, "fsdp1_resume": run_fsdp1_resume, "fsdp1_clip": run_fsdp1_clip}
CPU_RUNS = ",".join(RUNS)
RUNS.update(GPU_RUNS)


def reference(
    data: str,
    out: Path,
    name: str = "single",
    clip: Optional[float] = None,
    accelerator: str = "cpu",
    recipe: str = "ddpm",
) -> tuple[DiTModule, L.Trainer]:
    """The same training in one process with the whole global batch (micro-batch 16)."""
    module, dm = build(data, optimizer="sgd" if clip else "adamw", recipe=recipe)
    kw = {"gradient_clip_val": clip, "gradient_clip_algorithm": "norm"} if clip else {}
    t = trainer(out, name, accelerator=accelerator, **kw)  # type: ignore[arg-type]
    t.fit(module, dm)
    return module, t


def main(argv: Optional[list[str]] = None) -> None:
    def layout(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--devices", type=int, default=2)
        parser.add_argument("--num-nodes", type=int, default=1)

    run_main(__doc__, RUNS, CPU_RUNS, argv, layout)


if __name__ == "__main__":
    main()
