"""PNG plots of one or several results files, readable without the JSON."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from strategy_bench.report._figure import COLOURS, KIND_NAMES, bars, pyplot, save, width
from strategy_bench.results import MEMORY_KINDS, knob_text, ok_rows
from strategy_bench.workload import step_knobs


def run_label(payload: Mapping[str, Any]) -> str:
    """A short name for a run: device, world size, backend."""
    env = payload["env"]
    return f"{env.get('device_name') or env['device']} x{env['world_size']} ({env['backend']})"


def plot_runs(runs: Sequence[tuple[str, Mapping[str, Any]]], out_dir: Path) -> list[Path]:
    """Draw every plot for one or several runs side by side; return the PNG paths.

    Args:
        runs: ``(label, results payload)`` pairs.
        out_dir: Where the PNGs go.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = [
        _throughput(runs, out_dir / "throughput.png"),
        _wrap_overhead(runs, out_dir / "wrap_overhead.png"),
        _memory(runs, out_dir / "memory.png"),
        _step_spread(runs, out_dir / "step_spread.png"),
        _init(runs, out_dir / "init_time.png"),
        _memory_breakdown(runs, out_dir / "memory_breakdown.png"),
        _checkpoint(runs, out_dir / "checkpoint.png"),
    ]
    return [path for path in drawn if path is not None]


def _rows(runs: Sequence[tuple[str, Mapping[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    return [(label, row) for label, payload in runs for row in ok_rows(payload["results"])]


def _series_label(label: str, row: Mapping[str, Any], multi: bool) -> str:
    """Strategy, its non-default knobs (sweeps), and the run when several are compared."""
    name = row["strategy"].upper()
    if row.get("knobs"):
        name += " " + knob_text(row["knobs"])
    return f"{name} - {label}" if multi else name


def _points(
    runs: Sequence[tuple[str, Mapping[str, Any]]], needs: str | None = None
) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """The measured rows (those with ``needs``, e.g. schema 2 fields) and a bar label each."""
    rows = [
        (label, row) for label, row in _rows(runs) if needs is None or row.get(needs) is not None
    ]
    multi = len(runs) > 1
    return rows, [f"{row['model']}\n{_series_label(label, row, multi)}" for label, row in rows]


def _point_figure(groups: Sequence[str]) -> tuple[Any, Any]:
    """A figure wide enough for one bar group per point."""
    fig, ax = pyplot().subplots(figsize=(max(7, 1.8 * len(groups)), 4.8))
    return fig, ax


def _grouped(
    runs: Sequence[tuple[str, Mapping[str, Any]]], value: Callable[[dict[str, Any]], float | None]
) -> tuple[list[str], dict[str, list[float | None]]]:
    """Models on the x axis, one series per (run, strategy)."""
    rows = _rows(runs)
    models = list(dict.fromkeys(row["model"] for _, row in rows))
    multi = len(runs) > 1
    series: dict[str, list[float | None]] = {}
    for label, row in rows:
        name = _series_label(label, row, multi)
        values = series.setdefault(name, [None] * len(models))
        values[models.index(row["model"])] = value(row)
    return models, series


def _throughput(runs: Sequence[tuple[str, Mapping[str, Any]]], path: Path) -> Path:
    models, series = _grouped(runs, lambda row: row["samples_per_s"])
    fig, ax = pyplot().subplots(figsize=(width(len(models), len(series)), 4.5))
    bars(ax, models, series, annotate=lambda v: f"{v:.0f}")
    ax.set_ylabel("samples / s (all ranks, higher is better)")
    ratios = _fsdp_over_ddp(runs)
    subtitle = "; ".join(f"{m}: FSDP/DDP {r:.2f}x" for m, r in ratios.items())
    ax.set_title(f"Training throughput, DDP vs FSDP\n{subtitle}", fontsize=10)
    return save(fig, path)


def _fsdp_over_ddp(runs: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, float]:
    payload = runs[0][1]
    by = {
        (r["model"], r["strategy"]): r["samples_per_s"]
        for r in ok_rows(payload["results"])
        if not r.get("knobs")  # each strategy at its defaults
    }
    return {
        model: by[(model, "fsdp")] / by[(model, "ddp")]
        for model, strategy in by
        if strategy == "ddp" and (model, "fsdp") in by and by[(model, "ddp")]
    }


def _wrap_overhead(runs: Sequence[tuple[str, Mapping[str, Any]]], path: Path) -> Path:
    rows, groups = _points(runs)
    series = {
        "ours, warm": [row["wrap_ms"] for _, row in rows],
        "raw torch, warm": [row["raw_wrap_ms"] for _, row in rows],
        "ours, cold group": [row.get("wrap_cold_ms") for _, row in rows],
        "raw torch, cold group": [row.get("raw_wrap_cold_ms") for _, row in rows],
    }
    fig, ax = _point_figure(groups)
    bars(ax, groups, series, annotate=lambda v: f"{v:.0f}")
    ax.set_ylabel("wrap time, ms (lower is better)")
    ratios = ", ".join(
        f"{row['model']} {row['strategy'].upper()} {row['wrap_ms'] / row['raw_wrap_ms']:.2f}x"
        for _, row in rows
        if row["raw_wrap_ms"]
    )
    ax.set_title(
        f"Wrap time: ours vs raw torch on the same module\nours/raw (warm): {ratios}", fontsize=9
    )
    ax.tick_params(axis="x", labelsize=7)
    return save(fig, path)


def _memory(runs: Sequence[tuple[str, Mapping[str, Any]]], path: Path) -> Path:
    rows, groups = _points(runs)
    world = max(len(row["peak_mem_per_rank"]) for _, row in rows)
    series = {
        f"rank {rank}": [
            row["peak_mem_per_rank"][rank] / 2**20 if rank < len(row["peak_mem_per_rank"]) else None
            for _, row in rows
        ]
        for rank in range(world)
    }
    fig, ax = _point_figure(groups)
    bars(ax, groups, series, annotate=lambda v: f"{v:.0f}")
    device = runs[0][1]["env"]["device"]
    what = "CUDA allocator peak" if device == "cuda" else "process RSS peak (whole process)"
    ax.set_ylabel(f"MiB per rank ({what})")
    ax.set_title("Peak memory per rank during training steps", fontsize=10)
    ax.tick_params(axis="x", labelsize=7)
    return save(fig, path)


def _memory_breakdown(runs: Sequence[tuple[str, Mapping[str, Any]]], path: Path) -> Path | None:
    """Per-rank memory stacked by kind, one bar per (model, strategy); schema 2 rows only."""
    rows, groups = _points(runs, needs="param_bytes")
    if not rows:
        return None
    fig, ax = _point_figure(groups)
    bottom = [0.0] * len(rows)
    for kind, color in zip(MEMORY_KINDS, COLOURS, strict=False):
        values = [(row.get(f"{kind}_bytes") or 0) / 2**20 for _, row in rows]
        ax.bar(groups, values, bottom=bottom, label=KIND_NAMES[kind], color=color)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, total in enumerate(bottom):
        ax.annotate(f"{total:.1f}", (x, total), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("MiB per rank (largest rank)")
    ax.set_title(
        "Memory per rank by kind: local storage (an FSDP rank holds ~1/N of each static kind)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    return save(fig, path)


def _checkpoint(runs: Sequence[tuple[str, Mapping[str, Any]]], path: Path) -> Path | None:
    """Checkpoint save (ours vs raw DCP) and load times; schema 2 rows only."""
    rows, groups = _points(runs, needs="ckpt_save_ms")
    if not rows:
        return None
    series = {
        "save, checkpoint-io": [row["ckpt_save_ms"] for _, row in rows],
        "save, raw get_state_dict + dcp.save": [row["raw_ckpt_save_ms"] for _, row in rows],
        "load, checkpoint-io (verified)": [row["ckpt_load_ms"] for _, row in rows],
    }
    fig, ax = _point_figure(groups)
    bars(ax, groups, series, annotate=lambda v: f"{v:.0f}")
    ax.set_ylabel("ms (lower is better)")
    sizes = ", ".join(
        f"{row['model']} {row['strategy'].upper()} {row['ckpt_bytes'] / 2**20:.1f} MiB"
        for _, row in rows
    )
    ax.set_title(f"Checkpoint cost (model + optimizer)\n{sizes}", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    return save(fig, path)


def _step_spread(runs: Sequence[tuple[str, Mapping[str, Any]]], path: Path) -> Path:
    models, series = _grouped(runs, lambda row: row["step_ms_median"])
    _, spans_lo = _grouped(runs, lambda row: row["step_ms_p10"])
    _, spans_hi = _grouped(runs, lambda row: row["step_ms_p90"])
    errors = {
        name: [
            (lo, hi) if lo is not None and hi is not None else None
            for lo, hi in zip(spans_lo[name], spans_hi[name], strict=True)
        ]
        for name in series
    }
    fig, ax = pyplot().subplots(figsize=(width(len(models), len(series)), 4.5))
    bars(ax, models, series, annotate=lambda v: f"{v:.1f}", errors=errors)
    ax.set_ylabel("step time, ms: median, whiskers p10-p90")
    ax.set_title("Training step time and its spread", fontsize=10)
    return save(fig, path)


def _init(runs: Sequence[tuple[str, Mapping[str, Any]]], path: Path) -> Path | None:
    rows = [(label, row) for label, row in _rows(runs) if row["strategy"] == "ddp"] or _rows(runs)
    if not rows:
        return None
    multi = len(runs) > 1
    groups = [f"{row['model']}" + (f"\n{label}" if multi else "") for label, row in rows]
    series = {
        'source="local" (every rank builds)': [row["init_ms"] for _, row in rows],
        'source="rank0" (build once, broadcast)': [row.get("init_rank0_ms") for _, row in rows],
    }
    fig, ax = pyplot().subplots(figsize=(max(6, 1.8 * len(groups)), 4.5))
    bars(ax, groups, series, annotate=lambda v: f"{v:.0f}")
    ax.set_ylabel("replica build time, ms (slowest rank)")
    ax.set_title("Replica construction: local vs rank-0 broadcast", fontsize=10)
    return save(fig, path)


def plot_sweep(payload: Mapping[str, Any], path: Path) -> Path:
    """Throughput against peak memory, one labelled point per sweep point.

    Triangles mark points with a knob of the trainer's step (accumulation, checkpointing,
    compile); circles the wrapper's knobs and the defaults.
    """
    fig, ax = pyplot().subplots(figsize=(8, 5.5))
    for index, strategy in enumerate(("ddp", "fsdp", "hsdp")):
        rows = [r for r in ok_rows(payload["results"]) if r["strategy"] == strategy]
        if not rows:
            continue
        xs = [r["peak_mem_bytes"] / 2**20 for r in rows]
        ys = [r["samples_per_s"] for r in rows]
        stepped = [bool(step_knobs(row["knobs"])) for row in rows]
        for marker, label, wanted in (
            ("o", strategy.upper(), False),
            ("^", f"{strategy.upper()} + trainer knob", True),
        ):
            picked = [i for i, flag in enumerate(stepped) if flag == wanted]
            if picked:
                ax.scatter(
                    [xs[i] for i in picked],
                    [ys[i] for i in picked],
                    label=label,
                    color=COLOURS[index],
                    marker=marker,
                    s=40,
                )
        for x, y, row in zip(xs, ys, rows, strict=True):
            text = knob_text(row["knobs"], ", ") or "defaults"
            ax.annotate(text, (x, y), fontsize=6, xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("peak memory per rank, MiB (lower is better)")
    ax.set_ylabel("samples / s (higher is better)")
    models = sorted({r["model"] for r in ok_rows(payload["results"])})
    ax.set_title(f"Strategy knobs: throughput vs memory ({', '.join(models)})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    return save(fig, path)
