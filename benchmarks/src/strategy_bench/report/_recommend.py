"""The sweep's recommendation: the fastest point within the memory budget, as YAML."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from distributed_strategy import DistributedConfig
from strategy_bench.results import knob_text, ok_rows
from strategy_bench.workload import step_knobs, wrap_knobs


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
        step knobs (:data:`~strategy_bench.workload._knobs.STEP_KNOBS`) are the trainer's settings
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
