"""The estimate past this machine: fake process groups, peaks, fits, the largest model."""

from __future__ import annotations

from strategy_bench.estimate._estimate import (
    AGREEMENT,
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_WORLD_SIZES,
    SCHEMA,
    EstimateOptions,
    agreement,
    estimate_environment,
    estimate_points,
    peak_rss_bytes,
    run_estimate,
)
from strategy_bench.estimate._fits import (
    DATASHEET_MEMORY_GIB,
    DEVICE_RESERVE_BYTES,
    DeviceMemory,
    annotate_fits,
    device_memory,
)
from strategy_bench.estimate._init_peak import ModelSizes, init_peaks
from strategy_bench.estimate._largest import PRESET_SCALE_PARAM, largest_lines, scale_start

__all__ = [
    "AGREEMENT",
    "DATASHEET_MEMORY_GIB",
    "DEFAULT_GPUS_PER_NODE",
    "DEFAULT_WORLD_SIZES",
    "DEVICE_RESERVE_BYTES",
    "PRESET_SCALE_PARAM",
    "SCHEMA",
    "DeviceMemory",
    "EstimateOptions",
    "ModelSizes",
    "agreement",
    "annotate_fits",
    "device_memory",
    "estimate_environment",
    "estimate_points",
    "init_peaks",
    "largest_lines",
    "peak_rss_bytes",
    "run_estimate",
    "scale_start",
]
