"""What the time model reads: links, compute rates and their sources, from datasheets or a run.

``--calibrate`` builds it from ``run`` results on the target kind of host (world-size-1 steps,
``compute_ms``, the communication probe); without it, ``--gpu`` builds it from the datasheet's
peak times ``--assumed-mfu`` and per-GPU link bandwidths. :mod:`._time_model` predicts with it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from strategy_bench._errors import BenchUsageError
from strategy_bench.measure import PROBE_KINDS, datasheet_peak
from strategy_bench.workload import checkpoint_mode, knob_key

logger = logging.getLogger(__name__)

DEFAULT_ASSUMED_MFU = 0.4
"""The MFU assumed for a GPU without a published record (:data:`DATASHEET_MFU`)."""

DATASHEET_MFU: dict[str, tuple[float, str]] = {
    "B200": (
        DEFAULT_ASSUMED_MFU,
        "no published bf16 FSDP MFU found for B200; H100's figure assumed",
    ),
    "H200": (
        0.44,
        "KempnerForge benchmarks/mfu_scaling: 13B, FSDP over 8 H200, 44.4% MFU",
    ),
    "H100": (
        0.40,
        "LLM Foundry scripts/train/benchmarking/README.md, H100: MPT-7B/13B/70B FSDP "
        "39.6-46.4% MFU; torchtitan docs/performance.md: Llama 3.1 8B FSDP 33-39%",
    ),
    "A100-80GB": (
        0.55,
        "LLM Foundry scripts/train/benchmarking/README.md, A100-80GB: MPT-7B/13B/70B FSDP "
        "53-64% MFU; torchtitan docs/performance.md: Llama 2/3 on 64 A100s 50.5-58.2%",
    ),
    "A100-40GB": (
        0.55,
        "as A100-80GB (the same chip): LLM Foundry and torchtitan, 50.5-64% MFU",
    ),
    "L40S": (DEFAULT_ASSUMED_MFU, "no published FSDP MFU found for L40S; assumed"),
    "A10G": (DEFAULT_ASSUMED_MFU, "no published FSDP MFU found for A10G; assumed"),
    "L4": (DEFAULT_ASSUMED_MFU, "no published FSDP MFU found for L4; assumed"),
}
"""The MFU a step reaches per GPU type when nothing was measured, and its published source.

MFU as these sources publish it: the step's model FLOPs (forward and backward, no
recompute) per second over the dense bf16 peak. Published runs report it alike with and
without activation checkpointing (LLM Foundry's 13B on H100: 39.8% without, 41-42% with,
whose hardware utilisation is 55%): the recompute's cost is inside the figure. So on the
datasheet path a checkpointed step is predicted at the same MFU as one without.
"""

DEFAULT_INTER_NODE_GBPS = 400.0
"""Network bandwidth per GPU across nodes, Gb/s: one 400 Gb/s NIC per GPU (InfiniBand NDR or
400 GbE), the usual H100/H200 cluster."""

DATASHEET_NVLINK_GBS: dict[str, float] = {
    "B200": 900.0,
    "H200": 450.0,
    "H100": 450.0,
    "A100-80GB": 300.0,
    "A100-40GB": 300.0,
    "L40S": 32.0,
    "A10G": 32.0,
    "L4": 32.0,
}
"""Per-GPU bandwidth inside a node, GB/s each way: NVLink 5 (1.8 TB/s both ways), NVLink 4
(900 GB/s), NVLink 3 (600 GB/s); PCIe 4.0 x16 for the cards without NVLink."""

DATASHEET_HBM_GBS: dict[str, float] = {
    "B200": 8000.0,
    "H200": 4800.0,
    "H100": 3350.0,
    "A100-80GB": 2039.0,
    "A100-40GB": 1555.0,
    "L40S": 864.0,
    "A10G": 600.0,
    "L4": 300.0,
}
"""Memory bandwidth per GPU, GB/s (datasheets): what the optimizer step streams at."""

DATASHEET_HOST_LINK_GBS: dict[str, float] = {
    "B200": 64.0,
    "H200": 64.0,
    "H100": 64.0,
    "A100-80GB": 32.0,
    "A100-40GB": 32.0,
    "L40S": 32.0,
    "A10G": 32.0,
    "L4": 32.0,
}
"""Host link per GPU, GB/s each way (datasheets): PCIe 5.0 x16 for Hopper and Blackwell,
PCIe 4.0 x16 for Ampere and Ada."""

HOST_LINK_EFFICIENCY = 0.8
"""The share of the link's rate that pinned copies reach (assumed: 50-55 GB/s measured of
PCIe 5.0's 64 is what copy benchmarks on H100 hosts commonly report)."""

HOST_OPTIMIZER_GBS = 50.0
"""Host memory bandwidth per rank that a fused CPU AdamW step streams at, GB/s (assumed: a
two-socket host's 400-600 GB/s of DRAM bandwidth shared by 8 GPUs, at about two thirds)."""


DEFAULT_LATENCY_US = {"intra_node": 10.0, "inter_node": 20.0}
"""Per-collective latency assumed without a probe (small-message NCCL on NVLink and IB)."""


@dataclasses.dataclass(frozen=True)
class TimeModel:
    """What a prediction reads: links, compute, peak, and where each came from.

    Attributes:
        links: ``{"intra_node" | "inter_node": {collective: {"latency_us", "busbw_gbps"}}}``.
        points: Calibrated world-size-1 rows by :func:`point_key` (``step_ms_median``,
            ``optimizer_ms``).
        models: Calibrated unwrapped steps by ``(model, dtype, param_dtype, checkpointing)``
            (``checkpointing``: ``"full"``, ``"selective"`` or ``None``):
            ``ms_per_sample`` (without the optimizer) and ``optimizer_ms``.
        flops_rate: FLOP/s per rank for models not calibrated (``None``: unknown).
        peak_flops: The MFU denominator per rank (``None``: no peak known).
        overlap: Whether communication runs behind compute (GPUs: copy engines and NCCL's
            own SMs); ``False`` exposes all of it (a CPU host: gloo on the compute's cores).
        bf16_peak: The peak that ``bf16_rate`` is a share of (its MFU's denominator).
        optimizer_bytes_per_s: The memory bandwidth AdamW's step streams at, where no
            calibration measured it (``None``: the optimizer is not counted).
        host_link_bytes_per_s: Offload's host-device copies (``None``: not counted).
        host_optimizer_bytes_per_s: The host memory bandwidth an offloaded AdamW streams at
            (``None``: the optimizer is timed as on the device).
        calibrated: Whether it comes from a run (``--calibrate``) rather than datasheets.
        bf16_rate: FLOP/s of a point that computes in bf16 under an fp32 run (FSDP's
            ``param_dtype``), from the datasheet's bf16 peak (``None``: as ``flops_rate``).
        gpus_per_node: Ranks per node.
        sources: Every assumption and where it came from (``env.time_model``).
    """

    links: dict[str, dict[str, dict[str, float]]]
    points: dict[tuple[Any, ...], dict[str, float]]
    models: dict[tuple[Any, ...], dict[str, float]]
    flops_rate: float | None
    peak_flops: float | None
    gpus_per_node: int
    sources: dict[str, Any]
    bf16_rate: float | None = None
    overlap: bool = True
    bf16_peak: float | None = None
    optimizer_bytes_per_s: float | None = None
    calibrated: bool = False
    host_link_bytes_per_s: float | None = None
    host_optimizer_bytes_per_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        """``env.time_model``: the links and rates used, and every source."""
        return {
            "links": self.links,
            "flops_rate": self.flops_rate,
            "peak_flops": self.peak_flops,
            "gpus_per_node": self.gpus_per_node,
            "calibrated_points": len(self.points),
            "overlap": self.overlap,
            "calibrated_models": sorted({key[0] for key in self.models}),
            "sources": self.sources,
        }


def point_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """A point without its world size: model, strategy, knobs, batch per rank, dtype."""
    knobs = knob_key(row.get("knobs") or {})
    return row["model"], row["strategy"], knobs, row.get("batch_size"), row.get("dtype")


def _uniform(latency_us: float, busbw_gbps: float) -> dict[str, dict[str, float]]:
    return {kind: {"latency_us": latency_us, "busbw_gbps": busbw_gbps} for kind in PROBE_KINDS}


def default_mfu(gpu: str) -> tuple[float, str]:
    """The MFU assumed for ``gpu`` (a :data:`DATASHEET_MFU` name) and its source."""
    return DATASHEET_MFU.get(gpu, (DEFAULT_ASSUMED_MFU, f"no published MFU for {gpu}; assumed"))


def datasheet_model(
    gpu: str | None,
    dtype: str,
    *,
    assumed_mfu: float | None,
    inter_node_gbps: float | None,
    gpus_per_node: int,
) -> TimeModel | None:
    """The time model from datasheets: ``None`` without a known ``--gpu``.

    ``assumed_mfu``: ``None`` takes the GPU's published figure (:func:`default_mfu`).

    Raises:
        BenchUsageError: An ``assumed_mfu`` outside (0, 1], or a GPU whose peak in ``dtype``
            the FLOPs table lacks.
    """
    if gpu is None:
        return None
    if assumed_mfu is None:
        assumed_mfu, mfu_source = default_mfu(gpu)
        mfu_text = f"MFU {assumed_mfu:g} (the {gpu} default: {mfu_source})"
    else:
        _check_mfu(assumed_mfu)
        mfu_text = f"--assumed-mfu {assumed_mfu:g}"
    found = datasheet_peak(gpu, dtype)
    if found is None:
        logger.warning(
            "--gpu %s: no datasheet peak for --dtype %s, so no step time; give --calibrate "
            "RESULTS.json from a run on that GPU, or --dtype bf16",
            gpu,
            dtype,
        )
        return None
    peak, peak_source = found
    bf16 = datasheet_peak(gpu, "bf16")
    memory = DATASHEET_HBM_GBS[gpu] * 1e9
    intra = DATASHEET_NVLINK_GBS[gpu]
    inter = DEFAULT_INTER_NODE_GBPS if inter_node_gbps is None else inter_node_gbps
    return TimeModel(
        links={
            "intra_node": _uniform(DEFAULT_LATENCY_US["intra_node"], intra),
            "inter_node": _uniform(DEFAULT_LATENCY_US["inter_node"], inter / 8),
        },
        points={},
        models={},
        flops_rate=peak * assumed_mfu,
        peak_flops=peak,
        bf16_rate=None if bf16 is None else bf16[0] * assumed_mfu,
        bf16_peak=None if bf16 is None else bf16[0],
        optimizer_bytes_per_s=memory,
        host_link_bytes_per_s=host_link_bytes_per_s(gpu),
        host_optimizer_bytes_per_s=HOST_OPTIMIZER_GBS * 1e9,
        gpus_per_node=gpus_per_node,
        sources={
            **host_sources(gpu),
            "compute": f"{peak_source} x {mfu_text}; MFU counts no recompute, so a "
            "checkpointed step is predicted at the same MFU (published runs report it alike)",
            "optimizer": f"AdamW's 28 bytes per parameter (over the shard) at {gpu}'s "
            f"{DATASHEET_HBM_GBS[gpu]:g} GB/s of memory bandwidth (datasheet)",
            "intra_node": f"datasheet: {gpu} {intra:g} GB/s per GPU each way, "
            f"{DEFAULT_LATENCY_US['intra_node']:g} us per collective (assumed)",
            "inter_node": _inter_source(inter_node_gbps),
        },
    )


NODE_SPANNING_RULE = (
    "a group that spans nodes gets bus bandwidth min(intra-node, its ranks per node x the "
    "per-GPU figure): a NCCL ring over whole nodes spreads its channels over every NIC of the "
    "node; HSDP's replicate groups (one rank per node) get one NIC's"
)


def _inter_source(inter_node_gbps: float | None) -> str:
    given = "--inter-node-gbps" if inter_node_gbps is not None else "default"
    gbps = DEFAULT_INTER_NODE_GBPS if inter_node_gbps is None else inter_node_gbps
    return (
        f"{given}: {gbps:g} Gb/s per GPU, {DEFAULT_LATENCY_US['inter_node']:g} us per "
        f"collective (assumed); {NODE_SPANNING_RULE}"
    )


def _check_mfu(assumed_mfu: float) -> None:
    if not 0 < assumed_mfu <= 1:
        raise BenchUsageError(f"--assumed-mfu must be in (0, 1], got {assumed_mfu:g}")


def calibrated_model(
    payloads: Sequence[Mapping[str, Any]],
    *,
    inter_node_gbps: float | None,
    gpus_per_node: int,
    names: Sequence[str] = (),
) -> TimeModel:
    """The time model from ``run`` results on the target kind of host (``--calibrate``).

    Compute comes from the measured rows, the fewest ranks first: a point's whole step at
    world size 1, and each model's ``compute_ms`` (the step without communication, at any
    world size: at several ranks per host it includes their contention for the host).
    Links come from the ``env.comm_probe`` of a run with two ranks or more (the first one
    found); one that spanned one node stands for inter-node links too, unless
    ``inter_node_gbps`` is given (said in ``sources``). On a CPU host the communication is not
    overlapped (``overlap``).

    Raises:
        BenchUsageError: No row with ``compute_ms``, or no probe.
    """
    points: dict[tuple[Any, ...], dict[str, float]] = {}
    models: dict[tuple[Any, ...], dict[str, float]] = {}
    rates: list[tuple[float, float]] = []  # (FLOPs per step, FLOP/s)
    probe: Mapping[str, Any] | None = None
    probe_from = ""
    measured: list[tuple[Mapping[str, Any], Mapping[str, Any]]] = []
    for name, payload in zip(names or [""] * len(payloads), payloads, strict=True):
        env = payload.get("env", {})
        if probe is None and env.get("comm_probe"):
            probe, probe_from = env["comm_probe"], name
        measured += [
            (row, env)
            for row in payload.get("results", [])
            if row.get("status") == "ok" and row.get("compute_ms") is not None
        ]
    if not measured:
        raise BenchUsageError(
            "--calibrate: no measured point with compute_ms in these results; run "
            "`strategy-bench run --world-size 1` on the target kind of host first"
        )
    measured.sort(key=lambda pair: int(pair[0]["world_size"]))  # the fewest ranks first
    _, first_env = measured[0]
    for row, _env in measured:
        optimizer = float(row.get("optimizer_ms") or 0.0)
        if row["world_size"] == 1:  # the whole step, with no one to talk to
            step = {"step_ms": float(row["step_ms_median"]), "optimizer_ms": optimizer}
            points.setdefault(point_key(row), step)
        checkpointed = checkpoint_mode(row["knobs"])
        per_sample = (float(row["compute_ms"]) - optimizer) / row["batch_size"]
        param_dtype = row["knobs"].get("param_dtype") or "fp32"
        key = (row["model"], row.get("dtype"), param_dtype, checkpointed)
        models.setdefault(key, {"ms_per_sample": per_sample, "optimizer_ms": optimizer})
        if row.get("flops_per_sample") and not checkpointed and per_sample > 0:
            flops = float(row["flops_per_sample"])
            rates.append((flops * row["batch_size"], flops / (per_sample / 1e3)))
    threads, peak = first_env.get("cpu_threads"), first_env.get("peak_flops")
    overlap = first_env.get("device") != "cpu"
    if probe is None or not probe.get("intra_node"):
        raise BenchUsageError(
            "--calibrate: no communication probe (env.comm_probe) in these results; add a run "
            "on two ranks or more (`strategy-bench run --world-size 2`, its probe is timed first)"
        )
    links = {"intra_node": _links(probe["intra_node"])}
    sources: dict[str, Any] = {
        "compute": "calibration: the same point at world size 1, else the model's compute_ms "
        "there, else the largest calibrated model's FLOP/s",
        "cpu_threads": threads,
        "intra_node": f"calibration: comm_probe of {probe_from or 'the run'} "
        f"({next(iter(probe['intra_node'].values()))['ranks']} ranks, sizes "
        f"{' '.join(f'{mib:g}' for mib in probe.get('sizes_mib', []))} MiB)",
    }
    if inter_node_gbps is not None:
        links["inter_node"] = _uniform(DEFAULT_LATENCY_US["inter_node"], inter_node_gbps / 8)
        sources["inter_node"] = _inter_source(inter_node_gbps)
    elif probe.get("inter_node"):
        links["inter_node"] = _links(probe["inter_node"])
        sources["inter_node"] = f"calibration: comm_probe across nodes; {NODE_SPANNING_RULE}"
    else:
        links["inter_node"] = links["intra_node"]
        sources["inter_node"] = (
            "calibration: the probe spanned one node; its links stand for inter-node ones "
            "(give --inter-node-gbps for a network)"
        )
    if not overlap:
        sources["overlap"] = (
            "none: the calibration ran on CPU, where gloo's communication runs on the cores "
            "the compute uses"
        )
    rate = max(rates)[1] if rates else None
    return TimeModel(
        links, points, models, rate, peak, gpus_per_node, sources, overlap=overlap, calibrated=True
    )


def _links(fits: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    return {
        kind: {"latency_us": float(fit["latency_us"]), "busbw_gbps": float(fit["busbw_gbps"])}
        for kind, fit in fits.items()
        if kind in PROBE_KINDS
    }


def host_link_bytes_per_s(gpu: str) -> float | None:
    """The pinned-copy rate of ``gpu``'s host link, bytes/s (``None``: not in the table)."""
    gbs = DATASHEET_HOST_LINK_GBS.get(gpu)
    return None if gbs is None else gbs * HOST_LINK_EFFICIENCY * 1e9


def host_sources(gpu: str) -> dict[str, str]:
    """Where the offload rates come from (``env.time_model.sources``)."""
    link = DATASHEET_HOST_LINK_GBS.get(gpu)
    return {
        "host_link": (
            "no host link known for this GPU: offload's copies not counted"
            if link is None
            else f"datasheet: {gpu} {link:g} GB/s each way x {HOST_LINK_EFFICIENCY:g} "
            "(pinned copies, assumed); H2D and D2H summed, all exposed (the bound)"
        ),
        "host_optimizer": f"offload: AdamW on the host at {HOST_OPTIMIZER_GBS:g} GB/s per "
        "rank (assumed: a two-socket host's DRAM bandwidth shared by 8 GPUs)",
    }
