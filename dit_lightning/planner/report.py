"""The planner's results as rich tables (the ``plan`` command prints them)."""

from __future__ import annotations

from typing import Optional

from .communication import CommunicationPlan
from .memory import GiB, MemoryPlan
from .recommend import Recommendation


def _gib(x: Optional[int]) -> str:
    return "-" if x is None else f"{x / GiB:.2f}"


def render_memory(plan: MemoryPlan, console=None) -> None:
    """Print a memory plan as a table (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    strat = plan.strategy + (f" {plan.sharding}" if plan.sharding else "")
    title = (
        f"{plan.model} ({plan.parameters_count / 1e6:.1f}M params, {plan.tokens} tokens) | micro-batch "
        f"{plan.micro_batch} | "
        f"{plan.precision} | checkpointing {plan.checkpointed_blocks}/{plan.depth} | {strat} x{plan.world_size} | "
        f"{plan.optimizer}" + (" + EMA" if plan.ema else "")
    )
    table = Table(title=title, title_justify="left")
    table.add_column("memory per GPU", style="bold")
    table.add_column("GiB", justify="right")
    table.add_column("share", justify="right")
    for name, value in plan.breakdown().items():
        table.add_row(name, _gib(value), f"{value / plan.total:.0%}" if plan.total else "-")
    table.add_section()
    table.add_row("peak allocated (max_memory_allocated)", _gib(plan.peak_allocated), "")
    table.add_row("total on the device", _gib(plan.total), "")
    if plan.budget is not None:
        verdict = "[green]fits[/green]" if plan.fits else "[red]does not fit[/red]"
        table.add_row(f"budget ({plan.gpu or 'given'})", _gib(plan.budget), verdict)
    console.print(table)
    console.print(f"peak during: {plan.peak_phase}; static state (params+grads+optimizer+EMA): {_gib(plan.static)} GiB")
    for a in plan.assumptions:
        console.print(f"  - {a}")


def render_recommendation(rec: Recommendation, console=None) -> None:
    """Print a recommendation: the choice, the ranking, the memory plan of the choice."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    head = "[green]fits[/green]" if rec.feasible else "[red]nothing fits: closest shown[/red]"
    where = rec.gpu or f"{rec.device} device(s) of {rec.budget_gib:g} GiB"
    console.print(
        f"[bold]{rec.model} on {rec.world_size}x {where}, global batch {rec.global_batch}[/bold]: {head}\n"
        f"  micro-batch {rec.micro_batch} x {rec.world_size} {'GPU' if rec.device == 'cuda' else 'device'}"
        f"{'s' if rec.world_size > 1 else ''} x {rec.accumulate_grad_batches} accumulation = "
        f"{rec.global_batch}; "
        f"{rec.precision}; checkpoint {rec.checkpointed_blocks}/{rec.depth} blocks; {rec.strategy}"
        + (f" {rec.sharding}" if rec.sharding else "")
    )
    if rec.nominal_device:
        console.print("  (no GPU type given: step times below are relative to a nominal device, not predictions)")
    else:
        cost = f", ${rec.cost:,.0f} at ${rec.price_per_gpu_hour}/GPU-hour" if rec.cost is not None else ""
        console.print(
            f"  ~{rec.step_time_s:.3f} s/step, {rec.images_per_s:.0f} images/s, MFU "
            f"{rec.model_flops_utilisation:.0%}; {rec.steps:,} steps: {rec.hours:,.1f} h "
            f"({rec.gpu_hours:,.0f} GPU-hours{cost})"
        )
    console.print("  " + (rec.command or "dit-lightning fit " + " ".join(rec.lightning_args)), soft_wrap=True)
    render_communication(rec, console)
    table = Table(title="candidates (fastest first)", title_justify="left")
    small = all(c.total_bytes < GiB for c in rec.alternatives) and bool(rec.alternatives)
    for col in (
        "precision",
        "strategy",
        "micro",
        "accum",
        "ckpt",
        "MiB" if small else "GiB",
        "fits",
        "s/step",
        "img/s",
    ):
        table.add_column(col, justify="right")
    for c in rec.alternatives:
        table.add_row(
            c.precision,
            c.strategy + (f" {c.sharding}" if c.sharding else ""),
            str(c.micro_batch),
            str(c.accumulate_grad_batches),
            str(c.checkpointed_blocks),
            f"{c.total_bytes / 2**20:.1f}" if small else f"{c.total_gib:.1f}",
            "yes" if c.fits else "no",
            f"{c.step_time_s:.3f}",
            f"{c.images_per_s:.0f}",
        )
    console.print(table)
    render_memory(rec.memory, console)
    for a in rec.assumptions:
        console.print(f"  - {a}")


def communication_line(comm: CommunicationPlan, step_s: float) -> str:
    """One line: the bytes a GPU sends per optimiser step, their time on the link, what is not hidden."""
    kinds = ", ".join(f"{k.replace('_', '-')} {v / 1e9:.2f} GB" for k, v in comm.payload.items())
    line = (
        f"communication ({comm.strategy}, {comm.communication}): {comm.bytes_sent / 1e9:.2f} GB sent per GPU per "
        f"step ({kinds}) over {comm.link} at ~{comm.link_gbs:g} GB/s: {comm.seconds:.3f} s, of which "
        f"{comm.exposed_s:.3f} s not hidden = {comm.exposed_s / step_s:.0%} of the {step_s:.3f} s step"
    )
    return line + "".join(f"; {n}" for n in comm.notes)


def render_communication(rec: Recommendation, console=None) -> None:
    """The chosen setting's communication and what each gradient reduction would make of it."""
    from rich.console import Console

    if rec.communication is None:
        return
    console = console or Console()
    console.print("  " + communication_line(rec.communication, rec.step_time_s), soft_wrap=True)
    if rec.communication_options:
        alts = ", ".join(
            f"{k} {t:.3f} s ({exposed / t:.0%} communication)" for k, (t, exposed) in rec.communication_options.items()
        )
        console.print(
            f"  the same setting with --communication: {alts} (compression is lossy: docs/distributed.md)",
            soft_wrap=True,
        )
