"""Rank functions for strategy-bench's tests that look inside one measurement."""

from __future__ import annotations

import gc
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from strategy_bench.measure import RunOptions
from strategy_bench.measure import _point as _measure
from strategy_bench.workload import BenchTransformer, preset_workload


def cold_wrap_groups(rank: int, world_size: int) -> dict[str, Any]:
    """Measure one FSDP point; report the groups made and destroyed (a spy), what the point
    recorded after its cold wraps (its steps and checkpoint ran on DTensors), and how many
    sharded models were alive when the step's memory measurement began (only the step's own:
    the 2 * COLD_SAMPLES + 2 wrap copies must be freed, not counted in its peak)."""
    made: list[int] = []
    destroyed: list[int] = []
    new_group, destroy = dist.new_group, dist.destroy_process_group

    def spy_new_group(*args: Any, **kwargs: Any) -> Any:
        group = new_group(*args, **kwargs)
        # checkpoint-io's background-save group lives as long as the default group (not a
        # wrap's): only the bench's own groups are counted.
        if not sys._getframe(1).f_globals["__name__"].startswith("checkpoint_io"):
            made.append(id(group))
        return group

    def spy_destroy(group: Any = None) -> None:
        destroyed.append(id(group))
        destroy(group)

    live_at_step: list[int] = []
    peak_memory = _measure.PeakMemory

    class SpyPeakMemory(peak_memory):  # type: ignore[misc,valid-type]
        """Counts the sharded models alive when the step's memory measurement starts."""

        def __enter__(self) -> Any:
            live_at_step.append(
                sum(
                    isinstance(o, FSDPModule) and isinstance(o, BenchTransformer)
                    for o in gc.get_objects()
                )
            )
            return super().__enter__()

    dist.new_group, dist.destroy_process_group = spy_new_group, spy_destroy  # type: ignore[assignment]
    _measure.PeakMemory = SpyPeakMemory  # type: ignore[misc]
    try:
        options = RunOptions(steps=1, warmup=0, batch_size=2, wrap_repeats=1)
        out = _measure.measure(preset_workload("tiny"), "fsdp", {}, options, torch.device("cpu"))
    finally:
        dist.new_group, dist.destroy_process_group = new_group, destroy  # type: ignore[assignment]
        _measure.PeakMemory = peak_memory  # type: ignore[misc]
    return {
        "made": made,
        "destroyed": destroyed,
        "cold": out["wrap_cold_ms_all"],
        "ckpt_bytes": out["ckpt_bytes"],
        "live_at_step": live_at_step,
    }


def checkpoint_cost_cases(rank: int, world_size: int) -> dict[str, Any]:
    """The checkpoint cost of a small model: normal (one checkpoint on disk at a time), with
    too little free disk (skipped, with the reason) and with a save that fails (recorded)."""
    import os
    from pathlib import Path

    from strategy_bench.measure import _ckpt

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    results: dict[str, Any] = {"seen_at_ours": [], "order": []}
    save, raw_save = _ckpt.save_checkpoint, _ckpt.dcp_save

    def spy_save(path: Any, *args: Any, **kwargs: Any) -> Any:
        results["seen_at_ours"].append(sorted(os.listdir(Path(path).parent)))
        results["order"].append("ours")
        return save(path, *args, **kwargs)

    def spy_raw_save(*args: Any, **kwargs: Any) -> Any:
        results["order"].append("raw")
        return raw_save(*args, **kwargs)

    def failing_save(path: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    cpu = torch.device("cpu")
    _ckpt.dcp_save = spy_raw_save  # type: ignore[assignment]
    try:
        for raw_first in (True, False):
            _ckpt.save_checkpoint = spy_save  # type: ignore[assignment]
            out: dict[str, Any] = {}
            _ckpt.checkpoint_cost(model, optimizer, cpu, raw_first=raw_first, out=out)
            results[f"normal_{raw_first}"] = out
        _ckpt.save_checkpoint = failing_save  # type: ignore[assignment]
        failed: dict[str, Any] = {}
        _ckpt.checkpoint_cost(model, optimizer, cpu, raw_first=True, out=failed)
        results["failed"] = failed
        _ckpt.save_checkpoint = save  # type: ignore[assignment]
        factor, _ckpt.DISK_FACTOR = _ckpt.DISK_FACTOR, 1e15
        small_disk: dict[str, Any] = {}
        _ckpt.checkpoint_cost(model, optimizer, cpu, raw_first=True, out=small_disk)
        _ckpt.DISK_FACTOR = factor
        results["small_disk"] = small_disk
    finally:
        _ckpt.save_checkpoint, _ckpt.dcp_save = save, raw_save  # type: ignore[assignment]
    return results


def probe_two_nodes(rank: int, world_size: int) -> dict[str, Any]:
    """The communication probe as 2 pretend nodes of ``world_size // 2`` ranks see it."""
    import os

    import torch

    from strategy_bench.measure import probe_links

    os.environ["LOCAL_WORLD_SIZE"] = str(world_size // 2)
    found = probe_links(torch.device("cpu"), (0.0625, 4.0))
    assert found is not None
    return found
