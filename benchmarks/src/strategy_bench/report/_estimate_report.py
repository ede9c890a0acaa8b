"""``report.md`` of an estimate: the time model, the recommendation, and the measured runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from strategy_bench.report._table import agreement_table, choice_text, recommendation_table
from strategy_bench.results import ok_rows


def write_estimate_report(
    out_dir: Path, payload: Mapping[str, Any], measured: Sequence[Mapping[str, Any]] = ()
) -> Path:
    """Write ``out_dir/report.md`` for one estimate and return its path.

    Args:
        out_dir: The estimate's directory.
        payload: ``estimate.json``'s content.
        measured: The ``--compare`` runs' rows: wherever a world size was measured, the
            fastest measured point is written beside the recommendation.
    """
    env = payload["env"]
    lines = ["# strategy-bench estimate", ""]
    model = env.get("time_model")
    if model is None:
        lines += [
            "No step time was predicted: give `--gpu NAME` (datasheet peak and links) or "
            "`--calibrate RESULTS.json` (a run on the target kind of host).",
            "",
        ]
    else:
        lines += ["## Time model", ""]
        lines += [f"- {key} from: {value}" for key, value in model["sources"].items()]
        for scope, kinds in model["links"].items():
            fitted = ", ".join(
                f"{kind} {link['busbw_gbps']:.2f} GB/s + {link['latency_us']:.0f} us"
                for kind, link in kinds.items()
            )
            lines.append(f"- {scope} links (bus bandwidth + latency per collective): {fitted}")
        lines.append("")
    chosen = payload.get("recommendation") or []
    if chosen:
        lines += ["## Recommendation", "", recommendation_table(chosen, markdown=True), ""]
        beside = _measured_beside(chosen, measured)
        if beside:
            lines += ["## Recommended vs measured", "", *beside, ""]
    checked = payload.get("agreement") or []
    if checked:
        lines += ["## Estimate vs measured", "", agreement_table(checked, markdown=True), ""]
        errors = payload.get("step_agreement")
        if errors:
            lines.append(
                f"Step time: median |error| {100 * errors['median_abs']:.1f}%, worst "
                f"{100 * errors['max_abs']:.1f}% over {errors['points']} point(s)."
            )
            lines.append("")
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _measured_beside(
    chosen: Sequence[Mapping[str, Any]], measured: Sequence[Mapping[str, Any]]
) -> list[str]:
    """One line per recommended (model, world size) that a run measured: both fastest."""
    rows = ok_rows(measured)
    out = []
    for entry in chosen:
        mine = [row for row in rows if _same_point(row, entry)]
        if not mine or entry["strategy"] is None:
            continue
        fastest = max(mine, key=lambda row: row["samples_per_s"])
        head = (
            f"- `{entry['model']}` at {entry['world_size']} ranks: estimate recommends "
            f"{choice_text(entry)} ({entry['predicted_samples_per_s']:.1f} samples/s "
            "predicted); "
        )
        if choice_text(entry) not in {choice_text(row) for row in mine}:
            measured_text = ", ".join(sorted({choice_text(row) for row in mine}))
            out.append(head + f"the run did not measure it (it measured {measured_text}).")
            continue
        agree = choice_text(fastest) == choice_text(entry)
        out.append(
            head + f"the run measured {choice_text(fastest)} fastest "
            f"({fastest['samples_per_s']:.1f} samples/s) of {len(mine)} point(s): "
            + ("the same choice." if agree else "a different choice.")
        )
    return out


def _same_point(row: Mapping[str, Any], entry: Mapping[str, Any]) -> bool:
    """The run's row is of the recommendation's model, world size, batch and dtype."""
    keys = ("model", "world_size", "batch_size", "dtype")
    return all(row.get(key) == entry.get(key) for key in keys)
