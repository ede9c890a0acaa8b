"""``estimate --largest``: what it scales by default, and each family's largest model that fits."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

from strategy_bench._errors import BenchUsageError
from strategy_bench.estimate import (
    PRESET_SCALE_PARAM,
    DeviceMemory,
    EstimateOptions,
    largest_lines,
)
from strategy_bench.results import knob_text
from strategy_bench.workload import HF_SCALE_PARAM, WorkloadSpec

logger = logging.getLogger(__name__)


def default_scale_param(specs: Sequence[WorkloadSpec]) -> str:
    """What ``--largest`` scales without ``--scale-param``: a preset's or a config's depth.

    Args:
        specs: The workloads estimated.

    Raises:
        BenchUsageError: A ``--model-factory`` workload (no known depth), or presets mixed
            with ``--hf-config`` (two different parameters).
    """
    kinds = {"preset" if spec.preset else "hf" if spec.hf_config else "user" for spec in specs}
    if "user" in kinds:
        raise BenchUsageError(
            "--largest with --model-factory needs --scale-param NAME (an integer init "
            "parameter of the factory)"
        )
    if kinds == {"hf"}:
        return HF_SCALE_PARAM
    if kinds == {"preset"}:
        return PRESET_SCALE_PARAM
    raise BenchUsageError(
        f"--largest over presets and --hf-config scales {PRESET_SCALE_PARAM!r} in one and "
        f"{HF_SCALE_PARAM!r} in the other; estimate them in two runs"
    )


def find_largest(
    args: argparse.Namespace,
    specs: Sequence[WorkloadSpec],
    rows: Sequence[dict[str, Any]],
    scale_param: str,
    worlds: Sequence[int],
    options: EstimateOptions,
    device: DeviceMemory,
    jobs: int,
    pool: Executor | None = None,
    recipe: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """``--largest``: every family's largest model per strategy and world size.

    Args:
        args: The parsed arguments (``--strategies``).
        specs: The workloads, one family each.
        rows: The estimated rows (each family's known points seed its bisection).
        scale_param: The integer init parameter bisected.
        worlds: The world sizes.
        options: The estimate's options.
        device: Each rank's device memory.
        jobs: Points estimated at once.
        pool: The spawned workers to reuse, if any.
        recipe: The recipe's knobs.

    Returns:
        One entry per family, strategy and world size (:func:`largest_lines`).
    """
    sys.stderr.write(
        f"strategy-bench: --largest: bisecting {scale_param} on fake steps, "
        f"{device.usable_bytes / 2**30:.1f} GiB usable per rank\n"
    )
    entries: list[dict[str, Any]] = []

    def progress(entry: dict[str, Any]) -> None:
        what = f"{entry['strategy']} {entry['model']} {knob_text(entry['knobs'], ' ')}".strip()
        logger.info(
            "largest: %s, %d ranks: %s=%s (%d probes)",
            what,
            entry["world_size"],
            scale_param,
            entry["scale_value"],
            entry["probes"],
        )

    for spec in specs:
        name = spec.build().name
        entries += largest_lines(
            spec,
            scale_param,
            worlds,
            options,
            device,
            strategies=args.strategies,
            recipe=recipe,
            known=[row for row in rows if row["model"] == name],
            jobs=jobs,
            progress=progress,
            pool=pool,
        )
    return entries
