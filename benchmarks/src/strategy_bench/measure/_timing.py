"""Timing helpers: percentiles, and per-step timers (CUDA events, or barrier-aligned clocks)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

_T = TypeVar("_T")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(values_ms: Sequence[float]) -> dict[str, float]:
    """Median, p10 and p90 of step times in milliseconds."""
    return {
        "median": statistics.median(values_ms),
        "p10": percentile(values_ms, 10),
        "p90": percentile(values_ms, 90),
    }


def time_steps(
    step: Callable[[], None], *, steps: int, warmup: int, device: torch.device
) -> list[float]:
    """Run ``warmup`` untimed then ``steps`` timed calls of ``step``; milliseconds per step.

    On CUDA each step is timed with CUDA events (no host sync inside the loop), after a
    barrier so that every rank starts the loop together. Elsewhere
    every rank meets at a barrier before each step and the step ends at a barrier too, so the
    wall-clock time is the slowest rank's step.
    """
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        events = [
            (
                torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
                torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
            )
            for _ in range(steps)
        ]
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank starts the timed steps together: step 0 absorbs no skew
        torch.cuda.synchronize(device)
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
        return [float(start.elapsed_time(end)) for start, end in events]
    times: list[float] = []
    for _ in range(steps):
        dist.barrier()
        begin = time.perf_counter()
        step()
        dist.barrier()
        times.append((time.perf_counter() - begin) * 1e3)
    return times


def aligned_seconds(
    call: Callable[[], object], *, repeats: int, device: torch.device, calls: int = 1
) -> list[float]:
    """``call``'s seconds on this rank, ``repeats`` times, every rank starting each together.

    Each sample times ``calls`` calls back to back and divides by ``calls`` (as nccl-tests
    does): the host's launch time overlaps the queued work and the ranks' skew at the start is
    paid once per sample, not once per call. Before each sample, a world barrier and (CUDA) a
    device sync, outside the timed region. On CUDA the sample is timed with CUDA events, so no
    host sync sits inside it (one around an NCCL collective adds about its own latency again);
    elsewhere with the host clock (gloo's calls return when they are done).
    """
    if device.type == "cuda":
        events = []
        stream = torch.cuda.current_stream(device)  # what a blocking NCCL call runs on or joins
        for _ in range(repeats):
            dist.barrier()
            torch.cuda.synchronize(device)
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record(stream)
            for _ in range(calls):
                call()
            end.record(stream)
            events.append((start, end))
        torch.cuda.synchronize(device)
        return [float(start.elapsed_time(end)) / 1e3 / calls for start, end in events]
    spent = []
    for _ in range(repeats):
        dist.barrier()
        begin = time.perf_counter()
        for _ in range(calls):
            call()
        spent.append((time.perf_counter() - begin) / calls)
    return spent


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def local_ms(
    fn: Callable[[], object], count: int, *, warmup: int, device: torch.device
) -> list[float]:
    """``fn``'s milliseconds per call on this rank's clock, ``count`` calls after ``warmup``.

    No collective: a rank that fails (out of memory) leaves no other one waiting.
    """
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(count):
        synchronize(device)
        begin = time.perf_counter()
        fn()
        synchronize(device)
        out.append((time.perf_counter() - begin) * 1e3)
    return out


def timed_ms(fn: Callable[[], _T], device: torch.device) -> tuple[float, _T]:
    """Run ``fn`` once between barriers (and CUDA syncs); its wall time in ms and its result."""
    dist.barrier()
    synchronize(device)
    begin = time.perf_counter()
    result = fn()
    synchronize(device)
    elapsed = (time.perf_counter() - begin) * 1e3
    dist.barrier()
    return elapsed, result
