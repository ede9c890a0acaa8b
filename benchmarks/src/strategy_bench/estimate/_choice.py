"""The estimate's recommendation: per model and world size, the fastest point that fits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from strategy_bench.estimate._points import EstimatePoint
from strategy_bench.estimate._time_model import DEFAULT_BUCKET_CAP_MB
from strategy_bench.results import ok_rows

ACCUMULATION_STEPS = (2, 4, 8)
"""Micro-batches per step tried, at the same global batch, for a point that does not fit."""


def candidates(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The choices one row offers: itself, and for DDP each predicted ``bucket_cap_mb``."""
    out = [
        {
            "strategy": row["strategy"],
            "knobs": dict(row["knobs"]),
            "predicted_step_ms": row["predicted_step_ms"],
            "predicted_samples_per_s": row["predicted_samples_per_s"],
        }
    ]
    if row["strategy"] != "ddp" or "bucket_cap_mb" in row["knobs"]:
        return out
    samples = row["predicted_samples_per_s"] * row["predicted_step_ms"]
    for cap, step in (row.get("predicted_by_bucket_ms") or {}).items():
        if float(cap) == DEFAULT_BUCKET_CAP_MB:
            continue
        knobs = {**row["knobs"], "bucket_cap_mb": float(cap)}
        out.append(
            {
                "strategy": "ddp",
                "knobs": knobs,
                "predicted_step_ms": step,
                "predicted_samples_per_s": samples / step,
            }
        )
    return out


def accumulation_points(
    rows: Sequence[Mapping[str, Any]], batch_size: int, models: Sequence[str]
) -> dict[int, list[EstimatePoint]]:
    """The points to estimate again with accumulation, by micro-batches per step.

    Each row that does not fit (``fits: False``) and accumulates nothing yet, with
    ``grad_accum=k`` for every ``k`` of :data:`ACCUMULATION_STEPS` that divides
    ``batch_size``: ``k`` micro-batches of ``batch_size / k``, the same samples per step.
    """
    out: dict[int, list[EstimatePoint]] = {}
    for row in ok_rows(rows):
        if row.get("fits", True) or "grad_accum" in row["knobs"] or row["model"] not in models:
            continue
        for steps in ACCUMULATION_STEPS:
            if batch_size % steps == 0:
                knobs = {**row["knobs"], "grad_accum": steps}
                index, world = models.index(row["model"]), int(row["world_size"])
                point = EstimatePoint(index, row["strategy"], knobs, world)
                out.setdefault(steps, []).append(point)
    return out


def recommendations(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per model and world size, the point with the most predicted samples/s that fits.

    Rows with ``fits: False`` (a device was given) never compete. The runner-up is the
    fastest choice of another strategy (else the next choice); ``margin`` is how much faster
    the recommendation is (``0.25``: 25% more samples/s).

    Returns:
        ``model``, ``world_size``, ``strategy``, ``knobs``, ``predicted_step_ms``,
        ``predicted_samples_per_s``, ``runner_up`` (or ``None``), ``margin`` (or ``None``),
        ``candidates`` (how many competed); a world size where nothing fits gets
        ``strategy: None``.
    """
    timed = [row for row in ok_rows(rows) if row.get("predicted_step_ms")]
    keys = list(dict.fromkeys((row["model"], row["world_size"]) for row in timed))
    out = []
    for model, world in keys:
        mine = [row for row in timed if (row["model"], row["world_size"]) == (model, world)]
        fitting = [row for row in mine if row.get("fits", True)]
        choices = sorted(
            (choice for row in fitting for choice in candidates(row)),
            key=lambda choice: -choice["predicted_samples_per_s"],
        )
        entry: dict[str, Any] = {
            "model": model,
            "world_size": world,
            "batch_size": mine[0].get("batch_size"),
            "dtype": mine[0].get("dtype"),
            "tokens_per_sample": mine[0].get("tokens_per_sample"),
            "candidates": len(choices),
        }
        if not choices:
            out.append({**entry, "strategy": None, "knobs": {}, "predicted_step_ms": None})
            continue
        best = choices[0]
        others = [c for c in choices[1:] if c["strategy"] != best["strategy"]] or choices[1:]
        runner = others[0] if others else None
        margin = None
        if runner is not None:
            margin = best["predicted_samples_per_s"] / runner["predicted_samples_per_s"] - 1
        out.append({**entry, **best, "runner_up": runner, "margin": margin})
    return out
