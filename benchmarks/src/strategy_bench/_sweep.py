"""The strategy-knob sweep: which points, in which order, and the recommendation."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from distributed_strategy import DistributedConfig
from strategy_bench._errors import BenchUsageError
from strategy_bench._kept import knob_text, ok_rows
from strategy_bench._knobs import step_knobs, wrap_knobs
from strategy_bench._plan import Config

DDP_BUCKETS_MB = (1, 25, 100)
GRAD_ACCUM = 4
"""Micro-batches per optimizer step at the sweep's gradient-accumulation points."""


def sweep_points(bf16: bool, hsdp: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """The sweep's points, most informative first.

    First each strategy at its defaults (the DDP-vs-FSDP answer; HSDP too when ``hsdp``: a
    world of at least 4 ranks), then the knobs that move
    step time or memory the most (FSDP resharding and mixed precision, DDP's bucket views),
    then DDP bucket sizes and static graph, then combinations. Each point changes the
    defaults one knob at a time, so every difference has one cause.
    """
    points: list[tuple[str, dict[str, Any]]] = [
        ("ddp", {}),
        ("fsdp", {}),
        *([("hsdp", {})] if hsdp else []),
        ("fsdp", {"reshard_after_forward": False}),
    ]
    if bf16:
        points.append(("fsdp", {"param_dtype": "bf16", "reduce_dtype": "fp32"}))
    points += [
        ("fsdp", {"activation_checkpointing": True}),
        ("ddp", {"compile": True}),
        ("fsdp", {"compile": True}),
        ("ddp", {"grad_accum": GRAD_ACCUM}),
        ("fsdp", {"grad_accum": GRAD_ACCUM}),
        ("ddp", {"activation_checkpointing": True}),
        ("ddp", {"gradient_as_bucket_view": True}),
        *[("ddp", {"bucket_cap_mb": mb}) for mb in DDP_BUCKETS_MB if mb != 25],
        ("ddp", {"static_graph": True}),
        ("ddp", {"gradient_as_bucket_view": True, "static_graph": True}),
    ]
    if bf16:
        points.append(
            (
                "fsdp",
                {"reshard_after_forward": False, "param_dtype": "bf16", "reduce_dtype": "fp32"},
            )
        )
    return points


def sweep_configs(
    workloads: int, bf16: bool, *, knobs: Sequence[str] | None = None, hsdp: bool = False
) -> list[Config]:
    """Every point for every workload: the most informative points first, for each workload.

    Args:
        workloads: How many workloads the sweep covers.
        bf16: Whether the device computes in bfloat16 (the mixed-precision points).
        knobs: ``--knobs``: keep only the points that set one of these knobs, and each
            strategy at its defaults (the baseline they are judged against).
        hsdp: Add HSDP at its defaults (the world has at least 4 ranks).

    Raises:
        BenchUsageError: If a name in ``knobs`` is not a knob of the sweep.
    """
    points = sweep_points(bf16, hsdp)
    if knobs is not None:
        known = sorted({name for _, point in points for name in point})
        unknown = [name for name in knobs if name not in known]
        if unknown:
            raise BenchUsageError(
                f"--knobs: unknown knob {unknown[0]!r}; the sweep's knobs are {', '.join(known)}"
            )
        points = [
            (s, point) for s, point in points if not point or any(name in point for name in knobs)
        ]
    return [
        Config(workload=index, strategy=strategy, knobs=point)
        for strategy, point in points
        for index in range(workloads)
    ]


_UNITS = {
    "": 2**20,
    "b": 1,
    "k": 2**10,
    "kb": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mb": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gb": 2**30,
    "gib": 2**30,
}


def parse_memory(text: str) -> int:
    """``--memory-budget``: ``"4GiB"``, ``"512MiB"``, ``"1.5g"``; a bare number is MiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise BenchUsageError(
            f"--memory-budget must be a size such as 4GiB, 512MiB or 2048 (MiB), got {text!r}"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise BenchUsageError(f"--memory-budget must be positive, got {text!r}")
    return int(value)


def budgeted(row: Mapping[str, Any]) -> int:
    """The per-rank memory that ``--memory-budget`` is applied to, in bytes.

    The allocator's reserved peak (what the device must have free, fragmentation included),
    or the allocated peak in rows without it (schema 1).
    """
    value = row.get("peak_reserved_bytes")
    return int(row["peak_mem_bytes"] if value is None else value)


def recommend(
    rows: Sequence[Mapping[str, Any]], memory_budget: int | None
) -> tuple[dict[str, Any], Mapping[str, Any], str] | None:
    """The fastest point that fits the budget, as a ``training.distributed`` section.

    Every point competes, the step knobs' too: throughput is samples per second over whole
    optimizer steps, so gradient accumulation is judged by what it saves per sample.

    Returns:
        ``(section, row, reason)``, or ``None`` when no measured point fits. The section is
        validated by ``DistributedConfig.from_mapping`` and holds every field; the row's
        step knobs (:data:`~strategy_bench._knobs.STEP_KNOBS`) are the trainer's settings
        beside it (:func:`yaml_section` writes both).
    """
    fitting = [
        row for row in ok_rows(rows) if memory_budget is None or budgeted(row) <= memory_budget
    ]
    if not fitting:
        return None
    best = max(fitting, key=lambda row: row["samples_per_s"])
    section = DistributedConfig.from_mapping(
        {"strategy": best["strategy"], **wrap_knobs(best["knobs"])}
    )
    runner_up = sorted(fitting, key=lambda row: row["samples_per_s"], reverse=True)[1:2]
    reason = (
        f"fastest of {len(fitting)} point(s)"
        + ("" if memory_budget is None else f" within {memory_budget / 2**20:.0f} MiB per rank")
        + f": {best['samples_per_s']:.1f} samples/s at {budgeted(best) / 2**20:.0f} MiB reserved"
    )
    if runner_up:
        ratio = best["samples_per_s"] / runner_up[0]["samples_per_s"]
        reason += f", {ratio:.2f}x the next best ({_describe(runner_up[0])})"
    trainer = step_knobs(best["knobs"])
    if trainer:
        reason += (
            f". It needs the trainer to run with {knob_text(trainer, ', ')} (not part of "
            "training.distributed)"
        )
        if "grad_accum" in trainer:
            reason += (
                f"; gradient accumulation makes the global batch {trainer['grad_accum']}x "
                "larger, which changes the optimization"
            )
    if best["knobs"].get("param_dtype") not in (None, "fp32"):
        full = [row for row in fitting if row["knobs"].get("param_dtype") in (None, "fp32")]
        reason += (
            f". It computes in {best['knobs']['param_dtype']} (mixed precision changes the "
            "numerics)"
        )
        if full:
            fastest = max(full, key=lambda row: row["samples_per_s"])
            reason += (
                f"; the fastest full-precision point is {_describe(fastest)} at "
                f"{fastest['samples_per_s']:.1f} samples/s"
            )
    return section.to_dict(), best, reason


def _describe(row: Mapping[str, Any]) -> str:
    return f"{row['strategy']} {knob_text(row['knobs'], ', ') or 'defaults'}"


def yaml_section(section: Mapping[str, Any], trainer: Mapping[str, Any] | None = None) -> str:
    """The section as YAML text under ``training.distributed``.

    Args:
        section: The ``training.distributed`` fields.
        trainer: The step knobs the recommendation was measured with, written beside the
            section under ``training`` (the trainer reads them; strategy-config does not).
    """
    lines = ["training:", "  distributed:"]
    lines += [f"    {key}: {_yaml(value)}" for key, value in section.items()]
    if trainer:
        lines.append("  # the trainer's step settings this point was measured with:")
        lines += [f"  {key}: {_yaml(value)}" for key, value in trainer.items()]
    return "\n".join(lines)


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
