"""What failures cost a run: restart from the last checkpoint, or heal a replica group (torchft).

A run of ``T`` failure-free seconds on ``W`` GPUs, each failing once per ``M`` GPU-hours on
average, sees failures at the rate ``W / M``. Each failure loses job time:

- **restart**: the whole job stops, restarts (``restart_s``: the scheduler, the processes, the
  load) and repeats the steps since the last checkpoint (half an interval on average):
  ``restart_s + checkpoint_every_s / 2``;
- **heal** (torchft's replica groups, for DDP and HSDP): the other groups keep stepping while
  the failed group restarts and copies the state from a live peer (``heal_s``), at
  ``(G - 1) / G`` of the job's rate, and the step in flight is discarded:
  ``heal_s / G + step_s``. FSDP has one sharded copy and no group to lose: restart only.

Failures during the lost time fail again, so a mode losing ``l`` seconds per failure takes
``T / (1 - W * l / M)`` (``M`` in seconds); a run that loses as fast as it trains
(``W * l >= M``) never ends.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from strategy_bench.estimate._cost import SECONDS_PER_DAY, SECONDS_PER_HOUR
from strategy_bench.estimate._points import hsdp_degrees

FAILURE_FIELDS = (
    "failures",
    "replica_groups",
    "restart_days",
    "restart_gpu_hours",
    "heal_days",
    "heal_gpu_hours",
)
"""What :func:`failure_cost` adds to a costed row (``None`` where a mode does not apply)."""

DEFAULT_CHECKPOINT_EVERY_S = 1800.0
DEFAULT_RESTART_S = 600.0
DEFAULT_HEAL_S = 60.0


def replica_groups(strategy: str, world: int, gpus_per_node: int) -> int | None:
    """The replica groups torchft can lose one of: DDP's ranks, HSDP's replicas; else ``None``."""
    if strategy == "ddp":
        return world
    if strategy == "hsdp":
        return hsdp_degrees(world, gpus_per_node)[0]
    return None


def failure_cost(
    row: Mapping[str, Any],
    *,
    gpu_mtbf_hours: float,
    checkpoint_every_s: float,
    restart_s: float,
    heal_s: float,
    gpus_per_node: int,
) -> dict[str, float | None]:
    """The expected failures of ``row``'s costed run, and its days and GPU-hours per mode.

    Args:
        row: A row with ``train_days``, ``world_size``, ``strategy`` and
            ``predicted_step_ms`` (:func:`training_cost` applied).
        gpu_mtbf_hours: Mean hours between failures of one GPU (its node's share included).
        checkpoint_every_s: Seconds between checkpoints (restart repeats half of it).
        restart_s: Seconds from a failure to the restarted job's first step.
        heal_s: Seconds from a failure to the failed group's first committed step.
        gpus_per_node: HSDP's replicas are its nodes.

    Returns:
        :data:`FAILURE_FIELDS`: ``failures`` at the failure-free length, the groups torchft
        can lose one of (``None``: FSDP, or one group), and each mode's days and GPU-hours:
        ``None`` where the run never ends, where the mode does not apply (heal without two
        groups) or where the row has no cost.
    """
    days = row.get("train_days")
    if not days:
        return dict.fromkeys(FAILURE_FIELDS)
    world = int(row["world_size"])
    seconds = float(days) * SECONDS_PER_DAY
    per_second = world / (gpu_mtbf_hours * SECONDS_PER_HOUR)  # the job's failure rate
    step_s = float(row.get("predicted_step_ms") or 0.0) / 1e3
    groups = replica_groups(str(row["strategy"]), world, gpus_per_node)

    def lengthened(lost_s: float) -> tuple[float | None, float | None]:
        share = per_second * lost_s
        if share >= 1:  # it loses as fast as it trains
            return None, None
        total = seconds / (1 - share)
        return total / SECONDS_PER_DAY, total * world / SECONDS_PER_HOUR

    restart_days, restart_gpu_hours = lengthened(restart_s + checkpoint_every_s / 2)
    heal_days = heal_gpu_hours = None
    if groups is not None and groups > 1:
        heal_days, heal_gpu_hours = lengthened(heal_s / groups + step_s)
    else:
        groups = None
    return {
        "failures": per_second * seconds,
        "replica_groups": groups,
        "restart_days": restart_days,
        "restart_gpu_hours": restart_gpu_hours,
        "heal_days": heal_days,
        "heal_gpu_hours": heal_gpu_hours,
    }


def check_failure_args(
    gpu_mtbf_hours: float | None,
    train_tokens: float | None,
    checkpoint_every_s: float,
    restart_s: float,
    heal_s: float,
) -> None:
    """``--gpu-mtbf-hours`` and its times: finite and positive, and with ``--train-tokens``.

    Raises:
        ValueError: Naming the argument and the value.
    """
    if gpu_mtbf_hours is None:
        return
    if train_tokens is None:
        raise ValueError(
            f"--gpu-mtbf-hours {gpu_mtbf_hours:g} prices failures into the run of "
            "--train-tokens N; add it"
        )
    for name, value in (
        ("--gpu-mtbf-hours", gpu_mtbf_hours),
        ("--checkpoint-every-s", checkpoint_every_s),
        ("--restart-s", restart_s),
        ("--heal-s", heal_s),
    ):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value:g}")
