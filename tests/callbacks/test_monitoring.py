"""Monitoring callbacks: tags written to TensorBoard by tiny CPU fits (and CUDA fits where a GPU
is present), the device peak tables, accumulation and data-wait accounting, config logging."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, Dataset, default_collate

from dit_lightning.callbacks.config_logger import TensorBoardConfigLogger
from dit_lightning.callbacks.memory import GPUMemoryMonitor
from dit_lightning.callbacks.throughput import DiTThroughputMonitor, device_peak_flops, window_metrics
from dit_lightning.module import DiTModule
from dit_lightning.planner.hardware import PEAK_FLOPS, device_key, peak_flops_for
from dit_lightning.precision import to_dtype as precision_dtype
from tests.helpers.training import TINY_MODULE

DOCS = Path(__file__).resolve().parents[2] / "docs" / "monitoring.md"

THROUGHPUT_TAGS = [
    "throughput/images_per_sec",
    "throughput/device/images_per_sec",
    "throughput/steps_per_sec",
    "throughput/device/batches_per_sec",
    "throughput/images_per_step",
    "throughput/tokens_per_sec",
    "throughput/device/tokens_per_sec",
    "throughput/data_wait_fraction",
    "throughput/device/tflops",
]
MFU_TAGS = ["throughput/mfu", "throughput/hfu"]
CPU_MEMORY_TAGS = ["memory/cpu_rss_gib", "memory/cpu_peak_rss_gib"]
CUDA_MEMORY_TAGS = [
    "memory/allocated_gib",
    "memory/reserved_gib",
    "memory/peak_allocated_gib",
    "memory/peak_reserved_gib",
    "memory/alloc_retries",
    "memory/ooms",
]
CPU_TAGS = THROUGHPUT_TAGS + MFU_TAGS + CPU_MEMORY_TAGS  # MFU with a user-given peak on CPU


pytestmark = pytest.mark.usefixtures("one_thread")


class Latents(Dataset):
    def __init__(self, n: int = 256, shape=(1, 8, 8)) -> None:
        self.n, self.shape = n, shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(self.shape, generator=g), "y": i % 10, "index": i}


class SlowCollate:
    """A loader that takes ``seconds`` per batch (a slow disk, too few workers)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, items):
        time.sleep(self.seconds)
        return default_collate(items)


def tiny_module(**overrides) -> DiTModule:
    return DiTModule(**{**TINY_MODULE, **overrides})


def fit(tmp_path, module, callbacks, max_steps=8, batch_size=16, collate=None, val_loader=None, **trainer_kw):
    logger = TensorBoardLogger(str(tmp_path), name="", version="run")
    kw = dict(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=logger,
        log_every_n_steps=2,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )
    kw.update(trainer_kw)
    trainer = L.Trainer(**kw)
    loader = DataLoader(Latents(), batch_size=batch_size, collate_fn=collate)
    trainer.fit(module, loader, val_loader)
    return trainer, logger.log_dir


def read_events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def scalars(ea) -> dict[str, list[tuple[int, float]]]:
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def text(ea, tag: str) -> str:
    return ea.Tensors(f"{tag}/text_summary")[-1].tensor_proto.string_val[0].decode()


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """8 steps, logged every 2, activation checkpointing on, a fake 1 TFLOP/s CPU peak."""
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    module = tiny_module(activation_checkpointing="all")
    throughput = DiTThroughputMonitor(peak_flops=1e12)
    memory = GPUMemoryMonitor()
    trainer, log_dir = fit(tmp_path_factory.mktemp("cpu_run"), module, [throughput, memory], enable_progress_bar=True)
    torch.set_num_threads(before)
    ea = read_events(log_dir)
    return dict(trainer=trainer, throughput=throughput, memory=memory, ea=ea, scalars=scalars(ea))


# ---- the CPU fit ------------------------------------------------------------------------------
def test_every_documented_cpu_tag_is_logged_with_sane_values(cpu_run):
    s = cpu_run["scalars"]
    missing = [t for t in CPU_TAGS if t not in s]
    assert not missing, f"missing tags {missing}; logged {sorted(s)}"
    assert not [t for t in CUDA_MEMORY_TAGS if t in s], "CUDA allocator tags must not appear on CPU"
    # the trainer's cadence (every 2 steps, first step = warm-up) and the same x as train/loss
    loss_steps = [step for step, _ in s["train/loss"]]
    for tag in CPU_TAGS:
        assert [step for step, _ in s[tag]] == loss_steps == [1, 3, 5, 7], tag
    for i in range(len(loss_steps)):
        v = {tag: s[tag][i][1] for tag in CPU_TAGS}
        assert v["throughput/images_per_sec"] > 0 and v["throughput/steps_per_sec"] > 0
        assert 0.0 <= v["throughput/data_wait_fraction"] <= 1.0
        assert v["throughput/images_per_step"] == 16
        assert v["throughput/images_per_sec"] == pytest.approx(v["throughput/steps_per_sec"] * 16, rel=1e-5)
        assert v["throughput/device/images_per_sec"] == pytest.approx(v["throughput/images_per_sec"], rel=1e-5)
        assert v["throughput/device/batches_per_sec"] == pytest.approx(v["throughput/steps_per_sec"], rel=1e-5)
        assert v["throughput/tokens_per_sec"] == pytest.approx(v["throughput/images_per_sec"] * 16, rel=1e-5)  # (8/2)^2
        assert 0.0 < v["throughput/mfu"] <= 1.0
        assert v["throughput/hfu"] > v["throughput/mfu"]  # every block recomputed
        assert v["throughput/mfu"] == pytest.approx(v["throughput/device/tflops"], rel=1e-5)  # peak = 1 TFLOP/s
        assert v["memory/cpu_peak_rss_gib"] >= v["memory/cpu_rss_gib"] > 0


def test_mfu_uses_the_module_flops_and_compute_time(cpu_run):
    module = cpu_run["trainer"].lightning_module
    useful, executed = module.flops_per_image()
    s = cpu_run["scalars"]
    for (_, mfu), (_, hfu) in zip(s["throughput/mfu"], s["throughput/hfu"]):
        assert hfu / mfu == pytest.approx(executed / useful, rel=1e-5)
    # MFU is over compute time only: times (1 - data wait) it is the wall-clock utilisation
    rows = zip(s["throughput/mfu"], s["throughput/images_per_sec"], s["throughput/data_wait_fraction"])
    for (_, mfu), (_, ips), (_, wait) in rows:
        assert mfu * (1 - wait) == pytest.approx(ips * useful / 1e12, rel=1e-4)


def test_progress_bar_summary_and_hparams(cpu_run):
    trainer = cpu_run["trainer"]
    assert trainer.progress_bar_metrics["img/s"] > 0
    line = cpu_run["memory"].summary_line
    assert line is not None and line == cpu_run["throughput"].summary_line
    for needle in (
        "img/s",
        "steps/s",
        "MFU",
        "HFU",
        "data wait",
        "peak CPU RSS",
        "batch 16x1x1=16",
        "depth=2",
        "32-true",
    ):
        assert needle in line, (needle, line)
    assert "\n" not in line
    ea = cpu_run["ea"]
    assert text(ea, "summary") == line
    # DiTModule.save_hyperparameters -> TensorBoardLogger writes the HPARAMS plugin data
    content = ea.PluginTagToContent("hparams")
    assert b"hidden_size" in content["_hparams_/session_start_info"]
    stats = cpu_run["throughput"].fit_stats
    assert stats["images_per_step"] == 16 and stats["steps"] == 7  # 8 steps minus 1 warm-up
    assert 0 < stats["mfu"] < stats["hfu"] <= 1


def test_tags_are_documented(cpu_run):
    docs = DOCS.read_text()
    documented = set(re.findall(r"`((?:throughput|memory)/[a-z0-9_/{}]+)`", docs))
    for tag in CPU_TAGS + CUDA_MEMORY_TAGS:
        assert tag in documented, f"{tag} is not in {DOCS.name}"
    assert "memory/rank{r}/" in docs


# ---- accumulation, data wait, validation -------------------------------------------------------
def test_gradient_accumulation_is_counted(tmp_path):
    monitor = DiTThroughputMonitor(warmup_steps=0, prog_bar=False, summary=False)
    _, log_dir = fit(tmp_path, tiny_module(ema=False), [monitor], max_steps=4, batch_size=8, accumulate_grad_batches=3)
    s = scalars(read_events(log_dir))
    assert [step for step, _ in s["throughput/images_per_step"]] == [1, 3]
    for i in range(2):
        assert s["throughput/images_per_step"][i][1] == 24  # 8 images x 3 micro-batches x 1 device
        steps = s["throughput/steps_per_sec"][i][1]
        assert s["throughput/images_per_sec"][i][1] == pytest.approx(24 * steps, rel=1e-5)
        assert s["throughput/device/batches_per_sec"][i][1] == pytest.approx(3 * steps, rel=1e-5)
    assert "throughput/mfu" not in s  # CPU without peak_flops: no MFU, but achieved TFLOP/s
    assert s["throughput/device/tflops"][0][1] > 0
    assert monitor.fit_stats["steps"] == 4 and monitor.fit_stats["images_per_step"] == 24


def test_slow_loader_shows_as_data_wait_and_validation_does_not(tmp_path):
    slow = DiTThroughputMonitor(warmup_steps=0, prog_bar=False, summary=False)
    _, log_dir = fit(tmp_path / "slow", tiny_module(ema=False), [slow], max_steps=4, collate=SlowCollate(0.15))
    s = scalars(read_events(log_dir))
    # The wait per step (wait / wall over steps / wall) holds the loader's sleep whatever the load of
    # the machine (a fraction of the wall time does not: a busy CI core slows the step, not the sleep).
    # Windows of 2 steps, logged at steps 1 and 3: the first batch of the fit has no wait before it.
    per_step = [f / r for (_, f), (_, r) in zip(s["throughput/data_wait_fraction"], s["throughput/steps_per_sec"])]
    assert per_step[0] >= 0.99 * 0.15 / 2 and per_step[1] >= 0.99 * 0.15, per_step

    # a slow validation between logging windows is neither compute nor data wait
    fast = DiTThroughputMonitor(warmup_steps=0, prog_bar=False, summary=False)
    val_loader = DataLoader(Latents(16), batch_size=16, collate_fn=SlowCollate(0.4))
    _, log_dir = fit(  # validation after steps 2 and 4: right after a log, inside the next window
        tmp_path / "val",
        tiny_module(ema=False),
        [fast],
        max_steps=4,
        val_loader=val_loader,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
    )
    s = scalars(read_events(log_dir))
    assert "val/loss" in s
    assert max(v for _, v in s["throughput/data_wait_fraction"]) < 0.5
    assert fast.fit_stats["data_wait_fraction"] < 0.5


# ---- pure functions ----------------------------------------------------------------------------
def test_window_metrics_reduce_over_ranks():
    # rank rows: images, micro-batches, compute s, wait s; 2 optimiser steps of 2 x 2 x 16 images
    rows = torch.tensor([[64.0, 4.0, 1.5, 0.5], [64.0, 4.0, 1.0, 1.0]])
    m = window_metrics(rows, steps=2, tokens_per_image=256, flops_per_image=(1e12, 1.5e12), peak_flops=1e13)
    assert m["throughput/images_per_sec"] == pytest.approx(64.0)  # 32 + 32
    assert m["throughput/device/images_per_sec"] == pytest.approx(32.0)
    assert m["throughput/steps_per_sec"] == pytest.approx(1.0)
    assert m["throughput/images_per_step"] == 64
    assert m["throughput/device/batches_per_sec"] == pytest.approx(2.0)
    assert m["throughput/data_wait_fraction"] == pytest.approx((0.25 + 0.5) / 2)
    assert m["throughput/tokens_per_sec"] == pytest.approx(64 * 256)
    achieved = (64e12 / 1.5 + 64e12 / 1.0) / 2
    assert m["throughput/device/tflops"] == pytest.approx(achieved / 1e12)
    assert m["throughput/mfu"] == pytest.approx(achieved / 1e13)
    assert m["throughput/hfu"] == pytest.approx(1.5 * achieved / 1e13)


@pytest.mark.parametrize(
    "name, dtype, tf32, expected",
    [
        ("NVIDIA H200", torch.bfloat16, False, 989e12),
        ("NVIDIA H200", torch.float32, False, 67e12),
        ("NVIDIA H200", torch.float32, True, 494e12),
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989e12),
        ("NVIDIA H100 80GB HBM3", torch.float16, False, 989e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, False, 756e12),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, False, 312e12),
        ("NVIDIA A100 80GB PCIe", torch.float32, False, 19.5e12),
        ("NVIDIA A100-PCIE-40GB", torch.float32, True, 156e12),
        ("NVIDIA L40S", torch.bfloat16, False, 362e12),
        ("NVIDIA L40S", torch.float32, False, 91.6e12),
        ("NVIDIA GeForce RTX 4090", torch.float16, False, 165e12),
        ("NVIDIA GeForce RTX 3090", torch.bfloat16, False, 71e12),
        ("NVIDIA GH200 480GB", torch.bfloat16, False, 989e12),
    ],
)
def test_peak_lookup(name, dtype, tf32, expected):
    assert peak_flops_for(name, dtype, tf32=tf32) == pytest.approx(expected)


def test_device_name_matching():
    assert device_key("NVIDIA H200") == "h200"
    assert device_key("NVIDIA H200 NVL") == "h200-nvl"
    assert device_key("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert device_key("NVIDIA H100 NVL") == "h100-nvl"
    assert device_key("NVIDIA GeForce RTX 3090 Ti") == "rtx3090-ti"
    for other in ("NVIDIA L40", "NVIDIA A10G", "Tesla T4", "NVIDIA GeForce RTX 4090 D", "NVIDIA RTX A6000"):
        assert device_key(other) is None, other  # left to Lightning's table
    assert peak_flops_for("NVIDIA H200", torch.float64) is None
    assert set(PEAK_FLOPS["h200"]) == {"fp32", "tf32", "bf16", "fp16"}
    assert precision_dtype("bf16-mixed") is torch.bfloat16
    assert precision_dtype("16-mixed") is torch.float16
    assert precision_dtype("32-true") is torch.float32
    assert device_peak_flops(torch.device("cpu"), "32-true") is None  # CPU: only a user-given peak


def test_analytic_flops_match_lightning_measure_flops():
    """The FLOPs behind MFU equal what torch's FlopCounterMode counts on the forward pass (math
    SDPA: the CPU flash kernel is not counted); backward = 2x forward by convention."""
    from lightning.fabric.utilities.throughput import measure_flops
    from torch.nn.attention import SDPBackend, sdpa_kernel

    module = tiny_module(ema=False)
    net, batch = module.model, 4
    x, t, y = torch.randn(batch, 1, 8, 8), torch.randint(0, 1000, (batch,)), torch.randint(0, 10, (batch,))

    def forward():
        with sdpa_kernel(SDPBackend.MATH):
            return net(x, t, y)

    useful, executed = module.flops_per_image()
    assert measure_flops(net, forward) / batch == pytest.approx(useful / 3, rel=1e-3)
    assert executed == useful


# ---- the resolved CLI config in TensorBoard ---------------------------------------------------
class TinyData(L.LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(Latents(64), batch_size=self.batch_size)


def test_cli_config_logged_as_text(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
model:
  model: custom
  latent_shape: [1, 8, 8]
  num_classes: 10
  depth: 2
  hidden_size: 32
  num_heads: 4
  patch_size: 2
trainer:
  accelerator: cpu
  max_steps: 2
  log_every_n_steps: 1
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args: {{save_dir: "{tmp_path}", name: "", version: cli}}
  callbacks:
    - class_path: dit_lightning.callbacks.throughput.DiTThroughputMonitor
      init_args: {{peak_flops: 1.0e+12, warmup_steps: 0}}
    - class_path: dit_lightning.callbacks.memory.GPUMemoryMonitor
      init_args: {{per_rank: true}}
"""
    )
    LightningCLI(
        DiTModule,
        TinyData,
        save_config_callback=TensorBoardConfigLogger,
        save_config_kwargs={"overwrite": True},
        args=["fit", "--config", str(config)],
    )
    ea = read_events(tmp_path / "cli")
    logged = text(ea, "config")
    assert "hidden_size: 32" in logged and "DiTThroughputMonitor" in logged and "max_steps: 2" in logged
    assert all(line.startswith("    ") for line in logged.splitlines())  # a Markdown code block
    assert (tmp_path / "cli" / "config.yaml").exists()  # SaveConfigCallback's own file still written
    s = scalars(ea)
    assert "throughput/mfu" in s and "memory/rank0/cpu_rss_gib" in s and "memory/cpu_rss_gib" in s


# ---- several ranks (a fake 2-rank gather: spawning real gloo ranks costs ~40 s here) ----------
def test_memory_max_over_ranks_and_per_rank_tags():
    from types import SimpleNamespace

    from dit_lightning.callbacks.memory import memory_row

    def all_gather(row):  # rank 1 uses twice the memory of rank 0
        return torch.stack([row, 2 * row])

    trainer = SimpleNamespace(
        world_size=2, strategy=SimpleNamespace(root_device=torch.device("cpu"), all_gather=all_gather)
    )
    monitor = GPUMemoryMonitor(per_rank=True)
    metrics = monitor._measure(trainer)
    assert set(metrics) == {
        f"memory{r}/{n}" for r in ("", "/rank0", "/rank1") for n in ("cpu_rss_gib", "cpu_peak_rss_gib")
    }
    for name in ("cpu_rss_gib", "cpu_peak_rss_gib"):
        assert (
            metrics[f"memory/{name}"]
            == metrics[f"memory/rank1/{name}"]
            == pytest.approx(2 * metrics[f"memory/rank0/{name}"])
        )
    assert monitor.fit_peaks["cpu_peak_rss_gib"] == metrics["memory/cpu_peak_rss_gib"]
    assert len(memory_row(torch.device("cpu"))) == len(CUDA_MEMORY_TAGS) + len(CPU_MEMORY_TAGS)


# ---- CUDA (run on a GPU machine) ---------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _SpikeAndOOM(L.Callback):
    """Allocates 512 MiB once during the first logging window and provokes one caught OOM."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            spike = torch.empty(2**29, dtype=torch.uint8, device=pl_module.device)
            del spike
        if trainer.global_step == 3:
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(2**50, dtype=torch.uint8, device=pl_module.device)  # 1 PiB


@pytest.mark.gpu
@needs_cuda
def test_cuda_memory_throughput_and_mfu(tmp_path):
    name = torch.cuda.get_device_name()
    throughput = DiTThroughputMonitor()
    memory = GPUMemoryMonitor(per_rank=True)
    trainer, log_dir = fit(
        tmp_path,
        tiny_module(activation_checkpointing="all"),
        [_SpikeAndOOM(), throughput, memory],
        accelerator="gpu",
        precision="bf16-mixed",
    )
    s = scalars(read_events(log_dir))
    missing = [t for t in THROUGHPUT_TAGS + CUDA_MEMORY_TAGS + CPU_MEMORY_TAGS if t not in s]
    assert not missing, missing
    assert [step for step, _ in s["memory/peak_allocated_gib"]] == [1, 3, 5, 7]
    for i in range(4):
        v = {tag: vals[i][1] for tag, vals in s.items() if len(vals) == 4}
        assert v["memory/reserved_gib"] >= v["memory/allocated_gib"] > 0
        assert v["memory/peak_allocated_gib"] >= v["memory/allocated_gib"]
        assert v["memory/peak_reserved_gib"] >= v["memory/reserved_gib"]
        assert v["memory/alloc_retries"] >= 0
        assert v["memory/rank0/allocated_gib"] == v["memory/allocated_gib"]
        assert 0.0 <= v["throughput/data_wait_fraction"] <= 1.0
        assert v["throughput/images_per_sec"] == pytest.approx(v["throughput/steps_per_sec"] * 16, rel=1e-5)
    peaks = [v for _, v in s["memory/peak_allocated_gib"]]
    assert peaks[0] >= 0.5 > peaks[1]  # the spike is in the first window only: peaks are reset
    ooms = [v for _, v in s["memory/ooms"]]
    assert ooms[1] >= ooms[0] + 1 and ooms[-1] == ooms[1]  # cumulative over the process: +1 at step 3
    if device_key(name) is not None:  # H200 and the other tabled GPUs
        assert throughput.peak_flops == peak_flops_for(name, torch.bfloat16)
        for (_, mfu), (_, hfu) in zip(s["throughput/mfu"], s["throughput/hfu"]):
            assert 0.0 < mfu < hfu <= 1.0
    line = memory.summary_line
    assert "peak GPU memory" in line and "OOMs" in line and name in line
    assert trainer.progress_bar_metrics["img/s"] > 0


@pytest.mark.gpu
@needs_cuda
def test_cuda_events_see_a_slow_loader(tmp_path):
    monitor = DiTThroughputMonitor(warmup_steps=1, prog_bar=False, summary=False)
    _, log_dir = fit(
        tmp_path, tiny_module(ema=False), [monitor], max_steps=5, accelerator="gpu", collate=SlowCollate(0.1)
    )
    waits = [v for _, v in scalars(read_events(log_dir))["throughput/data_wait_fraction"]]
    assert waits and min(waits) > 0.5, waits
    assert not math.isnan(monitor.fit_stats["images_per_sec"])


@pytest.mark.gpu
@needs_cuda
def test_current_gpu_peak_is_known_or_falls_back():
    name = torch.cuda.get_device_name()
    peak = device_peak_flops(torch.device("cuda", torch.cuda.current_device()), "bf16-mixed")
    if device_key(name) is not None:
        assert peak == peak_flops_for(name, torch.bfloat16)
    assert peak is None or 1e12 < peak < 1e16
