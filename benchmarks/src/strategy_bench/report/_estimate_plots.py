"""The estimate's plots: memory by kind per world size, the largest model, the step's timeline."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from strategy_bench.report._figure import COLOURS, KIND_NAMES, pyplot, save
from strategy_bench.results import MEMORY_KINDS, byte_unit, knob_text, ok_rows


def plot_estimate(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """``estimate.png``: per-rank memory against world size, stacked by kind.

    One panel per model and point (strategy and knobs), world sizes on the x axis; the
    communication bytes per step are written above each bar.
    """
    rows = ok_rows(rows)
    unit, scale = byte_unit(max(row["total_bytes"] for row in rows))
    models = list(dict.fromkeys(row["model"] for row in rows))
    variants = list(dict.fromkeys((row["strategy"], knob_text(row["knobs"], ", ")) for row in rows))
    fig, axes = pyplot().subplots(
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
            for kind, color in zip(MEMORY_KINDS, COLOURS, strict=False):
                values = [(row.get(f"{kind}_bytes") or 0) / scale for row in mine]
                ax.bar(xs, values, bottom=bottom, label=KIND_NAMES[kind], color=color)
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
    return save(fig, path, rect=(0, 0.05, 1, 1))  # room for the legend below


def plot_largest(entries: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """``largest.png``: the largest model that fits against world size, one line per strategy.

    One panel per model family; a line per strategy and knobs; a family of which not even
    the smallest member fits has no point at that world size.
    """
    models = list(dict.fromkeys(entry["model"] for entry in entries))
    fig, axes = pyplot().subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [entry for entry in entries if entry["model"] == model]
        lines = list(dict.fromkeys((e["strategy"], knob_text(e["knobs"], ", ")) for e in mine))
        for (strategy, knobs), colour in zip(lines, COLOURS, strict=False):
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
    return save(fig, path)


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
    fig, axes = pyplot().subplots(len(models), 1, figsize=(8, 3.4 * len(models)), squeeze=False)
    unit, scale = byte_unit(max(row["tracked_peak_bytes"] for row in rows))
    for ax, model in zip((row[0] for row in axes), models, strict=True):
        mine = [row for row in rows if row["model"] == model]
        world = min(row["world_size"] for row in mine)
        mine = [row for row in mine if row["world_size"] == world]
        for index, (row, colour) in enumerate(zip(mine, COLOURS, strict=False)):
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
    return save(fig, path)


def _phase_spans(phases: Sequence[str], xs: Sequence[float]) -> list[tuple[str, float, float]]:
    spans: list[tuple[str, float, float]] = []
    for phase, x in zip(phases, xs, strict=True):
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], x)
        else:
            spans.append((phase, x, x))
    return spans
