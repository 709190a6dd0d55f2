"""The shipped GPU hardware profiles (``configs/hardware/*.yaml``) are the planner's own answers.

Each GPU profile is described here by its hardware, the strategy it is about and a few fixed
notes; its settings (precision, gradient accumulation, recomputed blocks, strategy) and the
numbers in its comments come from :func:`~dit_lightning.planner.recommend` for DiT-XL/2 at 256px
with the paper's global batch of 256. ``python -m dit_lightning.planner.profiles`` rewrites them
(``--check`` only compares); ``tests/planner/test_profiles.py`` fails when a profile drifts from
the planner. ``dit-lightning plan ... --fit --format yaml`` renders any recommendation the same
way, and :func:`fit_command` turns a recommendation into a ``dit-lightning fit --config ...``
line (naming the shipped profile when the recommendation is one).

The CPU profiles (``cpu.yaml``, ``fsdp-v2-cpu.yaml``) are not memory decisions and stay hand-written.
"""

from __future__ import annotations

import argparse
import functools
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..atomic import write_text
from ..models.dit import DIT_CONFIGS
from ..models.flops import shape_of, training_flops
from ..precision import dtype_name, is_mixed, short_name
from .memory import GiB, Sharding, Strategy
from .recommend import Recommendation, recommend

MODEL = "DiT-XL/2"
GLOBAL_BATCH = 256
LATENT_SIZE = 32
HARDWARE_DIR = Path("configs") / "hardware"
REGENERATE = "python -m dit_lightning.planner.profiles"
WIDTH = 98  # comment lines


@dataclass(frozen=True)
class Profile:
    """A GPU profile: the hardware and strategy it is written for, and its fixed notes."""

    name: str  # the file's stem under configs/hardware/
    title: str  # the first comment line
    gpu: str  # a name of the GPU table
    devices: int  # GPUs per node
    num_nodes: int = 1
    strategy: Optional[Strategy] = None  # pinned (None: single device)
    sharding: Optional[Sharding] = None  # FSDP: pinned
    fsdp2: bool = False  # DiTFSDP2Strategy (FSDP2 through ModelParallelStrategy) rather than FSDP1
    hybrid_shard_size: Optional[int] = None  # FSDP2 HSDP: shard within groups of this many ranks
    notes: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


_CONSOLIDATE = (
    "Checkpoints are sharded directories (one file per rank, fast); `dit-lightning consolidate` makes one file."
)
_LAUNCH = (
    "Launch one process per GPU on every node with SLURM (srun; Lightning reads SLURM_*) or torchrun:",
    "  torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\",
    "    -m dit_lightning.cli fit --config ... --config configs/hardware/{name}.yaml",
)

PROFILES: tuple[Profile, ...] = (
    Profile("1x24gb", "One 24 GB card (RTX 4090; an RTX 3090's answer is the same).", "rtx4090", 1),
    Profile(
        "2x24gb",
        "Two 24 GB cards (2x RTX 4090) with DDP: each card holds a full replica, only the batch is split.",
        "rtx4090",
        2,
        strategy="ddp",
        notes=("No NVLink on 4090s: the gradient all-reduce goes over PCIe.",),
    ),
    Profile("4xa100-80gb", "Four A100-80GB with DDP.", "a100-80gb", 4, strategy="ddp"),
    Profile(
        "8gpu",
        "Eight 80 GB GPUs in one node (A100-80GB; an H100 gets the same settings, faster) with DDP.",
        "a100-80gb",
        8,
        strategy="ddp",
    ),
    Profile(
        "multinode",
        "Several 8-GPU nodes (here 4 x 8 A100-80GB = 32 GPUs) with DDP.",
        "a100-80gb",
        8,
        num_nodes=4,
        strategy="ddp",
        notes=(*_LAUNCH, "Below ~8 images per GPU the all-reduce dominates: more nodes shrink the per-GPU batch."),
    ),
    Profile(
        "fsdp-full-shard-8gpu",
        "Eight A100-80GB with FSDP1 FULL_SHARD (ZeRO-3): weights, gradients, AdamW state and EMA split 8 ways.",
        "a100-80gb",
        8,
        strategy="fsdp",
        sharding="FULL_SHARD",
        notes=(
            "Costs an all-gather of each block's weights in the forward and again in the backward plus a",
            "reduce-scatter of its gradients (~1.5x DDP's traffic): worth it when memory, not bandwidth, limits.",
            _CONSOLIDATE,
            "Lightning 2.6's FSDPStrategy needs CUDA; on CPU use fsdp-v2-cpu.yaml (FSDP2).",
        ),
    ),
    Profile(
        "fsdp-shard-grad-op-8gpu",
        "Eight A100-80GB with FSDP1 SHARD_GRAD_OP (ZeRO-2): gradients, AdamW state and EMA split 8 ways.",
        "a100-80gb",
        8,
        strategy="fsdp",
        sharding="SHARD_GRAD_OP",
        notes=(
            "The parameters are gathered once per step and kept until the backward is done: one all-gather",
            "instead of FULL_SHARD's two, for a whole 16-bit copy of the weights per GPU (1.3 GB for DiT-XL/2).",
            _CONSOLIDATE,
        ),
    ),
    Profile(
        "fsdp-v2-8gpu",
        "Eight A100-80GB with FSDP2 (fully_shard per DiTBlock and per DiT): FULL_SHARD's memory.",
        "a100-80gb",
        8,
        strategy="fsdp",
        sharding="FULL_SHARD",
        fsdp2=True,
        notes=(
            "FSDP2's own mixed precision: fp32 master shards, 16-bit all-gathers and compute, fp32 reduce-scatter",
            "(trainer.precision stays 32-true). reshard_after_forward: false trades memory for one all-gather less.",
            _CONSOLIDATE,
        ),
    ),
    Profile(
        "fsdp-v2-hybrid-multinode",
        "Several 8-GPU nodes (here 4 x 8 A100-80GB) with FSDP2 hybrid sharding (HSDP).",
        "a100-80gb",
        8,
        num_nodes=4,
        strategy="fsdp",
        sharding="FULL_SHARD",
        fsdp2=True,
        hybrid_shard_size=8,
        notes=(
            "Shards within each node (fast NVLink all-gathers / reduce-scatters) and replicates across nodes",
            "(one all-reduce of 1/8 of the gradients over the network): memory per GPU as FSDP over 8 GPUs.",
            *_LAUNCH,
        ),
    ),
)


def profile(name: str) -> Profile:
    """The profile ``name`` (a file stem of configs/hardware/)."""
    for p in PROFILES:
        if p.name == name:
            return p
    raise ValueError(f"no GPU profile '{name}': {', '.join(p.name for p in PROFILES)}")


@functools.cache
def profile_recommendation(name: str) -> Recommendation:
    """The planner's answer for a profile's hardware and strategy (DiT-XL/2, 256px, global batch 256)."""
    p = profile(name)
    return recommend(
        MODEL,
        gpu=p.gpu,
        num_gpus=p.world_size,
        global_batch=GLOBAL_BATCH,
        latent_size=LATENT_SIZE,
        strategy=p.strategy,
        sharding=p.sharding,
        shard_group=p.hybrid_shard_size,
        num_nodes=p.num_nodes,
    )


# ---- rendering ------------------------------------------------------------------------------------


def _trades(rec: Recommendation) -> list[str]:
    """What the settings trade, in words, with the planner's numbers (one paragraph each)."""
    world, m, a = rec.world_size, rec.micro_batch, rec.accumulate_grad_batches
    half = short_name(rec.precision) if is_mixed(rec.precision) else None
    if half and rec.strategy == "fsdp":
        text = (
            f"{half} compute: FSDP gathers the weights in {half} and reduces the gradients in fp32; the sharded "
            "master weights, AdamW state and EMA stay fp32."
        )
    elif rec.precision == "bf16-mixed":
        text = (
            "bf16 autocast: 16-bit matmuls on the tensor cores without a GradScaler; weights, AdamW and EMA stay fp32."
        )
    elif rec.precision == "16-mixed":
        text = "fp16 autocast with a GradScaler (the card has no bf16); weights, AdamW and EMA stay fp32."
    else:
        text = "fp32 (TF32 matmuls)."
    paragraphs = [text]
    gpus = f"{world} GPUs" if world > 1 else "1 GPU"
    if a == 1:
        paragraphs.append(f"Micro-batch {m} x {gpus} = {rec.global_batch}: no gradient accumulation.")
    else:
        paragraphs.append(
            f"Micro-batch {m} x {gpus} x {a} accumulation steps = {rec.global_batch}: {a} forward/backward passes "
            "per optimiser step."
        )
    if rec.checkpointed_blocks == 0:
        paragraphs.append("No activation checkpointing: every block keeps its activations for the backward pass.")
    else:
        shape = shape_of(rec.model, input_size=rec.memory.latent_size)
        useful, executed = training_flops(shape, recomputed_blocks=rec.checkpointed_blocks)
        paragraphs.append(
            f"The first {rec.checkpointed_blocks} of {rec.depth} blocks recompute their activations in the backward "
            f"pass (+{executed / useful - 1:.0%} compute)."
        )
    plan = rec.memory
    usable = f" of {plan.budget / GiB:.1f}" if plan.budget else ""
    paragraphs.append(
        f"Planner: {plan.total / GiB:.1f}{usable} GiB per GPU (peak during {plan.peak_phase}), "
        f"~{rec.step_time_s:.3f} s/step, {rec.images_per_s:.0f} images/s at the assumed utilisation."
    )
    comm = rec.communication
    if comm is not None:
        where = f"{comm.link} (~{comm.link_gbs:g} GB/s)" + (
            f" and {comm.network_bytes_sent / 1e9:.2f} GB across nodes" if comm.network_bytes_sent else ""
        )
        text = (
            f"Communication: {comm.bytes_sent / 1e9:.2f} GB per GPU per step over {where}, {comm.seconds:.3f} s, "
            f"{comm.exposed_s:.3f} s of it not hidden ({comm.exposed_s / rec.step_time_s:.0%} of the step)"
        )
        others = [f"{k} {t:.3f} s/step" for k, (t, _) in rec.communication_options.items() if k != comm.communication]
        paragraphs.append(text + (f"; with communication {', '.join(others)}." if others else "."))
    runner = next((c for c in rec.alternatives[1:] if c.fits), None)
    if runner is not None:
        paragraphs.append(
            f"Runner-up: {runner.precision}, micro-batch {runner.micro_batch} x {runner.accumulate_grad_batches} "
            f"accumulation, {runner.checkpointed_blocks} blocks recomputed ({runner.total_gib:.1f} GiB, "
            f"{runner.step_time_s:.3f} s/step)."
        )
    return paragraphs


def _plan_command(
    rec: Recommendation, shard_group: Optional[int] = None, num_nodes: int = 1, fsdp2: bool = False
) -> str:
    parts = [f"dit-lightning plan --model {rec.model} --gpu {rec.gpu}"]
    if rec.world_size > 1:
        parts.append(f"--world_size {rec.world_size}")
    if rec.memory.latent_size != LATENT_SIZE:
        parts.append(f"--latent_size {rec.memory.latent_size}")
    if rec.global_batch != GLOBAL_BATCH:
        parts.append(f"--global_batch {rec.global_batch}")
    if rec.world_size > 1:
        parts.append(f"--strategy {rec.strategy}")
        if rec.sharding:
            parts.append(f"--sharding {rec.sharding}")
    if shard_group:
        parts.append(f"--shard_group {shard_group}")
    elif fsdp2:
        parts.append("--fsdp2 true")
    if num_nodes > 1:
        parts.append(f"--num_nodes {num_nodes}")
    return " ".join(parts) + " --fit --format yaml"


def _strategy_block(
    rec: Recommendation, fsdp2: bool = False, hybrid_shard_size: Optional[int] = None
) -> tuple[str, list[str]]:
    """(trainer precision, the YAML lines of trainer.strategy)."""
    if rec.world_size == 1:
        return rec.precision, []
    if rec.strategy == "ddp":
        return rec.precision, [
            "  strategy:",
            "    class_path: dit_lightning.distributed.DiTDDPStrategy   # what `dit-lightning plan --fit` plans for",
            "    init_args:",
            "      gradient_as_bucket_view: true   # no second copy of the gradients (the default; stated for clarity)",
        ]
    if fsdp2:
        lines = [
            "  strategy:",
            "    class_path: dit_lightning.distributed.DiTFSDP2Strategy",
            "    init_args:",
        ]
        if is_mixed(rec.precision):
            lines += [f"      param_dtype: {dtype_name(rec.precision)}", "      reduce_dtype: float32"]
        if hybrid_shard_size:
            lines.append(f"      hybrid_shard_size: {hybrid_shard_size}   # the GPUs of one node")
        else:
            lines.append(f"      reshard_after_forward: {'true' if rec.sharding == 'FULL_SHARD' else 'false'}")
        return "32-true", lines  # FSDP2 computes in param_dtype: no autocast
    lines = [
        "  strategy:",
        "    class_path: dit_lightning.distributed.DiTFSDPStrategy",
        "    init_args:",
        f"      sharding_strategy: {rec.sharding}",
        "      state_dict_type: sharded",
    ]
    if is_mixed(rec.precision):
        lines += [f"      param_dtype: {dtype_name(rec.precision)}", "      reduce_dtype: float32"]
    return rec.precision, lines


def render_yaml(
    rec: Recommendation,
    title: Optional[str] = None,
    notes: tuple[str, ...] = (),
    num_nodes: int = 1,
    fsdp2: bool = False,
    shard_group: Optional[int] = None,
) -> str:
    """A recommendation as a hardware profile (YAML with its explanation as comments); FSDP is
    written as FSDP1 (``DiTFSDPStrategy``) unless ``fsdp2`` (or ``shard_group``, HSDP: FSDP2)."""
    hybrid_shard_size = shard_group
    fsdp2 = fsdp2 or shard_group is not None
    devices = rec.world_size // num_nodes
    where = rec.gpu or f"{rec.budget_gib:g} GiB device"
    title = title or (f"{rec.world_size}x {where}" + (f" with {rec.strategy}" if rec.world_size > 1 else "") + ".")
    precision, strategy = _strategy_block(rec, fsdp2, hybrid_shard_size)
    paragraphs = [
        title,
        f"The planner's fastest setting for {rec.model} at {rec.memory.latent_size * 8}px, global batch "
        f"{rec.global_batch} (for another model, batch or card add `--auto_fit true`: docs/auto-fit.md).",
        *_trades(rec),
    ]
    comments = [line for p in paragraphs for line in textwrap.wrap(p, WIDTH)]
    comments += [
        *notes,
        "Generated by",
        f"  {_plan_command(rec, hybrid_shard_size, num_nodes, fsdp2)}",
        f"and rewritten with every GPU profile by `{REGENERATE}`",
        "(tests/planner/test_profiles.py fails when a profile drifts from the planner).",
    ]
    lines = [f"# {c}".rstrip() for c in comments]
    lines += ["trainer:", "  accelerator: gpu", f"  devices: {devices}"]
    if num_nodes > 1:
        lines.append(f"  num_nodes: {num_nodes}")
    lines.append(f"  precision: {precision}")
    if fsdp2 and is_mixed(rec.precision):
        lines[-1] += "   # the compute dtype comes from param_dtype (no autocast needed)"
    lines.append(f"  accumulate_grad_batches: {rec.accumulate_grad_batches}")
    lines += strategy
    lines += ["model:", f"  activation_checkpointing: {rec.activation_checkpointing}"]
    return "\n".join(lines) + "\n"


def profile_yaml(name: str) -> str:
    """The text of ``configs/hardware/<name>.yaml`` as the planner writes it."""
    p = profile(name)
    notes = tuple(n.replace("{name}", p.name) for n in p.notes)
    return render_yaml(
        profile_recommendation(name),
        title=p.title,
        notes=notes,
        num_nodes=p.num_nodes,
        fsdp2=p.fsdp2,
        shard_group=p.hybrid_shard_size,
    )


def write_profiles(directory: Path = HARDWARE_DIR, check: bool = False) -> list[str]:
    """Write every GPU profile into ``directory`` (``check``: only compare). Returns the names that
    differed from what was there."""
    changed = []
    for p in PROFILES:
        path = Path(directory) / f"{p.name}.yaml"
        text = profile_yaml(p.name)
        if not path.exists() or path.read_text() != text:
            changed.append(p.name)
            if not check:
                write_text(path, text)
    return changed


# ---- the command that runs a recommendation --------------------------------------------------------


def _settings(rec: Recommendation) -> tuple:
    return (
        rec.model,
        rec.gpu,
        rec.world_size,
        rec.global_batch,
        rec.memory.latent_size,
        rec.strategy,
        rec.sharding,
        rec.precision,
        rec.micro_batch,
        rec.accumulate_grad_batches,
        rec.checkpointed_blocks,
    )


def matching_profile(rec: Recommendation) -> Optional[str]:
    """The shipped profile whose planner answer is this recommendation (same hardware and settings)."""
    for p in PROFILES:
        if p.fsdp2 or p.num_nodes > 1:
            continue  # the FSDP2 and multi-node profiles need more than a --world_size to reproduce
        if (
            p.gpu == rec.gpu
            and p.world_size == rec.world_size
            and _settings(profile_recommendation(p.name)) == (_settings(rec))
        ):
            return p.name
    return None


def fit_command(rec: Recommendation) -> str:
    """A ``dit-lightning fit`` line that trains with the recommendation: the model's and data's
    configs where the project ships them, then the shipped hardware profile if it is this very
    setting, else the settings as options."""
    parts = ["dit-lightning fit"]
    slug = rec.model.lower().replace("/", "-")
    if rec.model in DIT_CONFIGS:
        parts.append(f"--config configs/model/{slug}.yaml")
    else:
        m = rec.memory
        parts.append(
            f"--model.model {rec.model} --model.depth {m.depth} --model.hidden_size {m.hidden_size} "
            f"--model.num_heads {m.num_heads} --model.patch_size {m.patch_size}"
        )
    latent = rec.memory.latent_size
    data = {32: "imagenet256", 64: "imagenet512"}.get(latent)
    parts.append(f"--config configs/data/{data}.yaml" if data else "--data.path YOUR_LATENT_STORE")
    if rec.model == MODEL and latent == LATENT_SIZE:
        parts.append("--config configs/experiment/dit-xl2-256-paper.yaml")
    name = matching_profile(rec)
    if name is not None:
        parts.append(f"--config configs/hardware/{name}.yaml")
    else:
        parts += ["--trainer.accelerator gpu" if rec.device == "cuda" else "--trainer.accelerator cpu"]
        parts += [a for a in rec.lightning_args if not a.startswith("--data.global_batch_size")]
    if rec.global_batch != GLOBAL_BATCH or (data is None):
        parts.append(f"--data.global_batch_size {rec.global_batch}")
    return " ".join(parts)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog=REGENERATE, description="Write the GPU profiles the planner answers.")
    parser.add_argument("directory", nargs="?", default=str(HARDWARE_DIR))
    parser.add_argument("--check", action="store_true", help="only say which profiles differ (exit 1 if any)")
    args = parser.parse_args(argv)
    changed = write_profiles(Path(args.directory), check=args.check)
    verb = "differ" if args.check else "rewritten"
    print(f"{len(changed)} of {len(PROFILES)} GPU profiles {verb}: {', '.join(changed) or 'none'}")
    if args.check and changed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
