"""The estimate against ``run``'s measurements, point by point."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from strategy_bench.results import ok_rows
from strategy_bench.workload import knob_key

AGREEMENT = {"static": 0.05, "activation": 0.20, "comm": 0.01, "peak": 0.10}
"""How close an estimate must be to ``run``'s measurement (relative): static bytes
(parameters, gradients, optimizer state), the activation peak, communication bytes, and the
step's peak (the estimate's ``peak_bytes`` against the run's ``tracked_peak_bytes``; runs
recorded before it lack the latter and are not checked on it)."""


def agreement(
    estimated: Sequence[Mapping[str, Any]], measured: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Estimate against ``run`` for every point both have (model, strategy, knobs, ranks).

    Returns:
        One row per matched point: the estimated and measured static, activation and
        communication bytes, each relative error, and ``ok`` when all are within
        :data:`AGREEMENT`; with a time model, ``step_predicted_ms``, ``step_measured_ms``
        (the run's median) and the signed ``step_error`` (not part of ``ok``: a time).
    """
    by_point = {_match_key(row): row for row in ok_rows(measured)}
    rows = []
    for row in ok_rows(estimated):
        other = by_point.get(_match_key(row))
        if other is None:
            continue
        pairs = {
            "static": (_static(row), _static(other)),
            "activation": (row["activation_peak_bytes"], other["activation_peak_bytes"]),
            "comm": (comm_total(row), comm_total(other)),
        }
        if other.get("tracked_peak_bytes") is not None and row.get("peak_bytes") is not None:
            pairs["peak"] = (row["peak_bytes"], other["tracked_peak_bytes"])
        entry: dict[str, Any] = {
            "model": row["model"],
            "strategy": row["strategy"],
            "knobs": dict(row["knobs"]),
            "world_size": row["world_size"],
        }
        ok = True
        for kind, (mine, theirs) in pairs.items():
            error = abs(mine - theirs) / theirs if theirs else float(mine != theirs)
            entry[f"{kind}_estimated"] = mine
            entry[f"{kind}_measured"] = theirs
            entry[f"{kind}_error"] = error
            ok = ok and error <= AGREEMENT[kind]
        entry["ok"] = ok
        if row.get("predicted_step_ms") and other.get("step_ms_median"):
            entry["step_predicted_ms"] = row["predicted_step_ms"]
            entry["step_measured_ms"] = other["step_ms_median"]
            entry["step_error"] = row["predicted_step_ms"] / other["step_ms_median"] - 1
        rows.append(entry)
    return rows


def step_errors(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The agreement's step-time errors: ``median_abs``, ``max_abs`` and ``points``."""
    errors = [abs(row["step_error"]) for row in rows if row.get("step_error") is not None]
    if not errors:
        return None
    return {"median_abs": statistics.median(errors), "max_abs": max(errors), "points": len(errors)}


def _match_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    knobs = knob_key(row.get("knobs") or {})
    return (
        row["model"],
        row["strategy"],
        knobs,
        row["world_size"],
        row.get("batch_size"),
        row.get("dtype"),
    )


def _static(row: Mapping[str, Any]) -> int:
    return int(row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"])  # as run did


def comm_total(row: Mapping[str, Any]) -> int:
    """The bytes a row's collectives move per step, every kind together."""
    return int(sum(dict(row.get("comm_bytes_per_step") or {}).values()))
