"""PNG plots of one or several results files, readable without the JSON."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from strategy_bench.results import MEMORY_KINDS, byte_unit, knob_text, ok_rows
from strategy_bench.workload import step_knobs


def _pyplot() -> Any:
    """Matplotlib's pyplot on the Agg backend, imported on first use.

    Not at import: every ``strategy-bench`` process and each point's ranks import the bench,
    and only the report draws (matplotlib's import is about 1 s here).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # the backend is chosen first

    return plt


_COLOURS = (
    "#4C72B0",
    "#DD8452",
    "#55A868",
    "#C44E52",
    "#8172B3",
    "#937860",
    "#DA8BC3",
    "#8C8C8C",
    "#CCB974",
    "#64B5CD",
    "#1B3A6B",
    "#7A3B0F",
)


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
    fig, ax = _pyplot().subplots(figsize=(max(7, 1.8 * len(groups)), 4.8))
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


def _bars(
    ax: Any,
    groups: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    *,
    annotate: Callable[[float], str] | None = None,
    errors: Mapping[str, Sequence[tuple[float, float] | None]] | None = None,
) -> None:
    width = 0.8 / max(1, len(series))
    for index, (name, values) in enumerate(series.items()):
        xs = [g + (index - (len(series) - 1) / 2) * width for g in range(len(groups))]
        heights = [v if v is not None else 0.0 for v in values]
        yerr = None
        if errors is not None and name in errors:
            spans = errors[name]
            yerr = [
                [h - s[0] if s else 0.0 for h, s in zip(heights, spans, strict=True)],
                [s[1] - h if s else 0.0 for h, s in zip(heights, spans, strict=True)],
            ]
        bars = ax.bar(
            xs,
            heights,
            width,
            label=name,
            color=_COLOURS[index % len(_COLOURS)],
            yerr=yerr,
            capsize=4,
        )
        if annotate is not None:
            for bar, value in zip(bars, values, strict=True):
                if value is not None:
                    ax.annotate(
                        annotate(value),
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
    ax.set_xticks(range(len(groups)), groups)
    if len(series) > 4:  # many series (a sweep): keep the legend off the bars
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _width(groups: int, series: int) -> float:
    """Figure width: room for every bar, plus the legend beside them for many series."""
    bars = max(6.0, 2.2 * groups, 0.6 * groups * series)
    return bars + (4.5 if series > 4 else 0.0)


def _save(fig: Any, path: Path, rect: tuple[float, float, float, float] | None = None) -> Path:
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def _throughput(runs: Sequence[tuple[str, Mapping[str, Any]]], path: Path) -> Path:
    models, series = _grouped(runs, lambda row: row["samples_per_s"])
    fig, ax = _pyplot().subplots(figsize=(_width(len(models), len(series)), 4.5))
    _bars(ax, models, series, annotate=lambda v: f"{v:.0f}")
    ax.set_ylabel("samples / s (all ranks, higher is better)")
    ratios = _fsdp_over_ddp(runs)
    subtitle = "; ".join(f"{m}: FSDP/DDP {r:.2f}x" for m, r in ratios.items())
    ax.set_title(f"Training throughput, DDP vs FSDP\n{subtitle}", fontsize=10)
    return _save(fig, path)


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
    _bars(ax, groups, series, annotate=lambda v: f"{v:.0f}")
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
    return _save(fig, path)


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
    _bars(ax, groups, series, annotate=lambda v: f"{v:.0f}")
    device = runs[0][1]["env"]["device"]
    what = "CUDA allocator peak" if device == "cuda" else "process RSS peak (whole process)"
    ax.set_ylabel(f"MiB per rank ({what})")
    ax.set_title("Peak memory per rank during training steps", fontsize=10)
    ax.tick_params(axis="x", labelsize=7)
    return _save(fig, path)


_KIND_NAMES = {
    "param": "parameters",
    "grad": "gradients",
    "optimizer": "optimizer state",
    "ddp_bucket": "DDP gradient buckets",
    "activation_peak": "activations saved for backward",
}


def _memory_breakdown(runs: Sequence[tuple[str, Mapping[str, Any]]], path: Path) -> Path | None:
    """Per-rank memory stacked by kind, one bar per (model, strategy); schema 2 rows only."""
    rows, groups = _points(runs, needs="param_bytes")
    if not rows:
        return None
    fig, ax = _point_figure(groups)
    bottom = [0.0] * len(rows)
    for kind, color in zip(MEMORY_KINDS, _COLOURS, strict=False):
        values = [(row.get(f"{kind}_bytes") or 0) / 2**20 for _, row in rows]
        ax.bar(groups, values, bottom=bottom, label=_KIND_NAMES[kind], color=color)
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
    return _save(fig, path)


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
    _bars(ax, groups, series, annotate=lambda v: f"{v:.0f}")
    ax.set_ylabel("ms (lower is better)")
    sizes = ", ".join(
        f"{row['model']} {row['strategy'].upper()} {row['ckpt_bytes'] / 2**20:.1f} MiB"
        for _, row in rows
    )
    ax.set_title(f"Checkpoint cost (model + optimizer)\n{sizes}", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    return _save(fig, path)


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
    fig, ax = _pyplot().subplots(figsize=(_width(len(models), len(series)), 4.5))
    _bars(ax, models, series, annotate=lambda v: f"{v:.1f}", errors=errors)
    ax.set_ylabel("step time, ms: median, whiskers p10-p90")
    ax.set_title("Training step time and its spread", fontsize=10)
    return _save(fig, path)


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
    fig, ax = _pyplot().subplots(figsize=(max(6, 1.8 * len(groups)), 4.5))
    _bars(ax, groups, series, annotate=lambda v: f"{v:.0f}")
    ax.set_ylabel("replica build time, ms (slowest rank)")
    ax.set_title("Replica construction: local vs rank-0 broadcast", fontsize=10)
    return _save(fig, path)


def plot_sweep(payload: Mapping[str, Any], path: Path) -> Path:
    """Throughput against peak memory, one labelled point per sweep point.

    Triangles mark points with a knob of the trainer's step (accumulation, checkpointing,
    compile); circles the wrapper's knobs and the defaults.
    """
    fig, ax = _pyplot().subplots(figsize=(8, 5.5))
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
                    color=_COLOURS[index],
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
    return _save(fig, path)


def plot_estimate(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """``estimate.png``: per-rank memory against world size, stacked by kind.

    One panel per model and point (strategy and knobs), world sizes on the x axis; the
    communication bytes per step are written above each bar.
    """
    rows = ok_rows(rows)
    unit, scale = byte_unit(max(row["total_bytes"] for row in rows))
    models = list(dict.fromkeys(row["model"] for row in rows))
    variants = list(dict.fromkeys((row["strategy"], knob_text(row["knobs"], ", ")) for row in rows))
    fig, axes = _pyplot().subplots(
        len(models),
        len(variants),
        figsize=(3.6 * len(variants), 3.8 * len(models)),
        squeeze=False,
        sharey="row",
    )
    for r, model in enumerate(models):
        for c, (strategy, knobs) in enumerate(variants):
            ax = axes[r][c]
            mine = [
                row
                for row in rows
                if row["model"] == model
                and (row["strategy"], knob_text(row["knobs"], ", ")) == (strategy, knobs)
            ]
            xs = list(range(len(mine)))
            bottom = [0.0] * len(mine)
            for kind, color in zip(MEMORY_KINDS, _COLOURS, strict=False):
                values = [(row.get(f"{kind}_bytes") or 0) / scale for row in mine]
                ax.bar(xs, values, bottom=bottom, label=_KIND_NAMES[kind], color=color)
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
            ax.set_xticks(xs, [str(row["world_size"]) for row in mine])
            for x, (total, row) in enumerate(zip(bottom, mine, strict=True)):
                comm = sum((row.get("comm_bytes_per_step") or {}).values()) / scale
                cross = (row.get("comm_bytes_by_scope") or {}).get("inter_node", 0) / scale
                ax.annotate(
                    f"{total:.1f}\ncomm {comm:.2f}\nx-node {cross:.2f}",
                    (x, total),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                )
            ax.set_title(f"{model}: {strategy.upper()} {knobs or 'defaults'}", fontsize=8)
            ax.set_xlabel("world size (ranks)", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
            ax.margins(y=0.15)
            if c == 0:
                ax.set_ylabel(f"{unit} per rank (estimated)", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(
        f"Estimated memory per rank by kind; comm = {unit} each rank sends per step, x-node = "
        "the part that crosses nodes",
        fontsize=10,
    )
    return _save(fig, path, rect=(0, 0.05, 1, 1))  # room for the legend below


def plot_largest(entries: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """``largest.png``: the largest model that fits against world size, one line per strategy.

    One panel per model family; a line per strategy and knobs; a family of which not even
    the smallest member fits has no point at that world size.
    """
    models = list(dict.fromkeys(entry["model"] for entry in entries))
    fig, axes = _pyplot().subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [entry for entry in entries if entry["model"] == model]
        lines = list(dict.fromkeys((e["strategy"], knob_text(e["knobs"], ", ")) for e in mine))
        for (strategy, knobs), colour in zip(lines, _COLOURS, strict=False):
            points = [
                (e["world_size"], e["largest_params"] / 1e9)
                for e in mine
                if (e["strategy"], knob_text(e["knobs"], ", ")) == (strategy, knobs)
                and e["largest_params"] is not None
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                label = f"{strategy.upper()} {knobs or 'defaults'}"
                ax.plot(xs, ys, marker="o", color=colour, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel("largest model that fits (billion parameters)")
        scaled = mine[0]["scale_param"] if mine else "?"
        ax.set_title(f"{model}, scaled in {scaled}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Largest model per rank's device memory (estimated peak)", fontsize=10)
    return _save(fig, path)


_PHASE_SHADES = {"forward": "#EAF1FB", "backward": "#FBEFE6", "optimizer": "#EAF6EC"}


def plot_timeline(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """``timeline.png``: the tracked step's live memory against its phases, per strategy.

    One panel per model, at the smallest world size estimated; a line per strategy and
    knobs over the step (forward, backward, optimizer, shaded by the first line's phases),
    its peak marked. ``None`` when no row has a timeline.
    """
    rows = [row for row in ok_rows(rows) if row.get("memory_timeline")]
    if not rows:
        return None
    models = list(dict.fromkeys(row["model"] for row in rows))
    fig, axes = _pyplot().subplots(len(models), 1, figsize=(8, 3.4 * len(models)), squeeze=False)
    unit, scale = byte_unit(max(row["tracked_peak_bytes"] for row in rows))
    for ax, model in zip((row[0] for row in axes), models, strict=True):
        mine = [row for row in rows if row["model"] == model]
        world = min(row["world_size"] for row in mine)
        mine = [row for row in mine if row["world_size"] == world]
        for index, (row, colour) in enumerate(zip(mine, _COLOURS, strict=False)):
            samples = row["memory_timeline"]
            xs = [i / max(1, len(samples) - 1) for i in range(len(samples))]
            ys = [value / scale for _, value in samples]
            label = f"{row['strategy'].upper()} {knob_text(row['knobs'], ', ') or 'defaults'}"
            ax.plot(xs, ys, color=colour, label=label, linewidth=1.2)
            top = max(range(len(ys)), key=ys.__getitem__)
            ax.plot([xs[top]], [ys[top]], marker="v", color=colour)
            if index == 0:
                for phase, begin, end in _phase_spans([p for p, _ in samples], xs):
                    ax.axvspan(begin, end, color=_PHASE_SHADES.get(phase, "#F2F2F2"), zorder=0)
                    ax.text(
                        (begin + end) / 2,
                        0.02,
                        phase,
                        ha="center",
                        fontsize=7,
                        transform=ax.get_xaxis_transform(),
                    )
        ax.set_xlabel("progress through one training step")
        ax.set_ylabel(f"live tensors, {unit} per rank")
        ax.set_title(f"{model}, {world} ranks: memory over the step (peak marked)", fontsize=10)
        ax.legend(fontsize=7)
    return _save(fig, path)


def _phase_spans(phases: Sequence[str], xs: Sequence[float]) -> list[tuple[str, float, float]]:
    spans: list[tuple[str, float, float]] = []
    for phase, x in zip(phases, xs, strict=True):
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], x)
        else:
            spans.append((phase, x, x))
    return spans
