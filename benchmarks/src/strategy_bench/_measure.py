"""Measure one configuration (workload x strategy x knobs) on one rank."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import itertools
import statistics
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distributed_strategy import build_replicated_model, derive_seed
from strategy_bench import _wrappers
from strategy_bench._memory import PeakMemory
from strategy_bench._plan import RunOptions
from strategy_bench._timing import time_steps, timed_ms
from strategy_bench._workload import Workload


def measure(
    workload: Workload,
    strategy: str,
    knobs: Mapping[str, Any],
    options: RunOptions,
    device: torch.device,
) -> dict[str, Any]:
    """Everything one rank measures for one configuration; plain values only.

    Replica build time and peak host memory (``source`` local and rank0), wrap time through our
    wrapper and through raw torch on copies of the same module (cold: each on a fresh process
    group; warm: the median of ``wrap_repeats`` alternating wraps on the default group), then
    training-step times and peak memory. Everything it allocated is freed before it returns.
    """
    point = _Point(workload, strategy, knobs, options, device)
    out: dict[str, Any] = {"rank": dist.get_rank()}
    model = _build(point, out)
    _wrap(point, model, out)
    _steps(point, model, out)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


@dataclasses.dataclass(frozen=True)
class _Point:
    """One configuration as one rank measures it."""

    workload: Workload
    strategy: str
    knobs: Mapping[str, Any]
    options: RunOptions
    device: torch.device


def _build(point: _Point, out: dict[str, Any]) -> nn.Module:
    """Build the replica (``local`` and, for its timing, ``rank0``); apply the trainable policy."""
    workload, options, device = point.workload, point.options, point.device
    build: dict[str, Any] = {
        "model_cls": workload.factory,
        "init_params": dict(workload.init_params),
        "device": device,
        "default_dtype": torch.float32,
        "seed": options.seed,
    }
    with PeakMemory(torch.device("cpu")) as host:
        out["init_ms"], built = timed_ms(lambda: build_replicated_model(**build), device)
    out["init_host_peak_bytes"] = host.peak - host.start
    model: nn.Module = built  # type: ignore[assignment]
    with PeakMemory(torch.device("cpu")) as host:
        out["init_rank0_ms"], other = timed_ms(
            lambda: build_replicated_model(**build, source="rank0"), device
        )
    out["init_rank0_host_peak_bytes"] = host.peak - host.start
    del other
    if workload.trainable is not None:
        result = workload.trainable(model)
        model = result if isinstance(result, nn.Module) else model
    out["params"] = sum(p.numel() for p in model.parameters())
    out["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model


def _wrap(point: _Point, model: nn.Module, out: dict[str, Any]) -> None:
    """Time our wrapper against raw torch on copies of ``model``: cold, then warm."""
    strategy, knobs, device = point.strategy, point.knobs, point.device

    def wrap_copy(which: str, *, cold: bool = False) -> float:
        wrap = _wrappers.ours if which == "ours" else _wrappers.raw
        gc.collect()  # the previous wrapper's reference cycles must not be freed in the timing
        fresh = [copy.deepcopy(model)]  # a list, so that the copy is freed with it
        groups: list[dist.ProcessGroup] = []

        def run() -> None:
            if cold:  # the group's setup (NCCL communicator included) is part of a cold wrap
                groups.append(dist.new_group())
            wrap(strategy, fresh.pop(), device, knobs, groups[0] if groups else None)

        try:
            elapsed, _ = timed_ms(run, device)
        finally:
            for group in groups:  # a sweep under torchrun would pile up communicators
                dist.destroy_process_group(group)
        return elapsed

    # Cold: alternating which goes first (raw, ours, ours, raw, ...), each on a new group.
    cold: dict[str, list[float]] = {"ours": [], "raw": []}
    for which in _alternating(2 * COLD_SAMPLES):
        cold[which].append(wrap_copy(which, cold=True))
    out["wrap_cold_ms"] = statistics.median(cold["ours"])
    out["raw_wrap_cold_ms"] = statistics.median(cold["raw"])
    out["wrap_cold_ms_all"] = cold["ours"]
    out["raw_wrap_cold_ms_all"] = cold["raw"]
    warm: dict[str, list[float]] = {"ours": [], "raw": []}
    repeats = 2 * point.options.wrap_repeats
    for which in _alternating(repeats):
        warm[which].append(wrap_copy(which))
    out["wrap_ms"] = statistics.median(warm["ours"])
    out["raw_wrap_ms"] = statistics.median(warm["raw"])
    out["wrap_ms_all"] = warm["ours"]
    out["raw_wrap_ms_all"] = warm["raw"]


COLD_SAMPLES = 3
"""Cold wraps per side and point."""


def _alternating(count: int) -> list[str]:
    """``raw, ours, ours, raw, raw, ours, ...``: each side goes first in every other pair."""
    pairs = [("raw", "ours") if i % 2 == 0 else ("ours", "raw") for i in range(count // 2)]
    return [which for pair in pairs for which in pair]


def _steps(point: _Point, model: nn.Module, out: dict[str, Any]) -> None:
    """Wrap ``model`` with ours and time training steps; record the peak memory."""
    workload, options, device = point.workload, point.options, point.device
    wrapped = _wrappers.ours(point.strategy, model, device, point.knobs)
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator().manual_seed(derive_seed(options.seed, "data", dist.get_rank()))
    batches = [
        workload.make_batch(options.batch_size, device, generator)
        for _ in range(min(4, options.steps + options.warmup))
    ]
    cycle = itertools.cycle(batches)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if options.dtype == "bf16"
        else contextlib.nullcontext()
    )

    def step() -> None:
        with autocast:
            loss = workload.loss(wrapped, next(cycle))
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with PeakMemory(device) as memory:
        out["step_ms"] = time_steps(step, steps=options.steps, warmup=options.warmup, device=device)
    out["peak_mem_bytes"] = memory.peak
    out["peak_reserved_bytes"] = memory.reserved


def measure_peak_flops(device: torch.device, size: int = 8192, repeats: int = 10) -> float | None:
    """Achieved bf16 matmul FLOP/s on this device (the MFU denominator); ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    seconds = float(start.elapsed_time(end)) / 1e3
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * size**3 * repeats / seconds


def warm_up_process(device: torch.device) -> None:
    """Pay the process's one-time costs (imports, first collectives) before anything is timed."""
    probe = nn.Linear(8, 8).to(device)
    for strategy in _wrappers.STRATEGIES:
        wrapped = _wrappers.raw(strategy, copy.deepcopy(probe), device, {})
        wrapped(torch.ones(2, 8, device=device)).sum().backward()
    dist.barrier()
