"""``report.md``: the environment, the table, the verdict with its reasons, the plots."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from strategy_bench.results import (
    MEMORY_KINDS,
    OOM,
    describe_failure,
    describe_skipped,
    knob_text,
    ok_rows,
)

_MIB = 2**20


def write_report(
    out_dir: Path,
    payload: Mapping[str, Any],
    pngs: Sequence[Path],
    recommendation: str | None = None,
) -> Path:
    """Write ``out_dir/report.md`` for one run and return its path.

    Args:
        out_dir: The run directory (the plots are linked relative to it).
        payload: The run's ``results.json`` content.
        pngs: The plots drawn for it.
        recommendation: A sweep's recommendation (its reason and the YAML section).
    """
    env = payload["env"]
    rows = payload["results"]
    measured = ok_rows(rows)
    lines = ["# strategy-bench report", "", "## Environment", ""]
    options = env.get("options", {})
    lines += [
        f"- device: {env.get('device_name')} ({env['device']}), {env['world_size']} rank(s), "
        f"{env['backend']}",
        f"- torch {env.get('torch')}, python {env.get('python')}, git {env.get('git')}",
        f"- dtype {options.get('dtype')}, batch {options.get('batch_size')} per rank, "
        f"{options.get('steps')} timed steps after {options.get('warmup')} warm-up",
        f"- MFU denominator: {_peak(env)}",
        "",
        "## Results",
        "",
    ]
    lines += _table(measured)
    failures = [row for row in rows if row not in measured]
    if failures:
        lines += ["", "Points that did not complete:", ""]
        lines += [f"- {describe_failure(row)}" for row in failures]
    torn = [row for row in measured if row.get("teardown_error")]
    if torn:
        lines += ["", "Measured in full, then a rank failed at teardown (the rows are kept):", ""]
        lines += [
            f"- {row['strategy']} {row['model']}"
            + (f" {knob_text(row['knobs'])}" if row.get("knobs") else "")
            + f": {row['teardown_error']}"
            for row in torn
        ]
    skipped = payload.get("skipped", [])
    if skipped:
        lines += ["", "Points not measured:", ""]
        lines += [f"- {describe_skipped(point)}" for point in skipped]
    lines += ["", "## Verdict", ""]
    if env.get("world_size") == 1:
        lines += [ONE_RANK_NOTE, ""]
    lines += _verdicts(rows) or ["No model was measured under both DDP and FSDP."]
    mismatches = [line for row in measured for line in dtype_mismatches(row)]
    lines += [
        "",
        "Communication dtypes: "
        + (
            "every collective moved the configured dtype."
            if not mismatches
            else "NOT as configured:"
        ),
    ]
    lines += [f"- {line}" for line in mismatches]
    if recommendation is not None:
        lines += ["", "## Recommendation", "", "```text", recommendation, "```"]
    lines += ["", "## Plots", ""]
    lines += [f"![{png.stem}]({png.name})" for png in pngs]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _peak(env: Mapping[str, Any]) -> str:
    parts = []
    if env.get("peak_flops"):
        parts.append(f"{env['peak_flops'] / 1e12:g} TFLOP/s per rank ({env['peak_flops_source']})")
    if env.get("matmul_flops"):
        parts.append(f"measured matmul rate {env['matmul_flops'] / 1e12:.1f} TFLOP/s")
    return "; ".join(parts) or "none (no --peak-tflops and no datasheet entry): no MFU"


def _table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    header = (
        "| model | strategy | knobs | step ms (p10-p90) | samples/s | MFU | params / grads / "
        "optimizer / DDP buckets / activations MiB per rank | comm MiB per step | "
        "ckpt save / raw / load / async stall ms, median (range) | compile s |"
    )
    lines = [header, "|" + " --- |" * 10]
    for row in rows:
        knobs = knob_text(row.get("knobs"), ", ") or "-"
        mfu = row.get("mfu")
        memory = " / ".join(
            f"{row[key] / _MIB:.1f}" if row.get(key) is not None else "-"
            for key in (f"{kind}_bytes" for kind in MEMORY_KINDS)
        )
        dtypes = row.get("comm_bytes_by_dtype") or {}
        comm = ", ".join(
            f"{kind} {value / _MIB:.2f}" + _dtype_text(dtypes.get(kind))
            for kind, value in sorted((row.get("comm_bytes_per_step") or {}).items())
        )
        ckpt = _checkpoint_text(row)
        compiled = row.get("compile_s")
        lines.append(
            f"| {row['model']} | {row['strategy']} | {knobs} | {row['step_ms_median']:.1f} "
            f"({row['step_ms_p10']:.1f}-{row['step_ms_p90']:.1f}) | {row['samples_per_s']:.1f} | "
            f"{'-' if mfu is None else f'{100 * mfu:.1f}%'} | {memory} | {comm or '-'} | {ckpt} | "
            f"{'-' if compiled is None else f'{compiled:.1f}'} |"
        )
    return lines


def _checkpoint_text(row: Mapping[str, Any]) -> str:
    """``save / raw / load / async stall`` medians in ms, each with its range over samples.

    ``101 (95-130) / 133 (120-140) / 99 (97-103) / 22 (21-25), 3 samples``; a row measured
    once (an older results file) says ``1 sample``.
    """
    if row.get("ckpt_save_ms") is None:
        return "-"
    parts = []
    counts = set()
    for key in ("ckpt_save_ms", "raw_ckpt_save_ms", "ckpt_load_ms", "ckpt_async_stall_ms"):
        if row.get(key) is None:
            continue
        samples = row.get(f"{key}_all") or [row[key]]
        counts.add(len(samples))
        spread = f" ({min(samples):.0f}-{max(samples):.0f})" if len(samples) > 1 else ""
        parts.append(f"{row[key]:.0f}{spread}")
    count = min(counts)
    return " / ".join(parts) + f", {count} sample{'s' if count != 1 else ''}"


def _dtype_text(sizes: Mapping[str, int] | None) -> str:
    """`` bf16`` for one dtype, `` (bf16 0.90, fp32 0.10)`` in MiB for several."""
    if not sizes:
        return ""
    if len(sizes) == 1:
        return f" {next(iter(sizes))}"
    return " (" + ", ".join(f"{d} {b / _MIB:.2f}" for d, b in sorted(sizes.items())) + ")"


def expected_dtypes(row: Mapping[str, Any]) -> dict[str, str]:
    """The dtype each collective should move under the row's configuration.

    FSDP/HSDP: all-gathers in ``param_dtype`` (else the parameters' fp32), reduce-scatters and
    HSDP's replica all-reduce in ``reduce_dtype`` (else ``param_dtype``, else fp32). DDP: its
    all-reduce in the gradients' fp32 (the bench builds fp32 parameters; ``--dtype`` is the
    autocast compute dtype, which no collective moves).
    """
    knobs = row.get("knobs") or {}
    if row.get("strategy") == "ddp":
        return {"all_reduce": "fp32"}
    param = str(knobs.get("param_dtype") or "fp32")
    reduce = str(knobs.get("reduce_dtype") or knobs.get("param_dtype") or "fp32")
    return {"all_gather": param, "reduce_scatter": reduce, "all_reduce": reduce}


def dtype_mismatches(row: Mapping[str, Any]) -> list[str]:
    """One line per collective that moved another dtype than the row's configuration says."""
    lines = []
    for kind, want in expected_dtypes(row).items():
        sizes = (row.get("comm_bytes_by_dtype") or {}).get(kind) or {}
        other = {dtype: size for dtype, size in sizes.items() if dtype != want and size}
        if other:
            moved = ", ".join(f"{d} {b / _MIB:.2f} MiB" for d, b in sorted(other.items()))
            what = f"{row['strategy']} {row['model']}"
            if row.get("knobs"):
                what += f" {knob_text(row['knobs'])}"
            lines.append(
                f"{what}: {kind} moved {moved} of {sum(sizes.values()) / _MIB:.2f} MiB, where "
                f"the configuration says {want}; the dtype you configured is not what travels "
                "(check the wrap's mixed-precision policy)"
            )
    return lines


def _static(row: Mapping[str, Any]) -> int:
    """Parameters, gradients and optimizer state: every kind but the activations."""
    return sum(int(row.get(f"{kind}_bytes") or 0) for kind in MEMORY_KINDS[:-1])


def _comm(row: Mapping[str, Any]) -> int:
    return sum((row.get("comm_bytes_per_step") or {}).values())


ONE_RANK_NOTE = (
    "At world size 1 nothing is communicated (DDP's all-reduce of one rank and FSDP2, which "
    "issues no collective, move no bytes between ranks): the rows compare wrapper and "
    "framework overhead, MFU, memory, init and checkpoint cost. No communication is measured, "
    "and no strategy wins on it; run on 2 or more GPUs for that."
)
"""What report.md and the summary say of a one-rank run."""


def verdict(ddp: Mapping[str, Any], fsdp: Mapping[str, Any]) -> str:
    """One model's verdict in measured figures (both rows at their default knobs).

    At world size 1 the throughput ratio is framework overhead only, and is said so.
    """
    model = ddp["model"]
    failed = [row for row in (ddp, fsdp) if row.get("status", "ok") != "ok"]
    if ddp.get("status") == OOM and fsdp.get("status", "ok") == "ok":
        reached = ddp.get("peak_mem_bytes")
        at = f" at {reached / 2**30:.2f} GiB" if reached else ""
        return (
            f"- `{model}`: only FSDP fits: DDP ran out of memory{at} (rank "
            f"{ddp.get('failed_rank')}); FSDP ran at {fsdp['peak_mem_bytes'] / 2**30:.2f} GiB "
            f"per rank ({fsdp['samples_per_s']:.1f} samples/s)."
        )
    if failed:
        other = [row for row in (ddp, fsdp) if row not in failed]
        text = "; ".join(describe_failure(row) for row in failed)
        for row in other:
            text += (
                f"; {row['strategy']} fits at {row['peak_mem_bytes'] / 2**30:.2f} GiB "
                f"({row['samples_per_s']:.1f} samples/s)"
            )
        return f"- `{model}`: {text}."
    speed = fsdp["samples_per_s"] / ddp["samples_per_s"]
    if ddp.get("world_size") == 1:
        return (
            f"- `{model}` at 1 rank: FSDP ran at {speed:.2f}x DDP's throughput, the cost of "
            "each wrapper's framework work alone (no communication: no winner named); static "
            f"memory {_static(fsdp) / _MIB:.1f} vs {_static(ddp) / _MIB:.1f} MiB."
        )
    faster = "DDP" if speed < 1 else "FSDP"
    text = f"- `{model}`: FSDP ran at {speed:.2f}x DDP's throughput ({faster} wins)"
    reasons = []
    if _comm(ddp) and _comm(fsdp):
        reasons.append(
            f"FSDP moved {_comm(fsdp) / _comm(ddp):.1f}x DDP's bytes per step "
            f"({_comm(fsdp) / _MIB:.2f} vs {_comm(ddp) / _MIB:.2f} MiB per rank)"
        )
    if _static(ddp) and _static(fsdp):
        saved = 1 - _static(fsdp) / _static(ddp)
        reasons.append(
            f"and {'saved' if saved >= 0 else 'added'} {abs(100 * saved):.0f}% of static memory "
            f"per rank (parameters, gradients, optimizer state, DDP's gradient buckets: "
            f"{_static(fsdp) / _MIB:.1f} vs "
            f"{_static(ddp) / _MIB:.1f} MiB)"
        )
    if reasons:
        text += ": " + " ".join(reasons)
    return text + "."


def hsdp_verdict(hsdp: Mapping[str, Any], others: Sequence[Mapping[str, Any]]) -> str:
    """HSDP's line beside DDP and FSDP: throughput, bytes per mesh dimension, the fastest."""
    model = hsdp["model"]
    if hsdp.get("status", "ok") != "ok":
        return f"- `{model}`: {describe_failure(hsdp)}."
    ok = [row for row in (*others, hsdp) if row.get("status", "ok") == "ok"]
    best = max(ok, key=lambda row: row["samples_per_s"])
    ratios = ", ".join(
        f"{hsdp['samples_per_s'] / row['samples_per_s']:.2f}x {row['strategy'].upper()}'s"
        for row in ok
        if row is not hsdp
    )
    by_dim = hsdp.get("comm_bytes_by_dim") or {}
    moved = "; ".join(
        f"{sum(kinds.values()) / _MIB:.2f} MiB per rank within its {dim} group"
        for dim, kinds in sorted(by_dim.items(), reverse=True)
    )
    text = f"- `{model}`: HSDP ran at {ratios} throughput"
    if moved:
        text += f" ({moved})"
    return text + f"; the fastest here is {best['strategy'].upper()}."


def _verdicts(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    by = {(r["model"], r["strategy"]): r for r in rows if not r.get("knobs")}
    models = dict.fromkeys(r["model"] for r in rows)
    lines = []
    for model in models:
        pair = [by[(model, s)] for s in ("ddp", "fsdp") if (model, s) in by]
        if len(pair) == 2:
            lines.append(verdict(pair[0], pair[1]))
        if (model, "hsdp") in by:
            lines.append(hsdp_verdict(by[(model, "hsdp")], pair))
    return lines
