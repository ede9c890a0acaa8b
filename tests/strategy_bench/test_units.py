"""strategy-bench's pieces that need no ranks: alternation, the memory budget, the timers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest

from dist_harness import run_ranks
from strategy_bench._measure import COLD_SAMPLES, _alternating
from strategy_bench._sweep import budgeted, recommend


def test_cold_and_warm_wraps_alternate_which_goes_first() -> None:
    order = _alternating(6)
    assert order == ["raw", "ours", "ours", "raw", "raw", "ours"]
    assert order.count("raw") == order.count("ours") == 3


def _row(strategy: str, speed: float, allocated: int, reserved: int | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "strategy": strategy,
        "model": "m",
        "knobs": {},
        "samples_per_s": speed,
        "peak_mem_bytes": allocated,
    }
    if reserved is not None:
        row["peak_reserved_bytes"] = reserved
    return row


def test_memory_budget_applies_to_reserved_memory() -> None:
    gib = 2**30
    # DDP allocates 30 GiB but its allocator reserves 44: it does not fit a 40 GiB budget.
    ddp = _row("ddp", 100.0, 30 * gib, 44 * gib)
    fsdp = _row("fsdp", 80.0, 20 * gib, 26 * gib)
    assert budgeted(ddp) == 44 * gib
    assert budgeted(_row("ddp", 1.0, 5, None)) == 5  # schema 1 rows: the allocated peak
    found = recommend([ddp, fsdp], 40 * gib)
    assert found is not None
    section, best, reason = found
    assert best is fsdp and section["strategy"] == "fsdp"
    assert "26624 MiB reserved" in reason
    assert recommend([ddp, fsdp], None) is not None
    assert recommend([ddp, fsdp], 10 * gib) is None


def test_timeout_under_torchrun_ends_the_rank() -> None:
    """Under torchrun no watchdog process exists: each rank's timer ends it."""
    code = textwrap.dedent(
        """
        import os, time
        os.environ["RANK"] = "3"
        from strategy_bench._launch import _exit_after
        _exit_after(0.2)
        time.sleep(30)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert "strategy-bench: timed out (--timeout 0.2 s) on rank 3" in done.stderr


@pytest.mark.multiprocess
def test_each_cold_wrap_gets_a_new_group_that_is_destroyed() -> None:
    from bench_workers import cold_wrap_groups

    for result in run_ranks(cold_wrap_groups, world_size=2):
        assert len(result["made"]) == 2 * COLD_SAMPLES
        assert sorted(result["destroyed"]) == sorted(result["made"])
        assert len(result["cold"]) == COLD_SAMPLES
