"""A results row's vocabulary: its status, its point's key and knobs, a failed point's row."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

_Row = TypeVar("_Row", bound=Mapping[str, Any])

OK = "ok"
OOM = "oom"
FAILED = "failed"


def point_key(point: Mapping[str, Any]) -> tuple[str, str, str]:
    """What identifies a point in a run: model, strategy and knobs."""
    knobs = json.dumps(dict(point.get("knobs", {})), sort_keys=True)
    return str(point["model"]), str(point["strategy"]), knobs


def done_keys(rows: Iterable[Mapping[str, Any]]) -> set[tuple[str, str, str]]:
    """The points that ``rows`` measured or recorded a failure for."""
    return {point_key(row) for row in rows}


def ok_rows(rows: Iterable[_Row]) -> list[_Row]:
    """The rows of points that were measured (schema 1 rows have no status: all measured)."""
    return [row for row in rows if row.get("status", OK) == OK]


def failure_row(
    point: Mapping[str, Any],
    *,
    env: Mapping[str, Any],
    world_size: int,
    report: Mapping[str, Any],
) -> dict[str, Any]:
    """The row of a point whose ranks failed: what failed, and the memory it had reached.

    Args:
        point: ``{"model", "strategy", "knobs"}``.
        env: The run's environment.
        world_size: Ranks of the point.
        report: The failing rank's report: ``rank``, ``oom``, ``error`` (its last line),
            ``memory_bytes``.
    """
    return {
        "model": point["model"],
        "strategy": point["strategy"],
        "knobs": dict(point.get("knobs", {})),
        "world_size": world_size,
        "backend": env.get("backend"),
        "device": env.get("device"),
        "status": OOM if report.get("oom") else FAILED,
        "error": report.get("error"),
        "failed_rank": report.get("rank"),
        "peak_mem_bytes": report.get("memory_bytes"),
    }


def knob_text(knobs: Mapping[str, Any] | None, sep: str = ",") -> str:
    """``"bucket_cap_mb=1,static_graph=True"``; empty for a point at its defaults."""
    return sep.join(f"{k}={v}" for k, v in (knobs or {}).items())


def describe_failure(row: Mapping[str, Any]) -> str:
    """``"ddp large: out of memory at 74.0 GiB"`` or ``"... failed: <error>"``."""
    name = f"{row['strategy']} {row['model']}"
    if row.get("knobs"):
        name += " " + knob_text(row["knobs"])
    memory = row.get("peak_mem_bytes")
    reached = "" if not memory else f" at {memory / 2**30:.1f} GiB"
    if row.get("status") == OOM:
        return f"{name}: out of memory{reached} (rank {row.get('failed_rank')})"
    return f"{name}: failed{reached} (rank {row.get('failed_rank')}): {row.get('error')}"


def describe_skipped(point: Mapping[str, Any]) -> str:
    """``"fsdp tiny compile=True (torch.compile does not work on cpu: ...)"``."""
    name = f"{point['strategy']} {point['model']}"
    if point.get("knobs"):
        name += " " + knob_text(point["knobs"])
    return f"{name} ({point.get('reason', 'time budget')})"
