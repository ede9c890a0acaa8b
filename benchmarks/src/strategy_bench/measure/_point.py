"""Measure one configuration (workload x strategy x knobs) on one rank."""

from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import logging
import statistics
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_core import MemoryPeak
from distributed_strategy import build_replicated_model, derive_seed
from replica_init import build_sharded_model
from strategy_bench.measure import _wrappers
from strategy_bench.measure._accounting import (
    account,
    accumulate,
    autocast,
    host_state_bytes,
    parameter_counts,
)
from strategy_bench.measure._ckpt import checkpoint_cost
from strategy_bench.measure._flops import count_step_flops, fake_flops_per_sample
from strategy_bench.measure._memory import PeakMemory
from strategy_bench.measure._options import RunOptions
from strategy_bench.measure._timing import local_ms, time_steps, timed_ms
from strategy_bench.workload import (
    Workload,
    compile_backend,
    compute_dtype,
    micro_steps,
    needs_compiler,
    offloads,
    prepare_blocks,
    syncs_every_micro_step,
    training_optimizer,
)

logger = logging.getLogger(__name__)


def measure(
    workload: Workload,
    strategy: str,
    knobs: Mapping[str, Any],
    options: RunOptions,
    device: torch.device,
    index: int = 0,
) -> dict[str, Any]:
    """Everything one rank measures for one configuration; plain values only.

    Replica build time and peak host memory (``source`` local and rank0), wrap time through our
    wrapper and through raw torch on copies of the same module (cold: each on a fresh process
    group; warm: the median of ``wrap_repeats`` alternating wraps on the default group), then
    training-step times and peak memory. Everything it allocated is freed before it returns.
    """
    point = _Point(workload, strategy, knobs, options, device, index)
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
    index: int = 0


def _build(point: _Point, out: dict[str, Any]) -> nn.Module:
    """Build the model where the pipeline starts from; time both sources; count the FLOPs.

    DDP (the seed's path): a full replica on the device, ``source`` local and rank0. FSDP
    never holds the whole model on the device: the model the point goes on with is the host
    copy that ``source="local"`` builds on every rank (fsdp-wrap moves it unit by unit), and
    ``source="rank0"`` is timed as the pipeline runs it (rank 0 builds on the host, the others
    on meta, everyone shards, rank 0's tensors are streamed into the shards). Each source's
    host (RSS growth) and device (allocator growth, CUDA) peaks are recorded.
    """
    workload, options, device = point.workload, point.options, point.device
    sharded = point.strategy in _wrappers.SHARDED
    build: dict[str, Any] = {
        "model_cls": workload.factory,
        "init_params": dict(workload.init_params),
        "device": torch.device("cpu") if sharded else device,
        "default_dtype": torch.float32,
        "seed": options.seed,
    }
    with MemoryPeak(device) as peak:
        out["init_ms"], built = timed_ms(lambda: build_replicated_model(**build), device)
    _record_init(out, "init", peak, device)
    model: nn.Module = built
    if dist.get_world_size() > 1:  # at one rank, rank 0's build is the local build
        with MemoryPeak(device) as peak:
            out["init_rank0_ms"], other = timed_ms(lambda: _build_rank0(point, build), device)
        _record_init(out, "init_rank0", peak, device)
        del other
        gc.collect()
    model = workload.with_trainable(model)
    counted: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(counted, _count_flops(point))  # model FLOPs: no recompute
    # Every rank takes the same path: the wrapped step's count (a collective) if any failed.
    out["flops_per_sample"] = None if None in counted else counted[0]
    prepare_blocks(model, point.knobs)
    out.update(parameter_counts(model))
    return model


def _build_rank0(point: _Point, build: dict[str, Any]) -> nn.Module:
    if point.strategy not in _wrappers.SHARDED:
        return build_replicated_model(**build, source="rank0")
    device = point.device

    def shard(model: nn.Module) -> nn.Module:
        return _wrappers.ours(point.strategy, model, device, point.knobs)

    built = build_sharded_model(
        **{**build, "device": device},
        shard=shard,
        source="rank0",
        trainable=point.workload.with_trainable,
        verify=False,
    )
    return built.module


def _record_init(out: dict[str, Any], prefix: str, peak: MemoryPeak, device: torch.device) -> None:
    out[f"{prefix}_host_peak_bytes"] = peak.host_growth
    out[f"{prefix}_device_peak_bytes"] = peak.device_growth if device.type == "cuda" else None


def _count_flops(point: _Point) -> float | None:
    """Training FLOPs per sample on fake tensors (:func:`fake_flops_per_sample`)."""
    options = point.options
    return fake_flops_per_sample(point.workload, options.batch_size, options.dtype, options.seed)


_CPU = torch.device("cpu")


def _wrap(point: _Point, model: nn.Module, out: dict[str, Any]) -> None:
    """Time our wrapper against raw torch on copies of ``model``: cold, then warm.

    Each cold wrap creates new process groups inside its timing and destroys them right
    after its wrap (with the wrapped copy): an NCCL communicator per group, up to 6 per point
    and 2 more per HSDP cold wrap, would otherwise hold buffers outside every peak figure
    through the timed steps and the checkpoint cost.
    """
    strategy, knobs, device = point.strategy, point.knobs, point.device

    def wrap_copy(which: str, *, cold: bool = False) -> float:
        wrap = _wrappers.ours if which == "ours" else _wrappers.raw
        gc.collect()  # the previous wrapper's reference cycles must not be freed in the timing
        fresh = [copy.deepcopy(model)]  # a list, so that the copy is freed with it

        made: list[dist.ProcessGroup] = []

        def run() -> None:
            group = None
            if cold:  # the group's setup (NCCL communicator included) is part of a cold wrap
                group = dist.new_group()
                made.append(group)
            wrap(strategy, fresh.pop(), device, knobs, group, made=made)

        try:
            elapsed, _ = timed_ms(run, device)
        finally:
            gc.collect()  # the wrapped copy (FSDP's in reference cycles) before its groups
            for group in made:
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
    """Wrap ``model`` with ours and time training steps; record the peak memory.

    A step is one optimizer step: ``grad_accum`` micro-batches, all but the last under
    grad-sync's ``no_sync``, each loss scaled by ``1 / grad_accum``.
    """
    workload, options, device = point.workload, point.options, point.device
    # The build's and the wrap copies' memory must not count in the step's peaks: the copies
    # (FSDP's in reference cycles) are collected and the allocator's cache is returned.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    micro = micro_steps(point.knobs)
    every = syncs_every_micro_step(point.knobs)
    compute = autocast(compute_dtype(point.strategy, point.knobs, options.dtype), device)
    out.update(_compute_only(point, model))
    wrapped = _wrappers.ours(point.strategy, model, device, point.knobs)
    optimizer = training_optimizer(wrapped.parameters())
    cycle = itertools.cycle(_batches(point))

    def step() -> None:
        accumulate(
            wrapped, workload.loss, [next(cycle) for _ in range(micro)], compute, sync_every=every
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if compile_backend(point.knobs) is not None:  # the compile is paid at the first step
        out["first_step_ms"] = timed_ms(step, device)[0]
    if out.get("flops_per_sample") is None:  # not countable on fake tensors: the real step
        out["flops_per_sample"] = count_step_flops(step) / (options.batch_size * micro)

    with PeakMemory(device) as memory:
        out["step_ms"] = time_steps(step, steps=options.steps, warmup=options.warmup, device=device)
    out["peak_mem_bytes"] = memory.peak
    out["peak_reserved_bytes"] = memory.reserved
    if offloads(point.strategy, point.knobs):
        out["host_bytes"] = host_state_bytes(wrapped, optimizer)
    batch = [next(cycle) for _ in range(micro)]
    if device.type == "cuda":  # on a GPU the allocator's growth over the step is the figure
        with PeakMemory(device) as tracked:
            out.update(account(wrapped, optimizer, workload.loss, batch, compute, sync_every=every))
        # What the step started from, as the tracker counts it (held tensors, DDP's buckets),
        # plus the allocator's growth: not the cuBLAS workspace or cached batches allocated
        # before the step, which no estimate of tensors holds.
        out["allocator_peak_bytes"] = tracked.peak
        out["tracked_peak_bytes"] = out["tracked_entry_bytes"] + tracked.peak - tracked.start
    else:
        out.update(account(wrapped, optimizer, workload.loss, batch, compute, sync_every=every))
    if point.options.ckpt_samples > 0:
        checkpoint_cost(
            wrapped,
            optimizer,
            device,
            raw_first=point.index % 2 == 0,
            out=out,
            samples=point.options.ckpt_samples,
        )


def _batches(point: _Point) -> list[Any]:
    """The step's batches, the same on every call: a few, cycled through."""
    options, micro = point.options, micro_steps(point.knobs)
    generator = torch.Generator().manual_seed(derive_seed(options.seed, "data", dist.get_rank()))
    return [
        point.workload.make_batch(options.batch_size, point.device, generator)
        for _ in range(min(4, (options.steps + options.warmup) * micro))
    ]


def _compute_only(point: _Point, model: nn.Module) -> dict[str, float | None]:
    """``compute_ms`` and ``optimizer_ms``: the step with communication and wrapper removed.

    The same micro-batches, dtype and optimizer on an unwrapped copy of this rank's model:
    forward, backward and the optimizer step, no collective (the time model's compute part),
    each rank on its own clock. ``optimizer_ms`` is the optimizer step alone, which a sharded
    rank runs over its shard only. Both are ``None`` on every rank when any rank could not
    run the whole model: on a GPU the copy must fit beside what the device holds (parameters,
    gradients and two AdamW moments, half as much again for the step), and a model that fits
    only sharded runs out of memory; compiled blocks are not copied.
    """
    device = point.device
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    times: dict[str, float | None] = {"compute_ms": None, "optimizer_ms": None}
    fits = device.type != "cuda" or 6 * size < torch.cuda.mem_get_info(device)[0]
    if fits and not needs_compiler(point.knobs):
        try:
            times = _time_unwrapped(point, _copy_to(model, device))
        except torch.OutOfMemoryError:
            logger.info("compute_ms: the unwrapped model does not fit this rank's device")
        except Exception:  # whatever it is, every rank must still reach the agreement below
            logger.warning("compute_ms: the unwrapped step failed", exc_info=True)
        gc.collect()  # the copy, its gradients and optimizer state
        if device.type == "cuda":
            torch.cuda.empty_cache()
    every: list[bool] = [False] * dist.get_world_size()
    dist.all_gather_object(every, times["compute_ms"] is not None)
    return times if all(every) else {"compute_ms": None, "optimizer_ms": None}


def _copy_to(model: nn.Module, device: torch.device) -> nn.Module:
    """A deep copy of ``model`` whose tensors are made on ``device`` directly.

    A sharded point's model is the whole host copy: a deep copy then ``.to`` would hold the
    model twice on the host, per rank. Tied tensors stay tied (one memo entry each).
    """
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.device != device and id(tensor) not in memo:
            moved = tensor.detach().to(device)
            if isinstance(tensor, nn.Parameter):
                moved = nn.Parameter(moved, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = moved
    return copy.deepcopy(model, memo)


def _time_unwrapped(point: _Point, replica: nn.Module) -> dict[str, float | None]:
    device, options = point.device, point.options
    optimizer = training_optimizer(replica.parameters())
    cycle = itertools.cycle(_batches(point))
    micro = micro_steps(point.knobs)
    # The point's own compute dtype: a bf16-parameter point's FSDP step computes in bf16.
    compute = autocast(compute_dtype(None, point.knobs, options.dtype), device)

    def backward() -> None:
        accumulate(replica, point.workload.loss, [next(cycle) for _ in range(micro)], compute)

    def step() -> None:
        backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    count = max(3, options.steps // 2)
    steps = local_ms(step, count, warmup=1, device=device)
    backward()  # gradients for the optimizer alone
    alone = local_ms(optimizer.step, count, warmup=0, device=device)
    return {"compute_ms": statistics.median(steps), "optimizer_ms": statistics.median(alone)}


def warm_up_process(device: torch.device) -> None:
    """Pay the process's one-time costs (imports, first collectives) before anything is timed.

    Then freeze what the process holds so far (``gc.freeze``): every wrap is preceded by a
    full collection, so that no earlier wrapper is freed inside a timing, and a collection
    that walks only what the run created since costs a few ms instead of ~130 ms here.
    """
    probe = nn.Linear(8, 8).to(device)
    for strategy in ("ddp", "fsdp"):  # HSDP's collectives are FSDP's, on subgroups
        wrapped = _wrappers.raw(strategy, copy.deepcopy(probe), device, {})
        wrapped(torch.ones(2, 8, device=device)).sum().backward()
    del wrapped, probe
    gc.collect()
    gc.freeze()
    dist.barrier()
