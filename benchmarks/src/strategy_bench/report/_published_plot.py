"""The estimate against published runs as a plot: predicted against published tokens/s per GPU.

One point per published run and world size (``published.json``'s entries, written by
``benchmarks/published_runs.py``): a colour per run, a marker per GPU kind, the diagonal
``predicted = published`` and the band within ``BAND`` of it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from strategy_bench.report._figure import COLOURS, pyplot, save

BAND = 0.15
"""The shaded band: predicted within this fraction of published (either way)."""

_MARKERS = ("o", "s", "^", "D", "v", "P")
_NICE = (1.0, 2.0, 5.0)


def plot_published(entries: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """``published.png``: predicted against published tokens/s per GPU, one point per entry.

    Log axes when the throughputs span more than a factor of 10 (the same range on both);
    each run's legend entry names its GPU and world sizes.

    Args:
        entries: ``published.json``'s ``entries`` (``run``, ``gpu``, ``world_size``,
            ``published_tokens_per_s_per_gpu``, ``predicted_tokens_per_s_per_gpu``).
        path: Where the PNG goes.

    Returns:
        ``path``.

    Raises:
        ValueError: ``entries`` is empty.
    """
    if not entries:
        raise ValueError("no published entries to plot")
    published = [float(e["published_tokens_per_s_per_gpu"]) for e in entries]
    predicted = [float(e["predicted_tokens_per_s_per_gpu"]) for e in entries]
    values = published + predicted
    log = max(values) / min(values) > 10
    low, high = (min(values) / 1.5, max(values) * 1.5) if log else (0.0, max(values) * 1.15)
    fig, ax = pyplot().subplots(figsize=(7.5, 7.2))
    line = [low, high]
    ax.fill_between(
        line,
        [x * (1 - BAND) for x in line],
        [x * (1 + BAND) for x in line],
        color="#DDDDDD",
        alpha=0.6,
        label=f"within ±{100 * BAND:.0f}%",
        zorder=0,
    )
    ax.plot(line, line, color="#555555", linestyle="--", linewidth=1, label="predicted = published")
    gpus = list(dict.fromkeys(e["gpu"] for e in entries))
    runs = list(dict.fromkeys((e["run"], e["gpu"]) for e in entries))
    for index, (run, gpu) in enumerate(runs):
        mine = [e for e in entries if (e["run"], e["gpu"]) == (run, gpu)]
        worlds = ", ".join(str(e["world_size"]) for e in mine)
        ax.scatter(
            [e["published_tokens_per_s_per_gpu"] for e in mine],
            [e["predicted_tokens_per_s_per_gpu"] for e in mine],
            color=COLOURS[index % len(COLOURS)],
            marker=_MARKERS[gpus.index(gpu) % len(_MARKERS)],
            s=45,
            edgecolors="black",
            linewidths=0.5,
            label=f"{run} ({worlds} x {gpu})",
            zorder=3,
        )
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ticks = _nice_ticks(low, high)
        labels = [f"{tick:,.0f}" for tick in ticks]
        ax.set_xticks(ticks, labels)
        ax.set_yticks(ticks, labels)
        ax.tick_params(which="minor", labelbottom=False, labelleft=False)
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_aspect("equal")
    ax.set_xlabel("published throughput (tokens/s per GPU)")
    ax.set_ylabel("predicted throughput (tokens/s per GPU)")
    ax.grid(alpha=0.3, which="both" if log else "major")
    ax.legend(fontsize=7, loc="upper left")
    ratios = [p / q for p, q in zip(predicted, published, strict=True)]
    within = sum(abs(ratio - 1) <= BAND for ratio in ratios)
    ax.set_title(
        "strategy-bench estimate against published FSDP training runs\n"
        f"{len(entries)} points, {within} within ±{100 * BAND:.0f}%, median |error| "
        f"{100 * statistics.median(abs(ratio - 1) for ratio in ratios):.1f}%",
        fontsize=10,
    )
    return save(fig, path)


def _nice_ticks(low: float, high: float) -> list[float]:
    """The 1-2-5 values between ``low`` and ``high`` (both positive)."""
    ticks: list[float] = []
    decade = 10.0 ** int(f"{low:e}".split("e")[1])
    while decade <= high:
        ticks += [decade * step for step in _NICE if low <= decade * step <= high]
        decade *= 10
    return ticks
