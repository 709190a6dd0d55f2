"""Lightning callbacks: sample grids, throughput/MFU, memory, and the TensorBoard config logger."""

from .config_logger import TensorBoardConfigLogger
from .memory import GPUMemoryMonitor
from .samples import PredictionWriter, SampleGrid
from .throughput import DiTThroughputMonitor

__all__ = ["DiTThroughputMonitor", "GPUMemoryMonitor", "PredictionWriter", "SampleGrid", "TensorBoardConfigLogger"]
