"""``estimate --largest``: the largest model of a family that fits a device, per strategy.

A family is a workload with one integer init parameter scaled (a preset's ``depth``, or a
user factory's ``--scale-param``). For each strategy (and knobs) and world size, the largest
value whose estimated per-rank ``peak_bytes`` fits the device's usable memory is found by
bisection over fake steps (:func:`estimate_point`). The probes are chosen by the secant of the
bracketing probes' peaks (a stack of identical blocks grows its peak by the same bytes per
block, so the first guess is usually right), and every answer is confirmed by two probes:
the value fits and the next one does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import torch.distributed as dist

from strategy_bench._errors import BenchUsageError
from strategy_bench.estimate._estimate import estimate_point, spawn_pool
from strategy_bench.estimate._fits import DeviceMemory
from strategy_bench.estimate._points import (
    EstimateOptions,
    EstimatePoint,
    recipe_variants,
    spans_nodes,
)
from strategy_bench.results import OK
from strategy_bench.workload import WorkloadSpec

logger = logging.getLogger(__name__)

PRESET_SCALE_PARAM = "depth"
"""What a preset's family scales: the number of transformer blocks."""

LARGEST_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("ddp", {}),
    ("fsdp", {}),
    ("hsdp", {}),
    ("fsdp", {"param_dtype": "bf16", "reduce_dtype": "fp32"}),
)
"""The lines of ``--largest``: each strategy at its defaults (HSDP where the world spans more
than one node), and FSDP with bf16 parameters; with a recipe, each strategy with the recipe's
knobs instead (:func:`recipe_variants`)."""

MAX_SCALE = 1 << 16
"""The search stops growing the scaled parameter here (reported as "at least")."""


def scale_start(spec: WorkloadSpec, param: str) -> int:
    """The family's starting value of ``param``: the workload's own (given or default).

    Raises:
        BenchUsageError: If the model factory takes no such parameter, or it has no integer
            value to start from.
    """
    workload = spec.build()
    params = dict(workload.init_params)
    if param in params:
        value = params[param]
    else:
        try:
            signature = inspect.signature(workload.factory)
        except (TypeError, ValueError):
            signature = None
        found = None if signature is None else signature.parameters.get(param)
        if found is None:
            known = [] if signature is None else sorted(signature.parameters)
            raise BenchUsageError(
                f"--scale-param {param!r}: the model factory {workload.name!r} takes no such "
                f"parameter (it takes: {', '.join(known) or 'none that can be read'})"
            )
        value = found.default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BenchUsageError(
            f"--scale-param {param!r} must be a positive integer init parameter of the model "
            f"factory, got {value!r}; give a starting value in --init-params"
        )
    return value


def largest_lines(
    spec: WorkloadSpec,
    param: str,
    world_sizes: Sequence[int],
    options: EstimateOptions,
    device: DeviceMemory,
    *,
    strategies: Sequence[str] = ("ddp", "fsdp", "hsdp"),
    recipe: Mapping[str, Any] | None = None,
    known: Sequence[Mapping[str, Any]] = (),
    jobs: int = 1,
    progress: Callable[[dict[str, Any]], None] | None = None,
    pool: Executor | None = None,
) -> list[dict[str, Any]]:
    """Per strategy (and knobs) and world size, the largest value of ``param`` that fits.

    DDP's per-rank memory does not depend on the world size, nor HSDP's (a shard group is one
    node): each is searched once and its entry repeated. ``known`` rows (the estimate of the
    unscaled workload, same options) stand for the probes at the starting value.
    ``jobs > 1`` searches that many lines at once, each in a spawned process with its own fake
    process group; so does a process that already has a process group of its own (left
    alone), as in :func:`run_estimate`; ``pool``: its workers instead of a pool of its own.

    Returns:
        One entry per line and world size: ``model``, ``strategy``, ``knobs``,
        ``world_size``, ``scale_param``, ``scale_value`` (``None`` when even 1 does not fit),
        ``largest_params``, ``peak_bytes``, ``headroom_bytes``, ``at_least`` (the search hit
        :data:`MAX_SCALE`) and ``probes`` (fake steps taken).
    """
    start = scale_start(spec, param)
    variants = recipe_variants(recipe, LARGEST_VARIANTS)
    seeds = {_line_key(row["strategy"], row["knobs"], row["world_size"]): row for row in known}
    # (variant, world) -> the line searched for it (DDP: one line for every world size).
    searched: dict[tuple[Any, ...], EstimatePoint] = {}
    order: list[tuple[tuple[Any, ...], int]] = []
    for strategy, knobs in variants:
        if strategy not in strategies:
            continue
        for world in world_sizes:
            if strategy == "hsdp" and not spans_nodes(world, options.gpus_per_node):
                continue  # one node: HSDP would be FSDP
            # DDP holds the whole model and HSDP 1/gpus_per_node of it at any world size: one
            # search each, repeated; FSDP's shard shrinks with the world: one per world size.
            line = _line_key(strategy, knobs, world if strategy == "fsdp" else None)
            searched.setdefault(line, EstimatePoint(0, strategy, dict(knobs), world))
            order.append((line, world))
    found: dict[tuple[Any, ...], dict[str, Any]] = {}

    def task(point: EstimatePoint) -> tuple[Any, ...]:
        seed = seeds.get(_line_key(point.strategy, point.knobs, point.world_size))
        return (spec, param, start, point, options, device, seed)

    lines = list(searched.items())
    if pool is None and (jobs <= 1 or len(lines) <= 1) and not dist.is_initialized():
        for line, point in lines:
            found[line] = _search(*task(point))
            if progress is not None:
                progress(found[line])
    else:
        with contextlib.ExitStack() as stack:
            if pool is None:
                pool = stack.enter_context(spawn_pool(min(jobs, len(lines))))

            # The longest searches first: the least memory at the start value, the deepest
            # answer (lines without a seed row before them); results are read in order.
            def expected_cost(item: tuple[tuple[Any, ...], EstimatePoint]) -> int:
                seed = task(item[1])[-1]
                ok = seed is not None and seed.get("status") == OK
                return int(seed["peak_bytes"]) if ok else 0

            futures = {
                line: pool.submit(_search, *task(point))
                for line, point in sorted(lines, key=expected_cost)
            }
            futures = {line: futures[line] for line, _ in lines}
            for line, future in futures.items():
                found[line] = future.result()
                if progress is not None:
                    progress(found[line])
    entries = []
    for line, world in order:
        entry = found[line]
        if entry["world_size"] != world:  # DDP's or HSDP's one line, repeated
            entry = {**entry, "world_size": world, "probes": 0}
        entries.append(entry)
    return entries


def _line_key(strategy: str, knobs: Mapping[str, Any], world: int | None) -> tuple[Any, ...]:
    return strategy, tuple(sorted(dict(knobs).items())), world


def _search(
    spec: WorkloadSpec,
    param: str,
    start: int,
    point: EstimatePoint,
    options: EstimateOptions,
    device: DeviceMemory,
    seed: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Bisect ``param`` between a value that fits and one that does not."""
    usable = device.usable_bytes
    rows: dict[int, dict[str, Any]] = {}
    if seed is not None and seed.get("status") == OK:
        rows[start] = dict(seed)

    def probe(value: int) -> int:
        if value not in rows:
            scaled = dataclasses.replace(spec, scale=(param, value))
            row = estimate_point(scaled, point, options, comm=False)
            if row["status"] != OK:
                raise BenchUsageError(
                    f"--largest: the {point.strategy} estimate at {param}={value} failed: "
                    f"{row['error']}"
                )
            rows[value] = row
        return int(rows[value]["peak_bytes"])

    fits, fails = 0, None  # largest value known to fit (0: none), smallest known not to
    for value in sorted({max(1, start // 2), start}, reverse=True):  # then 1, if need be
        if probe(value) <= usable:
            fits = value
            break
        fails = value
    if fits == 0 and fails != 1:
        if probe(1) <= usable:
            fits = 1
        else:
            fails = 1
    first = True
    while fails is None and fits < MAX_SCALE:  # grow by the secant's guess
        if len(rows) < 2 and fits > 1:  # a cheap smaller probe gives the secant its slope
            probe(max(1, fits // 2))
        guess = _secant(rows, usable, fits)
        # Trust the first guess (its neighbour above should not fit); after a miss, at least double.
        value = min(MAX_SCALE, max(fits + 1 if first else 2 * fits, guess + 1))
        first = False
        if probe(value) <= usable:
            fits = value
        else:
            fails = value
    while fails is not None and fails - fits > 1:
        guess = _secant(rows, usable, fits)
        low, high = fits + 1, fails - 1
        if guess < low or guess > high:
            guess = (fits + fails) // 2
        # Probe the guess and its neighbour, so that a right guess closes the bracket.
        for value in (guess, guess + 1 if guess + 1 < fails else guess - 1):
            if value <= fits or value >= fails:
                continue
            if probe(value) <= usable:
                fits = value
            else:
                fails = value
    best = rows.get(fits)
    return {
        "model": (best or rows[min(rows)])["model"],
        "strategy": point.strategy,
        "knobs": dict(point.knobs),
        "world_size": point.world_size,
        "scale_param": param,
        "scale_value": fits or None,
        "largest_params": None if best is None else best["params"],
        "peak_bytes": None if best is None else best["peak_bytes"],
        "headroom_bytes": None if best is None else usable - int(best["peak_bytes"]),
        "at_least": fails is None,
        "probes": len(rows),
    }


def _secant(rows: dict[int, dict[str, Any]], usable: int, fits: int) -> int:
    """The value where the line through the two largest probes reaches ``usable``."""
    values = sorted(rows)
    if len(values) < 2:
        return 2 * max(1, fits)
    a, b = values[-2], values[-1]
    if fits in rows:  # prefer the bracket's own ends
        above = [v for v in values if v > fits]
        a, b = (fits, above[0]) if above else (values[-2], values[-1])
    peak_a, peak_b = int(rows[a]["peak_bytes"]), int(rows[b]["peak_bytes"])
    if peak_b <= peak_a:
        return 2 * max(1, fits)
    return a + int((usable - peak_a) * (b - a) // (peak_b - peak_a))
