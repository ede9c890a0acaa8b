"""The estimate past this machine: fake process groups, peaks, fits, the largest model."""

from __future__ import annotations

from strategy_bench.estimate._agreement import AGREEMENT, agreement, step_errors
from strategy_bench.estimate._choice import ACCUMULATION_STEPS, accumulation_points, recommendations
from strategy_bench.estimate._cost import (
    COST_FIELDS,
    check_train_tokens,
    training_cost,
    training_plan,
)
from strategy_bench.estimate._estimate import (
    SCHEMA,
    estimate_environment,
    peak_rss_bytes,
    run_estimate,
    spawn_pool,
)
from strategy_bench.estimate._failures import (
    DEFAULT_CHECKPOINT_EVERY_S,
    DEFAULT_HEAL_S,
    DEFAULT_RESTART_S,
    FAILURE_FIELDS,
    check_failure_args,
    failure_cost,
    replica_groups,
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
from strategy_bench.estimate._points import (
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_WORLD_SIZES,
    EstimateOptions,
    estimate_points,
    hsdp_degrees,
)
from strategy_bench.estimate._time_inputs import (
    DATASHEET_MFU,
    DEFAULT_ASSUMED_MFU,
    DEFAULT_INTER_NODE_GBPS,
    TimeModel,
    calibrated_model,
    datasheet_model,
)
from strategy_bench.estimate._time_model import BUCKET_CAPS_MB, annotate_time, predict

__all__ = [
    "ACCUMULATION_STEPS",
    "AGREEMENT",
    "BUCKET_CAPS_MB",
    "COST_FIELDS",
    "DATASHEET_MEMORY_GIB",
    "DATASHEET_MFU",
    "DEFAULT_ASSUMED_MFU",
    "DEFAULT_CHECKPOINT_EVERY_S",
    "DEFAULT_GPUS_PER_NODE",
    "DEFAULT_HEAL_S",
    "DEFAULT_INTER_NODE_GBPS",
    "DEFAULT_RESTART_S",
    "DEFAULT_WORLD_SIZES",
    "DEVICE_RESERVE_BYTES",
    "FAILURE_FIELDS",
    "PRESET_SCALE_PARAM",
    "SCHEMA",
    "DeviceMemory",
    "EstimateOptions",
    "ModelSizes",
    "TimeModel",
    "accumulation_points",
    "agreement",
    "annotate_fits",
    "annotate_time",
    "calibrated_model",
    "check_failure_args",
    "check_train_tokens",
    "datasheet_model",
    "device_memory",
    "estimate_environment",
    "estimate_points",
    "failure_cost",
    "hsdp_degrees",
    "init_peaks",
    "largest_lines",
    "peak_rss_bytes",
    "predict",
    "recommendations",
    "replica_groups",
    "run_estimate",
    "scale_start",
    "spawn_pool",
    "step_errors",
    "training_cost",
    "training_plan",
]
