"""Lightning callbacks: sample grids, generation metrics (FID...), throughput/MFU, memory, and the TensorBoard
config logger."""

from .config_logger import TensorBoardConfigLogger
from .generation import GenerationMetrics
from .memory import GPUMemoryMonitor
from .samples import PredictionWriter, SampleGrid
from .throughput import DiTThroughputMonitor

__all__ = [
    "DiTThroughputMonitor",
    "GenerationMetrics",
    "GPUMemoryMonitor",
    "PredictionWriter",
    "SampleGrid",
    "TensorBoardConfigLogger",
]
