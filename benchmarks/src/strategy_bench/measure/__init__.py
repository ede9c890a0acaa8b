"""Measuring one point: build, wrap, steps, accounting, FLOPs, memory, timing, checkpoints."""

from __future__ import annotations

from strategy_bench.measure._accounting import (
    account,
    autocast,
    ddp_bucket_bytes,
    local_bytes,
    parameter_counts,
    saved_activation_bytes,
)
from strategy_bench.measure._comm import dtype_name
from strategy_bench.measure._flops import (
    count_step_flops,
    datasheet_peak,
    fake_flops_per_sample,
    measure_matmul_flops,
    peak_flops,
)
from strategy_bench.measure._memory import memory_reached
from strategy_bench.measure._options import RunOptions
from strategy_bench.measure._point import measure, warm_up_process
from strategy_bench.measure._probe import (
    PROBE_KINDS,
    PROBE_MIB,
    bus_factor,
    collective_seconds,
    fit_link,
    probe_links,
)
from strategy_bench.measure._timing import summarize
from strategy_bench.measure._wrappers import HSDP_MIN_WORLD, STRATEGIES, hsdp_shape

__all__ = [
    "HSDP_MIN_WORLD",
    "PROBE_KINDS",
    "PROBE_MIB",
    "STRATEGIES",
    "RunOptions",
    "account",
    "autocast",
    "bus_factor",
    "collective_seconds",
    "count_step_flops",
    "datasheet_peak",
    "ddp_bucket_bytes",
    "dtype_name",
    "fake_flops_per_sample",
    "fit_link",
    "hsdp_shape",
    "local_bytes",
    "measure",
    "measure_matmul_flops",
    "memory_reached",
    "parameter_counts",
    "peak_flops",
    "probe_links",
    "saved_activation_bytes",
    "summarize",
    "warm_up_process",
]
