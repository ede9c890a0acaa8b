"""The text tables: a run's summary, an estimate, and an estimate against a run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from strategy_bench.report._recommend import budgeted
from strategy_bench.results import OK, OOM, byte_unit, knob_text, ok_rows


def summary_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A fixed-width text table, one line per configuration."""
    header = (
        "model",
        "strategy",
        "knobs",
        "step ms (p10-p90)",
        "samples/s",
        "tokens/s",
        "wrap ms ours/raw",
        "init ms local/rank0",
        "peak MiB alloc/reserved",
        "MFU",
        "compile s",
    )
    lines: list[tuple[str, ...]] = [header]
    for row in rows:
        knobs = knob_text(row.get("knobs")) or "-"
        if row.get("status", OK) != OK:
            reached = row.get("peak_mem_bytes")
            what = "out of memory" if row["status"] == OOM else "failed"
            lines.append(
                (str(row["model"]), str(row["strategy"]), knobs, what)
                + ("-",) * (len(header) - 7)
                + ("-" if not reached else f"{reached / 2**20:.0f} reached", "-", "-")
            )
            continue
        tokens = row.get("tokens_per_s")
        rank0 = row.get("init_rank0_ms")
        mfu = row.get("mfu")
        compiled = row.get("compile_s")
        lines.append(
            (
                str(row["model"]),
                str(row["strategy"]),
                knobs,
                f"{row['step_ms_median']:.1f} ({row['step_ms_p10']:.1f}-{row['step_ms_p90']:.1f})",
                f"{row['samples_per_s']:.1f}",
                "-" if tokens is None else f"{tokens:.0f}",
                f"{row['wrap_ms']:.1f}/{row['raw_wrap_ms']:.1f} "
                f"({row['wrap_ms'] / row['raw_wrap_ms']:.2f}x)"
                if row["raw_wrap_ms"]
                else "-",
                f"{row['init_ms']:.0f}/" + ("-" if rank0 is None else f"{rank0:.0f}"),
                f"{row['peak_mem_bytes'] / 2**20:.0f}/{budgeted(row) / 2**20:.0f}",
                "-" if mfu is None else f"{100 * mfu:.1f}%",
                "-" if compiled is None else f"{compiled:.1f}",
            )
        )
    return _render(lines)


def _render(lines: Sequence[tuple[str, ...]]) -> str:
    """Fixed-width columns; the first line is the header."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    rendered = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines
    ]
    rendered.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(rendered)


def estimate_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``strategy-bench estimate``'s table: one line per point and world size, per rank."""
    largest = max(
        (max(r["total_bytes"], r.get("peak_bytes") or 0) for r in ok_rows(rows)), default=0
    )
    unit, scale = byte_unit(largest)
    with_fits = any("fits" in row for row in rows)
    with_time = any(row.get("predicted_step_ms") for row in rows)
    with_offload = any(row.get("host_bytes") is not None for row in rows)

    def size(value: float) -> str:
        return f"{value / scale:.2f}"

    def offload(row: Mapping[str, Any]) -> tuple[str, ...]:
        if not with_offload:
            return ()
        if row.get("host_bytes") is None:
            return ("-",)
        copies = row["offload_h2d_bytes_per_step"] + row["offload_d2h_bytes_per_step"]
        return (f"{size(row['host_bytes'])}, {size(row['device_peak_bytes'])}, {size(copies)}",)

    def fits(row: Mapping[str, Any]) -> tuple[str, ...]:
        if not with_fits:
            return ()
        if "fits" not in row:
            return ("-",)
        return (f"{'yes' if row['fits'] else 'NO'} ({size(row['headroom_bytes'])})",)

    header = (
        "model",
        "strategy",
        "knobs",
        "ranks",
        "params",
        "grads",
        "optimizer",
        "DDP buckets",
        "activations",
        f"total {unit}",
        f"peak {unit}",
        *((f"fits (headroom {unit})",) if with_fits else ()),
        *((f"offload: host, device peak, copies/step {unit}",) if with_offload else ()),
        f"comm {unit}/step",
        f"cross-node {unit}/step",
        "init host r0/others, device: local | rank0",
        *(("step ms (exposed comm)", "samples/s") if with_time else ()),
    )
    lines: list[tuple[str, ...]] = [header]

    def init(row: Mapping[str, Any]) -> str:
        peaks = row.get("init_peak_bytes") or {}
        return " | ".join(
            f"{size(p['host_rank0'])}/{size(p['host_other'])}, {size(p['device'])}"
            for p in (peaks.get(source) for source in ("local", "rank0"))
            if p
        )

    for row in rows:
        if row.get("status", OK) != OK:
            lines.append(
                (str(row["model"]), str(row["strategy"]), knob_text(row.get("knobs")) or "-")
                + (str(row["world_size"]), "failed")
                + ("-",) * (len(header) - 5)
            )
            continue
        comm = row.get("comm_bytes_per_step") or {}
        lines.append(
            (
                str(row["model"]),
                str(row["strategy"]),
                knob_text(row.get("knobs")) or "-",
                str(row["world_size"]),
                size(row["param_bytes"]),
                size(row["grad_bytes"]),
                size(row["optimizer_bytes"]),
                size(row.get("ddp_bucket_bytes") or 0),
                size(row["activation_peak_bytes"]),
                size(row["total_bytes"]),
                size(row["peak_bytes"]) if row.get("peak_bytes") is not None else "-",
                *fits(row),
                *offload(row),
                " ".join(f"{kind} {size(value)}" for kind, value in comm.items()) or "-",
                size((row.get("comm_bytes_by_scope") or {}).get("inter_node", 0)),
                init(row) or "-",
                *(_predicted(row) if with_time else ()),
            )
        )
    return _render(lines)


def _predicted(row: Mapping[str, Any]) -> tuple[str, str]:
    """The predicted step, its exposed communication, and samples/s."""
    step = row.get("predicted_step_ms")
    if not step:
        return "-", "-"
    exposed = sum(row["predicted_parts_ms"]["exposed_comm"].values())
    return f"{step:.4g} ({exposed:.3g})", f"{row['predicted_samples_per_s']:.4g}"


def recommendation_table(entries: Sequence[Mapping[str, Any]], *, markdown: bool = False) -> str:
    """Per model and world size: the recommended point, its step, the runner-up, the margin."""
    header = ("model", "ranks", "recommended", "step ms", "samples/s", "runner-up", "margin")
    lines: list[tuple[str, ...]] = [header]
    for entry in entries:
        if entry["strategy"] is None:
            lines.append(
                (str(entry["model"]), str(entry["world_size"]), "nothing fits") + ("-",) * 4
            )
            continue
        runner = entry.get("runner_up")
        lines.append(
            (
                str(entry["model"]),
                str(entry["world_size"]),
                choice_text(entry),
                f"{entry['predicted_step_ms']:.4g}",
                f"{entry['predicted_samples_per_s']:.4g}",
                "-"
                if runner is None
                else f"{choice_text(runner)} ({runner['predicted_step_ms']:.4g} ms)",
                "-" if entry.get("margin") is None else f"{100 * entry['margin']:.1f}% faster",
            )
        )
    return _markdown(lines) if markdown else _render(lines)


def choice_text(choice: Mapping[str, Any]) -> str:
    """``fsdp reshard_after_forward=False``: a strategy and its knobs."""
    knobs = knob_text(choice.get("knobs"))
    return f"{choice['strategy']} {knobs}".strip()


def _markdown(lines: Sequence[tuple[str, ...]]) -> str:
    table = [f"| {' | '.join(line)} |" for line in lines]
    table.insert(1, "|" + "---|" * len(lines[0]))
    return "\n".join(table)


def agreement_table(rows: Sequence[Mapping[str, Any]], *, markdown: bool = False) -> str:
    """Estimate against ``run``: estimated / measured MiB and the error of each kind."""
    header = (
        "model",
        "strategy",
        "knobs",
        "ranks",
        "static MiB est/meas (err)",
        "activations MiB est/meas (err)",
        "comm MiB est/meas (err)",
        "peak MiB est/meas (err)",
        "within tolerance",
        "step ms pred/meas (err)",
    )
    lines: list[tuple[str, ...]] = [header]
    for row in rows:
        cells = [
            f"{row[f'{kind}_estimated'] / 2**20:.2f} / {row[f'{kind}_measured'] / 2**20:.2f} "
            f"({100 * row[f'{kind}_error']:.1f}%)"
            if f"{kind}_error" in row
            else "-"
            for kind in ("static", "activation", "comm", "peak")
        ]
        lines.append(
            (
                str(row["model"]),
                str(row["strategy"]),
                knob_text(row.get("knobs")) or "-",
                str(row["world_size"]),
                *cells,
                "yes" if row["ok"] else "NO",
                f"{row['step_predicted_ms']:.1f} / {row['step_measured_ms']:.1f} "
                f"({100 * row['step_error']:+.1f}%)"
                if row.get("step_error") is not None
                else "-",
            )
        )
    return _markdown(lines) if markdown else _render(lines)


def largest_table(entries: Sequence[Mapping[str, Any]]) -> str:
    """``estimate --largest``: the largest model per strategy (and knobs) and world size."""
    header = ("model", "strategy", "knobs", "ranks", "scaled", "largest", "params", "peak GiB")
    lines: list[tuple[str, ...]] = [header]
    for entry in entries:
        value = entry["scale_value"]
        largest = "none fits" if value is None else f"{'>= ' if entry['at_least'] else ''}{value}"
        params = entry["largest_params"]
        peak = entry["peak_bytes"]
        lines.append(
            (
                str(entry["model"]),
                str(entry["strategy"]),
                knob_text(entry.get("knobs")) or "-",
                str(entry["world_size"]),
                str(entry["scale_param"]),
                largest,
                "-" if params is None else f"{params / 1e9:.2f} B",
                "-" if peak is None else f"{peak / 2**30:.2f}",
            )
        )
    return _render(lines)


def cost_table(
    rows: Sequence[Mapping[str, Any]], train_tokens: float, *, markdown: bool = False
) -> str:
    """Per model, world size and strategy: what training ``train_tokens`` takes.

    The fastest point of each strategy that fits, at its predicted rate: tokens/s per GPU,
    days, GPU-hours and cost; a strategy with no point that fits says so, with its least peak.
    """
    best, smallest = _fastest_costed(rows)
    # the knobs every row shares (the recipe asked for) are said once, above the table
    kept = list(best.values())
    shared = {
        name: value
        for name, value in (kept[0]["knobs"] if kept else {}).items()
        if all(name in row["knobs"] and row["knobs"][name] == value for row in kept)
    }
    header = ("model", "ranks", "strategy", "tokens/s per GPU", "days", "GPU-hours", "cost")
    lines: list[tuple[str, ...]] = [header]
    for key in sorted({*best, *smallest}):
        model, world, strategy = key
        if key not in best:
            fit = f"does not fit ({smallest[key] / 2**30:.0f} GiB)"
            lines.append((model, str(world), strategy, fit, "-", "-", "-"))
            continue
        row = best[key]
        cost = row.get("train_cost")
        own = {name: value for name, value in row["knobs"].items() if name not in shared}
        lines.append(
            (
                model,
                str(world),
                choice_text({"strategy": strategy, "knobs": own}),
                f"{row['train_tokens_per_s'] / world:,.0f}",
                _amount(row["train_days"]),
                _amount(row["train_gpu_hours"]),
                "-" if cost is None else _amount(cost),
            )
        )
    if not best:
        return f"no point that fits has a predicted rate to train {train_tokens:.3g} tokens at"
    table = _markdown(lines) if markdown else _render(lines)
    if not shared:
        return table
    return f"every row: {knob_text(shared, ', ')}\n{table}"


def _fastest_costed(
    rows: Sequence[Mapping[str, Any]],
) -> tuple[dict[tuple[str, int, str], Mapping[str, Any]], dict[tuple[str, int, str], int]]:
    """Per (model, world size, strategy): the fastest costed row that fits, or least peak."""
    best: dict[tuple[str, int, str], Mapping[str, Any]] = {}
    smallest: dict[tuple[str, int, str], int] = {}
    for row in ok_rows(rows):
        key = (str(row["model"]), int(row["world_size"]), str(row["strategy"]))
        if not row.get("fits", True):
            peak = int(row.get("peak_bytes") or row["total_bytes"])
            smallest[key] = min(smallest.get(key, peak), peak)
        elif row.get("train_days") and (
            key not in best or row["train_days"] < best[key]["train_days"]
        ):
            best[key] = row
    return best, smallest


def failure_table(rows: Sequence[Mapping[str, Any]], *, markdown: bool = False) -> str:
    """Per model, world size and strategy that fits: failures, and the run's length per mode.

    Each failure restarts the job from a checkpoint, or heals one replica group (torchft).
    """
    best, _ = _fastest_costed(rows)
    header = ("model", "ranks", "strategy", "failures", "restart: days", "GPU-hours")
    lines: list[tuple[str, ...]] = [(*header, "heal: days", "GPU-hours")]
    for (model, world, strategy), row in sorted(best.items()):
        if row.get("failures") is None:
            continue
        restart = [row.get("restart_days"), row.get("restart_gpu_hours")]
        heal = [row.get("heal_days"), row.get("heal_gpu_hours")]
        if not row.get("replica_groups"):  # FSDP, or one group: nothing to heal from
            heal = ["-", "-"]
        lines.append(
            (
                model,
                str(world),
                strategy,
                f"{row['failures']:.1f}",
                *(_ends(value) for value in (*restart, *heal)),
            )
        )
    return _markdown(lines) if markdown else _render(lines)


def plan_lines(plans: Sequence[Mapping[str, Any]], train_tokens: float) -> str:
    """``fastest that fits`` and ``cheapest that fits`` per model, one line each."""
    out = []
    for plan in plans:
        fastest, cheapest = plan["fastest"], plan["cheapest"]
        head = f"{plan['model']}, {train_tokens:.3g} tokens:"
        out.append(f"{head} fastest that fits: {_costed(fastest)}")
        if cheapest != fastest:
            out.append(f"{head} cheapest that fits: {_costed(cheapest)}")
    return "\n".join(out)


def _costed(entry: Mapping[str, Any]) -> str:
    cost = entry.get("train_cost")
    return (
        f"{choice_text(entry)} on {entry['world_size']} GPUs, {_amount(entry['train_days'])} "
        f"days, {_amount(entry['train_gpu_hours'])} GPU-hours"
        + ("" if cost is None else f", cost {_amount(cost)}")
    )


def _ends(value: float | str | None) -> str:
    if value is None:
        return "never ends"
    return value if isinstance(value, str) else _amount(value)


def _amount(value: float) -> str:
    """Whole numbers with separators from 100, one decimal from 1, three figures below."""
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 1 else f"{value:.3g}"
