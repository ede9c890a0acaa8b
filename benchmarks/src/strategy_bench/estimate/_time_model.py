"""The estimate's step time: compute, communication, and what of it the step exposes.

A row's communication is what its fake step moved (``comm_bytes_by_dim``: bytes per mesh
dimension and collective) over links fitted as ``latency + bytes * factor / busbw``
(:mod:`strategy_bench.measure._probe`, nccl-tests' bus factors). Each collective goes over the
link of its group: inside a node when the group's ranks share one, across nodes otherwise.

Overlap, per strategy (a step of ``m`` micro-batches; forward one third of a micro-step's
compute, backward two thirds, as their FLOPs are):

* DDP: the gradient buckets are all-reduced behind the last micro-step's backward, the last
  bucket after it: ``exposed = last bucket + max(0, the others - backward)``. ``bucket_cap_mb``
  sets the buckets' count (a latency each) and the last one's size.
* FSDP: each unit's all-gather is prefetched one unit ahead, in forward and again in
  backward (``reshard_after_forward``), and its reduce-scatter runs behind the next unit's
  backward: ``exposed = first gather + (units - 1) * max(0, a unit's comm - its compute) +
  last reduce-scatter``, per micro-step (the reduce-scatters on the last one only; on every
  one with ``grad_accum_sync=every``).
* HSDP: FSDP within the shard group, plus the all-reduce of each unit's reduced shard across
  the replicas, behind backward after its reduce-scatter (the last one exposed).

Compute, in this order of preference (``predicted_parts_ms.compute_source``): the same point
measured at world size 1 by the calibration run (its step, the optimizer part divided by the
shard degree); the same model's ``compute_ms`` there (the unwrapped step), times the
recompute of activation checkpointing when the run had none; the model's FLOPs at the
calibration's achieved FLOP/s; the FLOPs at the datasheet peak times ``--assumed-mfu``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from strategy_bench.estimate._offload import host_copy_ms, host_optimizer_ms
from strategy_bench.estimate._points import hsdp_degrees
from strategy_bench.estimate._time_inputs import TimeModel, point_key
from strategy_bench.measure import collective_seconds
from strategy_bench.workload import checkpoint_mode, micro_steps, syncs_every_micro_step

DEFAULT_BUCKET_CAP_MB = 25.0
"""torch's DDP ``bucket_cap_mb`` default."""

BUCKET_CAPS_MB = (1.0, 5.0, DEFAULT_BUCKET_CAP_MB, 100.0)
"""DDP ``bucket_cap_mb`` values every DDP row is predicted at."""

DDP_FIRST_BUCKET_BYTES = 2**20
"""DDP's first bucket (the last parameters, ready first) is capped at 1 MiB."""

FORWARD_SHARE = 1 / 3
"""Forward's share of a micro-step's forward and backward (backward is twice the FLOPs)."""


@dataclasses.dataclass(frozen=True)
class _Group:
    """A mesh dimension's group: its ranks, its link, and its fewest ranks on one node."""

    ranks: int
    scope: str
    per_node: int = 1


def _groups(strategy: str, world: int, gpus_per_node: int) -> dict[str, _Group]:
    """Each mesh dimension's group size and link (HSDP shards within a node)."""
    if world <= gpus_per_node:
        whole = _Group(world, "intra_node", world)
    else:  # the node with the fewest of the group's ranks sets the ring's pace
        whole = _Group(world, "inter_node", world % gpus_per_node or gpus_per_node)
    if strategy == "hsdp":
        replicate, shard = hsdp_degrees(world, gpus_per_node)
        return {
            "world": whole,
            "shard": _Group(shard, "intra_node", shard),
            "replicate": _Group(replicate, "inter_node" if replicate > 1 else "intra_node", 1),
        }
    return {"world": whole, "shard": whole, "replicate": whole}


def _link(model: TimeModel, group: _Group, kind: str) -> dict[str, float]:
    """The link a collective of ``kind`` runs over in ``group``.

    Inside a node: the intra-node fit. Across nodes: the inter-node latency, and bus bandwidth
    ``min(intra-node, ranks of the group per node x the inter-node figure)``. The inter-node
    figure is one rank's share of the network (a NIC per GPU); a NCCL ring over whole nodes
    spreads its channels over every NIC of the node (NVIDIA/nccl issues 687 and 1576), so a
    group with ``k`` ranks on each node moves ``k`` NICs' worth, up to what NVLink carries.
    HSDP's replicate groups (one rank per node) get one NIC's.
    """
    intra = _fit(model.links["intra_node"], kind)
    if group.scope == "intra_node":
        return intra
    inter = _fit(model.links["inter_node"], kind)
    busbw = min(float(intra["busbw_gbps"]), group.per_node * float(inter["busbw_gbps"]))
    return {"latency_us": float(inter["latency_us"]), "busbw_gbps": busbw}


def _fit(fitted: Mapping[str, Mapping[str, float]], kind: str) -> dict[str, float]:
    """``kind``'s fit; a collective the probe could not fit takes another's."""
    link = fitted.get(kind) or fitted.get("all_reduce") or next(iter(fitted.values()))
    return {"latency_us": float(link["latency_us"]), "busbw_gbps": float(link["busbw_gbps"])}


def annotate_time(rows: Sequence[dict[str, Any]], model: TimeModel) -> None:
    """Add the prediction to every ok row, in place.

    DDP rows also get ``predicted_by_bucket_ms``: the step at each of :data:`BUCKET_CAPS_MB`.
    """
    for row in rows:
        if row.get("status") != "ok":
            continue
        row.update(predict(row, model))
        if row["predicted_step_ms"] is None:
            continue
        if row["strategy"] == "ddp" and "bucket_cap_mb" not in row["knobs"]:
            row["predicted_by_bucket_ms"] = {
                str(cap): predict(row, model, bucket_cap_mb=cap)["predicted_step_ms"]
                for cap in BUCKET_CAPS_MB
            }


def predict(
    row: Mapping[str, Any],
    model: TimeModel,
    *,
    bucket_cap_mb: float | None = None,
) -> dict[str, Any]:
    """``predicted_step_ms``, its parts, samples/s and MFU for one estimated (or run) row.

    Args:
        row: A row with ``comm_bytes_by_dim`` (or ``comm_bytes_per_step``),
            ``comm_calls_per_step``, ``strategy``, ``knobs``, ``world_size``, ``batch_size``
            (per rank per optimizer step), ``flops_per_sample``.
        model: The time model.
        bucket_cap_mb: DDP's bucket cap (default: the row's knob, else torch's 25).
    """
    world = int(row["world_size"])
    strategy = row["strategy"]
    knobs = dict(row.get("knobs") or {})
    micro = micro_steps(knobs)
    compute, optimizer, source, peak = _compute_ms(row, model)
    if source is None:  # nothing to predict from: no step, rather than communication alone
        return {key: None for key in PREDICTED}
    on_host = host_optimizer_ms(
        row, optimizer, model.optimizer_bytes_per_s, model.host_optimizer_bytes_per_s
    )
    compute, optimizer = compute - optimizer + on_host, on_host
    host_copy = host_copy_ms(row, model.host_link_bytes_per_s)
    per_micro = max(0.0, compute - optimizer) / micro
    share = FORWARD_SHARE
    if checkpoint_mode(knobs) == "full":  # the forward again, inside backward
        share = FORWARD_SHARE / (1 + FORWARD_SHARE)
    forward, backward = per_micro * share, per_micro * (1 - share)
    groups = _groups(strategy, world, model.gpus_per_node)
    by_dim = row.get("comm_bytes_by_dim") or {"world": dict(row.get("comm_bytes_per_step") or {})}
    calls = dict(row.get("comm_calls_per_step") or {})
    comm: dict[str, float] = {}
    last_bucket = 0.0
    for dim, kinds in by_dim.items():
        group = groups.get(dim, groups["world"])
        for kind, nbytes in kinds.items():
            if group.ranks <= 1 or nbytes <= 0:
                continue
            link = _link(model, group, kind)
            latency = float(link["latency_us"]) * 1e-3
            transfer = collective_seconds(link, kind, nbytes, group.ranks) * 1e3 - latency
            count = _calls(strategy, kind, nbytes, calls, knobs, bucket_cap_mb)
            comm[f"{kind}@{dim}"] = count * latency + transfer
            if strategy == "ddp":  # the last bucket: its own latency and its bytes
                last_bytes = _last_bucket_bytes(nbytes, knobs, bucket_cap_mb)
                last_bucket += latency + transfer * last_bytes / nbytes
    total = sum(comm.values())
    if not model.overlap:
        hidden_total = total
    elif strategy == "ddp":
        hidden_total = last_bucket + max(0.0, total - last_bucket - backward)
    else:
        sizes = [int(size) for size in row.get("all_gather_bytes_by_call") or ()]
        every = syncs_every_micro_step(knobs)
        hidden_total = _fsdp_exposed(comm, calls, knobs, forward, backward, micro, sizes, every)
    # What the step waits for, by collective and mesh dimension (each its share of the total).
    exposed = {key: hidden_total * value / total for key, value in comm.items()} if total else {}
    step = compute + hidden_total + host_copy
    if not step > 0:
        return {key: None for key in PREDICTED}
    samples = float(row["batch_size"])
    flops = row.get("flops_per_sample")
    mfu = None
    if flops and peak:
        mfu = flops * samples / (step / 1e3) / peak
    tokens = row.get("tokens_per_sample")
    return {
        "predicted_step_ms": step,
        "predicted_parts_ms": {
            "compute": compute,
            "optimizer": optimizer,
            "compute_source": source,
            "comm": comm,
            "exposed_comm": exposed,
            "host_copy": host_copy,
        },
        "predicted_samples_per_s": samples * world / (step / 1e3),
        "predicted_tokens_per_s_per_gpu": samples * tokens / (step / 1e3) if tokens else None,
        "predicted_mfu": mfu,
    }


PREDICTED = (
    "predicted_step_ms",
    "predicted_parts_ms",
    "predicted_samples_per_s",
    "predicted_tokens_per_s_per_gpu",
    "predicted_mfu",
)
"""The fields :func:`predict` adds (all ``None`` for a row with nothing to predict from)."""


def _calls(
    strategy: str,
    kind: str,
    nbytes: float,
    calls: Mapping[str, int],
    knobs: Mapping[str, Any],
    bucket_cap_mb: float | None,
) -> int:
    """How many collectives of ``kind`` the step issues (a latency each): DDP's buckets."""
    if strategy == "ddp":
        rest = max(0.0, nbytes - DDP_FIRST_BUCKET_BYTES)
        return 1 + math.ceil(rest / _bucket_cap_bytes(knobs, bucket_cap_mb))
    return max(1, int(calls.get(kind) or 1))


def _bucket_cap_bytes(knobs: Mapping[str, Any], bucket_cap_mb: float | None) -> float:
    """The cap asked for, else the row's knob, else torch's default, in bytes."""
    return float(bucket_cap_mb or knobs.get("bucket_cap_mb") or DEFAULT_BUCKET_CAP_MB) * 2**20


def _last_bucket_bytes(
    nbytes: float, knobs: Mapping[str, Any], bucket_cap_mb: float | None
) -> float:
    """The bytes of DDP's last bucket: what is left after the first (1 MiB) and the full ones."""
    cap = _bucket_cap_bytes(knobs, bucket_cap_mb)
    rest = max(0.0, nbytes - DDP_FIRST_BUCKET_BYTES)
    return (rest - cap * math.floor((rest - 1) / cap)) if rest > 0 else nbytes


def _fsdp_exposed(
    comm: Mapping[str, float],
    calls: Mapping[str, int],
    knobs: Mapping[str, Any],
    forward: float,
    backward: float,
    micro: int,
    sizes: Sequence[int] = (),
    sync_every: bool = False,
) -> float:
    """Unit by unit: gathers one unit ahead, reduce-scatters (and replica all-reduces) behind.

    The units are the all-gathers of a micro-step (halved with ``reshard_after_forward``,
    rounded up: a root that stays gathered after forward is gathered once). Each gather takes
    its share of the gather time by its own size (``sizes``: the fake step's all-gathers in
    the order issued; the root's first, and a Llama's root, embedding and head, is ~5 blocks);
    without them, every gather is the average one. Forward: the first gather has nothing to
    hide behind, each next one hides behind the unit before. Backward, when every unit was
    resharded (twice as many gathers as units): the same, in reverse order, each also carrying
    the reduce-scatter (and replica all-reduce) of the unit before on the last micro-step.
    """
    gathers = sum(v for k, v in comm.items() if k.startswith("all_gather"))
    scatters = sum(v for k, v in comm.items() if k.startswith("reduce_scatter"))
    reduces = sum(v for k, v in comm.items() if k.startswith("all_reduce"))
    if gathers + scatters + reduces == 0:
        return 0.0
    reshard = knobs.get("reshard_after_forward", True) is not False
    gather_calls = max(1, int(calls.get("all_gather") or 1) // micro)
    units = max(1, math.ceil(gather_calls / 2) if reshard else gather_calls)
    per_micro = gathers / micro
    mine = list(sizes[:gather_calls])
    if len(mine) == gather_calls and sum(mine) > 0:
        times = [per_micro * size / sum(mine) for size in mine]
    else:
        times = [per_micro / gather_calls] * gather_calls
    fwd_gathers = times[:units]
    bwd_gathers = times[units:] if reshard else []
    unit_fwd, unit_bwd = forward / units, backward / units
    r_s, a_r = scatters / units, reduces / units  # the last micro-step only
    if sync_every:  # every micro-step reduces (grad_accum_sync=every): each is a last one
        r_s, a_r = r_s / micro, a_r / micro
    exposed_fwd = fwd_gathers[0] + sum(max(0.0, g - unit_fwd) for g in fwd_gathers[1:])
    # Backward: units in reverse; a unit that was not regathered (the root) waits for none.
    first_backward = bwd_gathers[0] if len(bwd_gathers) == units else 0.0
    rest = bwd_gathers[1:] if first_backward else bwd_gathers
    rest = rest + [0.0] * (units - 1 - len(rest))
    last = first_backward + sum(max(0.0, g + r_s + a_r - unit_bwd) for g in rest) + r_s + a_r
    early = first_backward + sum(max(0.0, g - unit_bwd) for g in rest)  # no reduction
    if sync_every:
        return micro * (exposed_fwd + last)
    return micro * exposed_fwd + last + (micro - 1) * early


def _compute_ms(
    row: Mapping[str, Any], model: TimeModel
) -> tuple[float, float, str | None, float | None]:
    """The step's compute and its optimizer part (ms), their source, and their peak FLOP/s.

    A ``None`` source: nothing to predict from (no calibration of the model, no FLOPs).
    """
    strategy = row["strategy"]
    world = int(row["world_size"])
    shard = 1
    if strategy == "fsdp":
        shard = world
    elif strategy == "hsdp":
        shard = min(world, model.gpus_per_node)
    knobs = dict(row.get("knobs") or {})
    bf16 = knobs.get("param_dtype") == "bf16"
    peak = model.bf16_peak if bf16 and model.bf16_peak else model.peak_flops
    calibrated = model.points.get(point_key(row))
    if calibrated is not None:
        optimizer = calibrated["optimizer_ms"] / shard
        compute = calibrated["step_ms"] - calibrated["optimizer_ms"] + optimizer
        return compute, optimizer, "calibration: this point at world size 1", peak
    mode = checkpoint_mode(knobs)
    samples = float(row["batch_size"])
    params = (knobs.get("param_dtype") or "fp32",)
    for ckpt in dict.fromkeys((mode, None)):
        for param_dtype in (*params, "fp32")[: 1 if params[0] == "fp32" else 2]:
            found = model.models.get((row["model"], row.get("dtype"), param_dtype, ckpt))
            if found is None:
                continue
            optimizer = found["optimizer_ms"] / shard
            work = found["ms_per_sample"] * samples
            if mode == "full" and ckpt is None:
                work *= 1 + FORWARD_SHARE  # the forward again (selective: matmuls kept)
            source = "calibration: this model's compute_ms"
            if param_dtype != params[0]:
                source += f" in {param_dtype} (none measured in {params[0]})"
            return work + optimizer, optimizer, source, peak
    flops = row.get("flops_per_sample")
    if not flops or not model.flops_rate:
        return 0.0, 0.0, None, peak
    rate = model.flops_rate
    if model.bf16_rate and bf16:
        rate = model.bf16_rate
    work = flops * samples / rate * 1e3
    if mode == "full" and model.calibrated:  # a measured rate has no recompute in it; a
        work *= 1 + FORWARD_SHARE  # published MFU has (DATASHEET_MFU)
    optimizer = 0.0
    if model.optimizer_bytes_per_s:  # AdamW streams ~28 bytes per fp32 parameter
        optimizer = ADAMW_BYTES_PER_PARAM * float(row.get("params") or 0) / shard
        optimizer = optimizer / model.optimizer_bytes_per_s * 1e3
    source = "FLOPs at the calibration's rate" if model.calibrated else "FLOPs at peak x MFU"
    return work + optimizer, optimizer, source, peak


ADAMW_BYTES_PER_PARAM = 28
"""Bytes AdamW moves per fp32 parameter: reads the parameter, its gradient and two moments,
writes the parameter and the moments (7 x 4 bytes), at the memory's bandwidth."""
