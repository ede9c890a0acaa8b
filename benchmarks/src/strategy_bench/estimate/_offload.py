"""CPU offload in the estimate: what leaves the device, what crosses the host link, and when.

With ``offload: cpu`` (FSDP2's ``CPUOffloadPolicy``) a rank keeps its shards of the
parameters, the gradients and the optimizer state in (pinned) host memory. Per step, each
unit's parameter shard is copied to the device before each of its all-gathers (the forward's
and, resharded after it, the backward's: twice per micro-batch; once without resharding), and
each reduced gradient shard is copied back (once per reduction). The optimizer steps on the
host, over the shard, at the host's memory bandwidth.

The copies are counted as exposed (the upper bound: FSDP2 issues them on the all-gather's
stream, which hides part of them behind compute), and the host and device directions as one
sum (a PCIe link carries both at once; the sum is the bound again).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from strategy_bench.workload import micro_steps, offloads, syncs_every_micro_step


def offload_fields(
    strategy: str, knobs: Mapping[str, Any], row: Mapping[str, Any]
) -> dict[str, Any]:
    """The row's offload figures (empty when the point does not offload).

    Args:
        strategy: The point's strategy.
        knobs: Its knobs.
        row: The estimated row so far: ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``
            (this rank's shards) and ``tracked_peak_bytes`` (as if on the device).

    Returns:
        ``host_bytes`` (the shards in pinned host memory, per rank), ``device_peak_bytes``
        (the peak without them), ``offload_h2d_bytes_per_step`` and
        ``offload_d2h_bytes_per_step`` (per rank).
    """
    if strategy == "ddp" or not offloads(strategy, knobs):
        return {}
    params, grads = int(row["param_bytes"]), int(row["grad_bytes"])
    host = params + grads + int(row["optimizer_bytes"])
    micro = micro_steps(knobs)
    gathers = 2 if knobs.get("reshard_after_forward", True) else 1
    reductions = micro if syncs_every_micro_step(knobs) else 1
    return {
        "host_bytes": host,
        "device_peak_bytes": max(0, int(row["tracked_peak_bytes"]) - host),
        "offload_h2d_bytes_per_step": params * gathers * micro,
        "offload_d2h_bytes_per_step": grads * reductions,
    }


def host_copy_ms(row: Mapping[str, Any], link_bytes_per_s: float | None) -> float:
    """The step's host-link copies in ms (0 for a row that does not offload)."""
    h2d = row.get("offload_h2d_bytes_per_step")
    if h2d is None or not link_bytes_per_s:
        return 0.0
    return (float(h2d) + float(row["offload_d2h_bytes_per_step"])) / link_bytes_per_s * 1e3


def host_optimizer_ms(
    row: Mapping[str, Any],
    optimizer_ms: float,
    device_bytes_per_s: float | None,
    host_bytes_per_s: float | None,
) -> float:
    """The optimizer step's ms, on the host for a row that offloads.

    The same bytes at the host's bandwidth; ``optimizer_ms`` as it is for a row that does not
    offload, or where a rate is unknown.
    """
    offloaded = row.get("offload_h2d_bytes_per_step") is not None
    if not (offloaded and device_bytes_per_s and host_bytes_per_s):
        return optimizer_ms
    return optimizer_ms * device_bytes_per_s / host_bytes_per_s
