"""What every plot shares: pyplot on first use, the colours, bars, the figure's size and save."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """Matplotlib's pyplot on the Agg backend, imported on first use.

    Not at import: every ``strategy-bench`` process and each point's ranks import the bench,
    and only the report draws (matplotlib's import is about 1 s here).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # the backend is chosen first

    return plt


COLOURS = (
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

KIND_NAMES = {
    "param": "parameters",
    "grad": "gradients",
    "optimizer": "optimizer state",
    "ddp_bucket": "DDP gradient buckets",
    "activation_peak": "activations saved for backward",
}
"""What each memory kind is called in a legend."""


def bars(
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
            color=COLOURS[index % len(COLOURS)],
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


def width(groups: int, series: int) -> float:
    """Figure width: room for every bar, plus the legend beside them for many series."""
    bars = max(6.0, 2.2 * groups, 0.6 * groups * series)
    return bars + (4.5 if series > 4 else 0.0)


def save(fig: Any, path: Path, rect: tuple[float, float, float, float] | None = None) -> Path:
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path
