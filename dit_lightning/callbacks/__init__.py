"""Lightning callbacks: sample grids (and, with the monitoring issue, memory and throughput)."""

from .samples import SampleGrid

__all__ = ["SampleGrid"]
