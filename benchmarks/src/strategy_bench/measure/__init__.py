"""Measuring one point: build, wrap, steps, accounting, FLOPs, memory, timing, checkpoints."""

from __future__ import annotations

from strategy_bench.measure._accounting import (
    account,
    autocast,
    ddp_bucket_bytes,
    dtype_name,
    local_bytes,
    parameter_counts,
    saved_activation_bytes,
)
from strategy_bench.measure._flops import (
    count_step_flops,
    datasheet_peak,
    measure_matmul_flops,
    peak_flops,
)
from strategy_bench.measure._memory import memory_reached
from strategy_bench.measure._options import RunOptions
from strategy_bench.measure._point import measure, warm_up_process
from strategy_bench.measure._timing import summarize
from strategy_bench.measure._wrappers import HSDP_MIN_WORLD, STRATEGIES, hsdp_shape

__all__ = [
    "HSDP_MIN_WORLD",
    "STRATEGIES",
    "RunOptions",
    "account",
    "autocast",
    "count_step_flops",
    "datasheet_peak",
    "ddp_bucket_bytes",
    "dtype_name",
    "hsdp_shape",
    "local_bytes",
    "measure",
    "measure_matmul_flops",
    "memory_reached",
    "parameter_counts",
    "peak_flops",
    "saved_activation_bytes",
    "summarize",
    "warm_up_process",
]
