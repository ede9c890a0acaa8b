"""``results.json``: the environment and one row per configuration, merged over ranks."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from strategy_bench.measure import peak_flops, summarize
from strategy_bench.results._rows import OK, ok_rows

SCHEMA = 2
"""Written now; :func:`read_results` also reads schema 1 (rows without ``status``)."""
SCHEMAS = (1, 2)
REQUIRED_ROW_KEYS = (
    "strategy",
    "model",
    "world_size",
    "backend",
    "init_ms",
    "wrap_ms",
    "raw_wrap_ms",
    "step_ms_median",
    "step_ms_p10",
    "step_ms_p90",
    "samples_per_s",
    "tokens_per_s",
    "peak_mem_bytes",
    "mfu",
)


MEMORY_KINDS = ("param", "grad", "optimizer", "ddp_bucket", "activation_peak")
"""The kinds of per-rank memory a row records, as ``<kind>_bytes`` (activations last: the
others are the static memory). Rows written before ``ddp_bucket`` lack it (read as 0)."""


def byte_unit(largest: float) -> tuple[str, int]:
    """The unit to show sizes up to ``largest`` bytes in: ``("GiB", 2**30)`` or ``("MiB", ...)``."""
    return ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)


def device_name(device: torch.device) -> str:
    """The GPU's name (what the datasheet table is matched against), or the CPU's."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return name or platform.machine()


def environment(
    device: torch.device,
    backend: str,
    world_size: int,
    *,
    dtype: str = "fp32",
    peak_tflops: float | None = None,
    matmul_flops: float | None = None,
) -> dict[str, Any]:
    """What the numbers were measured on, and the two MFU denominators.

    ``peak_flops`` is the per-rank peak from ``--peak-tflops`` or the datasheet table for the
    device and ``dtype`` (``peak_flops_source`` says which, ``None`` when neither applies);
    ``matmul_flops`` is the square-matmul rate measured once in this run on CUDA.
    """
    name = device_name(device)
    peak, source = peak_flops(name, dtype, peak_tflops)
    return {
        **host_environment(),
        "backend": backend,
        "device": device.type,
        "device_name": name,
        "world_size": world_size,
        "cpu_threads": torch.get_num_threads(),
        "peak_flops": peak,
        "peak_flops_source": source,
        "matmul_flops": matmul_flops,
    }


def host_environment() -> dict[str, Any]:
    """What every results file records of where it was made: versions, revision, host, time."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git": git_revision(),
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def merge_ranks(
    per_rank: Sequence[Mapping[str, Any]],
    *,
    strategy: str,
    model: str,
    knobs: Mapping[str, Any],
    env: Mapping[str, Any],
    batch_size: int,
    dtype: str,
    tokens_per_sample: int | None,
    analytic_flops_per_sample: float | None,
) -> dict[str, Any]:
    """One results row from every rank's measurements.

    Times are the slowest rank's (a step ends when the last rank ends it); memory is the
    largest rank's, with every rank's value kept in ``peak_mem_per_rank``.
    """
    world = len(per_rank)
    steps = [max(values) for values in zip(*(r["step_ms"] for r in per_rank), strict=True)]
    stats = summarize(steps)
    samples_per_s = batch_size * world / (stats["median"] / 1e3)
    flops_per_sample = per_rank[0].get("flops_per_sample")
    achieved = None if flops_per_sample is None else flops_per_sample * samples_per_s / world
    peak, matmul = env.get("peak_flops"), env.get("matmul_flops")
    cold = _slowest_rank(per_rank, "wrap_cold_ms_all")
    raw_cold = _slowest_rank(per_rank, "raw_wrap_cold_ms_all")
    wrap_ms = max(r["wrap_ms"] for r in per_rank)
    raw_wrap_ms = max(r["raw_wrap_ms"] for r in per_rank)
    # The tracked step's peak: the largest rank's, with what made it and its timeline.
    tracked = max(per_rank, key=lambda r: r.get("tracked_peak_bytes") or 0)
    row: dict[str, Any] = {
        "status": OK,
        "strategy": strategy,
        "model": model,
        "world_size": world,
        "backend": env["backend"],
        "device": env["device"],
        "dtype": dtype,
        "batch_size": batch_size,
        "tokens_per_sample": tokens_per_sample,
        "params": per_rank[0]["params"],
        "trainable_params": per_rank[0]["trainable_params"],
        "knobs": dict(knobs),
        "init_ms": max(r["init_ms"] for r in per_rank),
        "init_rank0_ms": _max_or_none(per_rank, "init_rank0_ms"),
        "init_host_peak_per_rank": [r["init_host_peak_bytes"] for r in per_rank],
        "init_rank0_host_peak_per_rank": [r.get("init_rank0_host_peak_bytes") for r in per_rank],
        "init_device_peak_per_rank": [r.get("init_device_peak_bytes") for r in per_rank],
        "init_rank0_device_peak_per_rank": [
            r.get("init_rank0_device_peak_bytes") for r in per_rank
        ],
        "wrap_ms": wrap_ms,
        "raw_wrap_ms": raw_wrap_ms,
        "wrap_overhead": wrap_ms / raw_wrap_ms if raw_wrap_ms > 0 else None,
        "wrap_cold_ms": statistics.median(cold),
        "raw_wrap_cold_ms": statistics.median(raw_cold),
        "wrap_cold_ms_all": cold,
        "raw_wrap_cold_ms_all": raw_cold,
        "step_ms_median": stats["median"],
        "compile_s": _compile_s(per_rank, stats["median"]),
        "step_ms_p10": stats["p10"],
        "step_ms_p90": stats["p90"],
        "step_ms": steps,
        "compute_ms": _max_or_none(per_rank, "compute_ms"),
        "optimizer_ms": _max_or_none(per_rank, "optimizer_ms"),
        "samples_per_s": samples_per_s,
        "tokens_per_s": None if tokens_per_sample is None else samples_per_s * tokens_per_sample,
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in per_rank),
        "host_bytes": _max_or_none(per_rank, "host_bytes"),
        "peak_mem_per_rank": [r["peak_mem_bytes"] for r in per_rank],
        "peak_reserved_bytes": max(r["peak_reserved_bytes"] for r in per_rank),
        "peak_reserved_per_rank": [r["peak_reserved_bytes"] for r in per_rank],
        "tracked_peak_bytes": tracked.get("tracked_peak_bytes"),
        "tracked_peak_per_rank": [r.get("tracked_peak_bytes") for r in per_rank],
        "allocator_peak_bytes": tracked.get("allocator_peak_bytes"),
        "peak_phase": tracked.get("peak_phase"),
        "peak_parts_bytes": tracked.get("peak_parts_bytes"),
        "memory_timeline": tracked.get("memory_timeline"),
        **{
            f"{kind}_bytes": max(r.get(f"{kind}_bytes", 0) for r in per_rank)
            for kind in MEMORY_KINDS
        },
        **_checkpoint_samples(per_rank),
        "ckpt_bytes": per_rank[0].get("ckpt_bytes"),
        "ckpt_error": per_rank[0].get("ckpt_error"),
        **{
            f"{kind}_bytes_per_rank": [r.get(f"{kind}_bytes", 0) for r in per_rank]
            for kind in MEMORY_KINDS
        },
        "comm_bytes_per_step": per_rank[0]["comm_bytes_per_step"],
        "comm_calls_per_step": per_rank[0]["comm_calls_per_step"],
        "comm_bytes_by_dim": per_rank[0].get("comm_bytes_by_dim"),
        "comm_bytes_by_dtype": per_rank[0].get("comm_bytes_by_dtype"),
        "flops_per_sample": flops_per_sample,
        "analytic_flops_per_sample": analytic_flops_per_sample,
        "achieved_flops_per_rank": achieved,
        "mfu": achieved / peak if achieved is not None and peak else None,
        "mfu_vs_matmul": achieved / matmul if achieved is not None and matmul else None,
    }
    return row


def _compile_s(per_rank: Sequence[Mapping[str, Any]], step_ms: float) -> float | None:
    """Seconds the first step took beyond a steady one (the compile), or ``None``."""
    first = _max_or_none(per_rank, "first_step_ms")
    return None if first is None else max(0.0, first - step_ms) / 1e3


def _checkpoint_samples(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each checkpoint timing: the median over samples of the slowest rank, and the samples.

    A collective save or load ends when its last rank ends it. A row without samples (an
    older results file) keeps the slowest rank's single figure.
    """
    out: dict[str, Any] = {}
    for key in ("ckpt_save_ms", "raw_ckpt_save_ms", "ckpt_load_ms", "ckpt_async_stall_ms"):
        if all(r.get(f"{key}_all") for r in per_rank):
            slowest = _slowest_rank(per_rank, f"{key}_all")
            out[key] = statistics.median(slowest)
            out[f"{key}_all"] = slowest
        else:
            out[key] = _max_or_none(per_rank, key)
    return out


def _slowest_rank(per_rank: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    """Sample by sample, the slowest rank's value (a wrap ends when the last rank ends it)."""
    return [max(values) for values in zip(*(r[key] for r in per_rank), strict=True)]


def write_results(
    path: Path,
    env: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    *,
    skipped: Sequence[Mapping[str, Any]] = (),
) -> None:
    """Write ``{"schema", "env", "results", "skipped"}`` as indented JSON, atomically.

    The text goes to a temporary file beside ``path`` that then replaces it, so a crash or
    Ctrl-C leaves either the previous complete file or the new one, never half of one.
    """
    payload = {
        "schema": SCHEMA,
        "env": dict(env),
        "results": [dict(r) for r in rows],
        "skipped": [dict(s) for s in skipped],
    }
    write_json_atomic(path, payload)


def write_json_atomic(path: Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` as indented JSON: to a temporary file beside ``path``, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def read_results(path: Path) -> dict[str, Any]:
    """Load and check a results file.

    Raises:
        ValueError: If the file is not a strategy-bench results file of a known schema.
    """
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read results file {str(path)!r}: {error}") from None
    if not isinstance(payload, dict) or payload.get("schema") not in SCHEMAS:
        raise ValueError(
            f"{str(path)!r} is not a strategy-bench results file of schema "
            f"{' or '.join(map(str, SCHEMAS))} "
            f"(schema: {payload.get('schema') if isinstance(payload, dict) else None!r})"
        )
    for row in ok_rows(payload.get("results", [])):
        missing = [key for key in REQUIRED_ROW_KEYS if key not in row]
        if missing:
            raise ValueError(f"{str(path)!r}: a result row lacks {missing}")
    return payload


def _max_or_none(per_rank: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r[key] for r in per_rank if r.get(key) is not None]
    return max(values) if values else None


def git_revision() -> str | None:
    """The short git revision of the working directory, or ``None`` outside a checkout."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None
