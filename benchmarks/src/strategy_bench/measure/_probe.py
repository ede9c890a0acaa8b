"""The run's links: collectives timed at a few sizes, fitted to latency + bytes / bandwidth.

A collective of ``S`` bytes (an all-reduce's buffer, an all-gather's output, a
reduce-scatter's input: what :class:`~strategy_bench.measure._comm.CommBytes` counts)
over ``n`` ranks takes ``latency + S * factor(n) / busbw``, with nccl-tests' bus-bandwidth
factors: all-reduce ``2(n-1)/n``, all-gather and reduce-scatter ``(n-1)/n``. The fitted bus
bandwidth is then one figure per link, whatever the group size; the estimate's time model
(``strategy_bench.estimate._time_model``) reads it back.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from strategy_bench._compat import all_gather_single, reduce_scatter_single
from strategy_bench.measure._timing import aligned_seconds

logger = logging.getLogger(__name__)

PROBE_MIB = (0.0625, 1.0, 16.0, 64.0)
"""Message sizes the run's probe times each collective at, in MiB (``--probe-mib``): 64 KiB,
where the latency shows, up to 64 MiB, where the bandwidth does."""

PROBE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")

_REPEATS = 5
"""Timed samples per collective and size (after one untimed call); the median is fitted."""

_BATCH_BYTES = 64 << 20
_MOST_CALLS = 20


def calls_per_sample(size: int) -> int:
    """How many calls of ``size`` bytes one timed sample holds.

    20 (nccl-tests' count) for the small messages whose time is mostly latency, fewer as the
    bytes grow (64 MiB: one), so that a sample moves at most 64 MiB per rank.
    """
    return max(1, min(_MOST_CALLS, _BATCH_BYTES // max(1, size)))


def bus_factor(kind: str, ranks: int) -> float:
    """nccl-tests' bus-bandwidth factor: the share of ``S`` each rank's link carries.

    Raises:
        ValueError: For a collective without a factor, or fewer than one rank.
    """
    if ranks < 1:
        raise ValueError(f"a collective needs at least one rank, got ranks={ranks}")
    if kind == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if kind in ("all_gather", "reduce_scatter", "broadcast"):
        return (ranks - 1) / ranks
    raise ValueError(f"no bus factor for collective {kind!r}; known: {', '.join(PROBE_KINDS)}")


def fit_link(samples: Sequence[tuple[int, float]], kind: str, ranks: int) -> dict[str, Any]:
    """Least squares of ``seconds = latency + bytes * factor / busbw``, in relative error.

    Args:
        samples: ``(bytes, seconds)`` pairs, at least two distinct sizes.
        kind: The collective (its bus factor).
        ranks: The group's size.

    Returns:
        ``latency_us``, ``busbw_gbps`` (GB/s, 1e9 bytes), ``ranks`` and the ``samples`` as
        ``[bytes, ms]``. A negative intercept (noise at small sizes) is refitted through zero.

    Raises:
        ValueError: Fewer than two sizes, a group of one rank, or times that do not grow
            with the size (no bandwidth to fit).
    """
    factor = bus_factor(kind, ranks)
    sizes = {size for size, _ in samples}
    if len(sizes) < 2 or factor == 0:
        raise ValueError(
            f"fitting {kind} needs two message sizes or more on two ranks or more, got "
            f"sizes {sorted(sizes)} on {ranks} rank(s)"
        )
    xs = [size * factor for size, _ in samples]
    ys = [seconds for _, seconds in samples]
    # Relative residuals (weights 1/t^2): the small sizes set the latency, the large ones
    # the bandwidth, instead of the largest size's noise setting both.
    ws = [1 / y**2 for y in ys]
    sw, sx, sy = sum(ws), _dot(ws, xs), _dot(ws, ys)
    sxx, sxy = _dot(ws, [x * x for x in xs]), _dot(ws, [x * y for x, y in zip(xs, ys, strict=True)])
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    latency = (sy - slope * sx) / sw
    if latency < 0:  # noise at small sizes: through zero
        latency = 0.0
        slope = sxy / sxx
    if not slope > 0 or not math.isfinite(slope):
        raise ValueError(f"{kind} times do not grow with the message size: {samples}")
    return {
        "latency_us": latency * 1e6,
        "busbw_gbps": 1 / slope / 1e9,
        "ranks": ranks,
        "samples": [[int(size), seconds * 1e3] for size, seconds in samples],
    }


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def collective_seconds(link: Mapping[str, Any], kind: str, nbytes: float, ranks: int) -> float:
    """What :func:`fit_link`'s model predicts for ``nbytes`` over ``ranks`` ranks."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    busbw = float(link["busbw_gbps"]) * 1e9
    return float(link["latency_us"]) * 1e-6 + nbytes * bus_factor(kind, ranks) / busbw


def probe_links(
    device: torch.device, sizes_mib: Sequence[float] = PROBE_MIB
) -> dict[str, Any] | None:
    """Time the three collectives on this run's ranks and fit each link; every rank calls it.

    One node: the whole group is the ``intra_node`` link. Spanning nodes (``LOCAL_WORLD_SIZE``
    below the world size): ``intra_node`` is fitted on each node's ranks and ``inter_node`` on
    one rank per node, each on subgroups made for the probe and destroyed after it. Sizes that
    would not fit a GPU's free memory three times over are left out.

    Returns:
        ``{"sizes_mib": [...], "intra_node": {kind: fit}, "inter_node": {...}}`` (links with
        fewer than two ranks left out), plus ``"not_fitted": {link: {kind: reason}}`` for each
        collective whose times could not be fitted (under load, a small message can take
        longer than a large one), the same on every rank; ``None`` at world size 1 or with
        no sizes.
    """
    world = dist.get_world_size()
    if world < 2 or not sizes_mib:
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    allowed: list[list[float]] = [[] for _ in range(world)]
    dist.all_gather_object(allowed, [mib for mib in sizes_mib if _fits(device, mib)])
    kept = [mib for mib in sizes_mib if all(mib in mine for mine in allowed)]
    sizes = [int(mib * 2**20) for mib in kept]
    out: dict[str, Any] = {"sizes_mib": kept}
    failures: dict[str, dict[str, str]] = {}
    if local >= world or world % local != 0:
        if local < world:  # nodes of unequal size: no group is one node, none one per node
            logger.warning(
                "comm probe: %d ranks are not whole nodes of %d (LOCAL_WORLD_SIZE); the whole "
                "group is fitted as one link, intra_node",
                world,
                local,
            )
        out["intra_node"] = _probe_group(device, sizes, None, world, failures, "intra_node")
        return _probe_result(out, failures)
    nodes = world // local
    intra, groups = dist.new_subgroups(local)  # type: ignore[no-untyped-call]
    inter, more = dist.new_subgroups_by_enumeration(  # type: ignore[no-untyped-call]
        [[node * local + index for node in range(nodes)] for index in range(local)]
    )
    try:
        out["intra_node"] = _probe_group(device, sizes, intra, local, failures, "intra_node")
        out["inter_node"] = _probe_group(device, sizes, inter, nodes, failures, "inter_node")
    finally:
        dist.barrier()
        for group in [*groups, *more]:
            dist.destroy_process_group(group)
    return _probe_result(out, failures)


def _probe_result(out: dict[str, Any], failures: dict[str, dict[str, str]]) -> dict[str, Any]:
    """The fitted links, and each collective that was timed but not fitted with its reason."""
    result = {key: value for key, value in out.items() if value is not None}
    if failures:
        result["not_fitted"] = failures
    return result


def _fits(device: torch.device, mib: float) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return 3 * mib * 2**20 < free


def _probe_group(
    device: torch.device,
    sizes: Sequence[int],
    group: dist.ProcessGroup | None,
    ranks: int,
    failures: dict[str, dict[str, str]],
    link: str,
) -> dict[str, Any] | None:
    """Each collective at each size on ``group``; the slowest rank's median per size, fitted.

    A collective whose times cannot be fitted is logged and recorded in
    ``failures[link][kind]`` with the reason (the same on every rank: every rank fits the
    same gathered times).

    Every rank runs the same calls on its own group (each node's, or each cross-node one) at
    the same time, lined up by a world barrier: the link as a step uses it, all at once.
    """
    if ranks < 2 or len(sizes) < 2:
        return None
    times: dict[str, list[tuple[int, float]]] = {kind: [] for kind in PROBE_KINDS}
    for size in sizes:
        for kind, seconds in _time_size(device, size, group, ranks).items():
            times[kind].append(seconds)
    gathered: list[dict[str, list[tuple[int, float]]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, times)  # every rank, so that every rank fits the same
    # The slowest of every group (every node's, for the link inside a node): one figure,
    # the same on every rank.
    fits: dict[str, Any] = {}
    for kind in PROBE_KINDS:
        slowest = [
            (size, max(other[kind][index][1] for other in gathered))
            for index, (size, _) in enumerate(times[kind])
        ]
        try:
            fits[kind] = fit_link(slowest, kind, ranks)
        except ValueError as error:  # noise on a link too fast to time: said, not fitted
            logger.warning("comm probe: %s", error)
            failures.setdefault(link, {})[kind] = str(error)
    return fits or None


def _time_size(
    device: torch.device, size: int, group: dist.ProcessGroup | None, ranks: int
) -> dict[str, tuple[int, float]]:
    """Each collective's median time at ``size`` bytes on this rank: ``(bytes, seconds)``."""
    numel = size // 4 // ranks * ranks  # float32, divisible by the group
    full = torch.ones(numel, device=device)
    part = torch.empty(numel // ranks, device=device)
    calls: dict[str, Callable[[], object]] = {
        "all_reduce": lambda: dist.all_reduce(full, group=group),
        "all_gather": lambda: all_gather_single(full, part, group=group),
        "reduce_scatter": lambda: reduce_scatter_single(part, full, group=group),
    }
    out = {}
    for kind, call in calls.items():
        call()  # untimed: the first call of a size sets up its buffers
        # Every group's call at once (they share the host and the network); on CUDA timed
        # by events, with no host sync inside.
        spent = aligned_seconds(
            call, repeats=_REPEATS, device=device, calls=calls_per_sample(numel * 4)
        )
        out[kind] = (numel * 4, statistics.median(spent))
    return out
