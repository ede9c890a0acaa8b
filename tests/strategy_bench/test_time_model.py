"""``estimate``'s time model: the probe's fit, the predicted communication, the choice."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from strategy_bench import main
from strategy_bench._errors import BenchUsageError
from strategy_bench.estimate import (
    DEVICE_RESERVE_BYTES,
    TimeModel,
    calibrated_model,
    predict,
    recommendations,
)
from strategy_bench.estimate._estimate import estimate_point
from strategy_bench.estimate._points import EstimateOptions, EstimatePoint
from strategy_bench.measure import PROBE_KINDS, bus_factor, fit_link
from strategy_bench.workload import WorkloadSpec

DOCS = Path(__file__).resolve().parents[2] / "docs"
RESULTS = DOCS / "results" / "time-cpu"
EXAMPLES = DOCS / "examples"
MMAUDIO = (
    "--model-factory",
    "mmaudio_like:MMAudioLike",
    "--init-params",
    '{"width": 256, "depth": 4}',
    "--input-factory",
    "mmaudio_like:make_batch",
    "--trainable",
    "mmaudio_like:freeze_clip_projection",
)
TINY_DDP = ["estimate", "--models", "tiny", "--jobs", "1"]
CALIBRATION = ("calibrate-1rank", "calibrate-1rank-mmaudio", "probe-2rank")
MEASURED = ("measured-2rank", "measured-2rank-mmaudio", "measured-hsdp-4rank")

BUSBW = 10e9  # bytes/s
LATENCY = 50e-6  # s


def _links(latency_us: float = 0.0) -> dict[str, dict[str, float]]:
    return {kind: {"latency_us": latency_us, "busbw_gbps": BUSBW / 1e9} for kind in PROBE_KINDS}


def _model(
    latency_us: float = 0.0, gpus_per_node: int = 8, flops_rate: float | None = None
) -> TimeModel:
    """Known links (no latency unless asked); compute from the FLOPs at ``flops_rate``
    (``None``: the rows' FLOPs are set so high that compute is negligible)."""
    links = _links(latency_us)
    return TimeModel(
        links={"intra_node": links, "inter_node": links},
        points={},
        models={},
        flops_rate=flops_rate or 1e30,
        peak_flops=None,
        gpus_per_node=gpus_per_node,
        sources={},
    )


@pytest.mark.parametrize("kind", PROBE_KINDS)
@pytest.mark.parametrize("ranks", [2, 8])
def test_the_fit_recovers_a_known_latency_and_bandwidth(kind: str, ranks: int) -> None:
    sizes = [2**20, 16 * 2**20, 64 * 2**20]
    samples = [(size, LATENCY + size * bus_factor(kind, ranks) / BUSBW) for size in sizes]
    fit = fit_link(samples, kind, ranks)
    assert fit["latency_us"] == pytest.approx(LATENCY * 1e6, rel=1e-6)
    assert fit["busbw_gbps"] == pytest.approx(BUSBW / 1e9, rel=1e-9)
    assert fit["ranks"] == ranks and len(fit["samples"]) == 3
    with pytest.raises(ValueError, match="two message sizes"):
        fit_link(samples[:1], kind, ranks)
    with pytest.raises(ValueError, match="do not grow"):
        fit_link([(size, 1.0 - size / 2**30) for size in sizes], kind, ranks)


@pytest.fixture(scope="module")
def fake_rows() -> dict[tuple[str, int, str], dict[str, Any]]:
    """DDP and FSDP of ``small`` on fake groups of 8, 64 and 512 ranks (and accumulation 2)."""
    spec = WorkloadSpec(preset="small")
    options = EstimateOptions(batch_size=2)
    rows = {}
    for strategy in ("ddp", "fsdp"):
        for world in (8, 64, 512):
            for name, knobs in (("plain", {}), ("accum", {"grad_accum": 2})):
                if name == "accum" and world != 8:
                    continue
                row = estimate_point(spec, EstimatePoint(0, strategy, knobs, world), options)
                assert row["status"] == "ok", row
                row["flops_per_sample"] = 1e9
                rows[(strategy, world, name)] = row
    return rows


@pytest.mark.parametrize("world", [8, 64, 512])
def test_predicted_communication_follows_the_bus_factors(
    fake_rows: dict[tuple[str, int, str], dict[str, Any]], world: int
) -> None:
    model = _model()
    ddp = fake_rows[("ddp", world, "plain")]
    gradients = sum(ddp["comm_bytes_per_step"].values())
    assert gradients == ddp["grad_bytes"]  # every gradient, once
    parts = predict(ddp, model)["predicted_parts_ms"]
    expected = 2 * (world - 1) / world * gradients / BUSBW * 1e3
    assert sum(parts["comm"].values()) == pytest.approx(expected, rel=1e-9)

    fsdp = fake_rows[("fsdp", world, "plain")]
    moved = fsdp["comm_bytes_per_step"]
    padded = moved["reduce_scatter"]  # the gradients, each padded to a multiple of the world
    # the parameters: each block's in forward and again in backward; the root's (the first
    # gather) once, kept from the forward to the backward as raw fully_shard keeps them
    root = fsdp["all_gather_bytes_by_call"][0]
    assert moved["all_gather"] == 2 * padded - root
    parts = predict(fsdp, model)["predicted_parts_ms"]
    expected = (world - 1) / world * (moved["all_gather"] + padded) / BUSBW * 1e3
    assert sum(parts["comm"].values()) == pytest.approx(expected, rel=1e-9)
    # The padding: nothing at 8 ranks; at 512, 256-row weights are padded to 512 rows.
    assert padded >= fsdp["params"] * 4
    if world <= 64:
        assert padded == pytest.approx(fsdp["params"] * 4, rel=0.02)


def test_accumulation_divides_ddp_communication_per_sample(
    fake_rows: dict[tuple[str, int, str], dict[str, Any]],
) -> None:
    model = _model(latency_us=20.0)
    plain, accum = fake_rows[("ddp", 8, "plain")], fake_rows[("ddp", 8, "accum")]
    assert accum["batch_size"] == 2 * plain["batch_size"]
    per_sample = [
        sum(predict(row, model)["predicted_parts_ms"]["comm"].values()) / row["batch_size"]
        for row in (plain, accum)
    ]
    assert per_sample[1] == pytest.approx(per_sample[0] / 2, rel=1e-9)
    # FSDP gathers again for every micro-batch and reduces once: between half and the same.
    fsdp = [fake_rows[("fsdp", 8, name)] for name in ("plain", "accum")]
    comm = [sum(predict(row, model)["predicted_parts_ms"]["comm"].values()) for row in fsdp]
    assert comm[0] < comm[1] < 2 * comm[0]


def test_latency_counts_once_per_collective(
    fake_rows: dict[tuple[str, int, str], dict[str, Any]],
) -> None:
    row = fake_rows[("fsdp", 8, "plain")]
    calls = sum(row["comm_calls_per_step"].values())
    slow, fast = (
        sum(predict(row, _model(latency)).get("predicted_parts_ms")["comm"].values())
        for latency in (100.0, 0.0)
    )
    assert slow - fast == pytest.approx(calls * 0.1, rel=1e-9)
    # DDP: more buckets, more latencies; the bucket cap changes nothing else.
    ddp = fake_rows[("ddp", 8, "plain")]
    small, large = (
        predict(ddp, _model(100.0), bucket_cap_mb=cap)["predicted_parts_ms"]["comm"]
        for cap in (1.0, 100.0)
    )
    assert sum(small.values()) > sum(large.values())


def _row(strategy: str, step_ms: float, fits: bool, world: int = 8) -> dict[str, Any]:
    return {
        "status": "ok",
        "model": "m",
        "strategy": strategy,
        "knobs": {},
        "world_size": world,
        "batch_size": 4,
        "fits": fits,
        "predicted_step_ms": step_ms,
        "predicted_samples_per_s": 4 * world / (step_ms / 1e3),
    }


def test_the_recommendation_picks_only_rows_that_fit() -> None:
    rows = [_row("ddp", 10.0, False), _row("fsdp", 20.0, True), _row("hsdp", 25.0, True)]
    rows += [_row("ddp", 10.0, False, world=64), _row("fsdp", 30.0, False, world=64)]
    first, second = recommendations(rows)
    assert first["world_size"] == 8 and first["strategy"] == "fsdp"
    assert first["runner_up"]["strategy"] == "hsdp"
    assert first["margin"] == pytest.approx(25.0 / 20.0 - 1)
    assert first["candidates"] == 2
    assert second["world_size"] == 64 and second["strategy"] is None  # nothing fits
    # A DDP row offers its bucket sizes; a faster one wins, named as a knob.
    ddp = {**_row("ddp", 10.0, True), "predicted_by_bucket_ms": {"25.0": 10.0, "100.0": 8.0}}
    (best,) = recommendations([ddp, _row("fsdp", 12.0, True)])
    assert best["knobs"] == {"bucket_cap_mb": 100.0}
    assert best["predicted_step_ms"] == 8.0
    assert best["runner_up"]["strategy"] == "fsdp"


def test_calibration_needs_one_rank_rows_and_a_probe() -> None:
    probe = {"intra_node": {kind: fit_link([(1, 1.0), (2, 2.0)], kind, 2) for kind in PROBE_KINDS}}
    one = {
        "env": {"world_size": 1},
        "results": [
            {
                "status": "ok",
                "model": "m",
                "strategy": "ddp",
                "knobs": {},
                "world_size": 1,
                "batch_size": 4,
                "dtype": "fp32",
                "step_ms_median": 12.0,
                "compute_ms": 10.0,
                "optimizer_ms": 2.0,
                "flops_per_sample": 1e9,
            }
        ],
    }
    two = {"env": {"world_size": 2, "comm_probe": probe}, "results": []}
    with pytest.raises(BenchUsageError, match="no measured point with compute_ms"):
        calibrated_model([two], inter_node_gbps=None, gpus_per_node=8)
    with pytest.raises(BenchUsageError, match="no communication probe"):
        calibrated_model([one], inter_node_gbps=None, gpus_per_node=8)
    model = calibrated_model([one, two], inter_node_gbps=None, gpus_per_node=8)
    assert model.overlap  # not a CPU run
    assert model.links["inter_node"] == model.links["intra_node"]
    assert "spanned one node" in model.sources["inter_node"]
    assert model.flops_rate == pytest.approx(1e9 / (2e-3))  # 8 ms of work for 4 samples
    # The same point at world size 1: its step, the optimizer on a shard of 1/world.
    row = {**one["results"][0], "world_size": 4, "strategy": "fsdp"}
    assert predict(row, model)["predicted_parts_ms"]["compute"] == pytest.approx(8.0 + 2.0 / 4)
    ddp = {**one["results"][0], "world_size": 4, "comm_bytes_per_step": {}}
    assert predict(ddp, model)["predicted_step_ms"] == pytest.approx(12.0)
    other = {**row, "model": "other"}  # not calibrated: its FLOPs at the calibrated rate
    parts = predict(other, model)["predicted_parts_ms"]
    assert parts["compute"] == pytest.approx(8.0) and "FLOPs" in parts["compute_source"]


def test_every_row_is_timed_and_the_mfu_needs_a_peak(tmp_path: Path) -> None:
    out = tmp_path / "estimate"
    args = ["estimate", "--models", "tiny", "--world-size", "8", "64", "--jobs", "1"]
    assert main([*args, "--gpu", "H100", "--out", str(out)]) == 0
    payload = json.loads((out / "estimate.json").read_text())
    assert payload["env"]["time_model"]["sources"]["compute"].startswith("datasheet: H100")
    for row in payload["rows"]:
        assert row["predicted_step_ms"] > 0 and 0 < row["predicted_mfu"] < 1, row
        assert math.isclose(
            row["predicted_samples_per_s"],
            row["batch_size"] * row["world_size"] / (row["predicted_step_ms"] / 1e3),
        )
    chosen = payload["recommendation"]
    assert [entry["world_size"] for entry in chosen] == [8, 64]
    assert all(entry["strategy"] in ("ddp", "fsdp", "hsdp") for entry in chosen)
    assert "## Recommendation" in (out / "report.md").read_text()


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")
def test_compare_reports_the_step_error_of_the_committed_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The committed validation, recomputed from its runs: calibrated on one rank and the
    probe, compared with the runs on 2 ranks (and HSDP on 4): the same step errors."""
    committed = json.loads((RESULTS / "estimate" / "estimate.json").read_text())
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the MMAudio-like factory
    out = tmp_path / "again"
    args = [
        "estimate",
        *("--models", "tiny", "small", *MMAUDIO),
        *("--world-size", "2", "4", "--gpus-per-node", "2", "--batch-size", "8", "--jobs", "1"),
        "--calibrate",
        *(str(RESULTS / name / "results.json") for name in CALIBRATION),
        "--compare",
        *(str(RESULTS / name / "results.json") for name in MEASURED),
        "--out",
        str(out),
    ]
    assert main(args) == 0
    again = json.loads((out / "estimate.json").read_text())
    errors = {
        (row["model"], row["strategy"], row["world_size"]): row["step_error"]
        for row in again["agreement"]
    }
    assert len(errors) == 8 and all(error is not None for error in errors.values())
    for row in committed["agreement"]:
        key = (row["model"], row["strategy"], row["world_size"])
        assert errors[key] == pytest.approx(row["step_error"], abs=1e-9), key
    summary = again["step_agreement"]
    assert summary == pytest.approx(committed["step_agreement"])
    assert summary["points"] == 8 and summary["median_abs"] <= 0.20
    assert again["env"]["time_model"]["overlap"] is False  # a CPU calibration
    report = (out / "report.md").read_text()
    assert "step ms pred/meas (err)" in report and "## Recommended vs measured" in report


def test_a_point_that_fits_only_with_accumulation_is_recommended_with_it(tmp_path: Path) -> None:
    """DDP at batch 8 over the device, at batch 8 in micro-batches of 1 under it: the same
    global batch, recommended with ``grad_accum``."""
    calibrate = [
        str(RESULTS / name / "results.json") for name in ("calibrate-1rank", "probe-2rank")
    ]
    base = ["--strategies", "ddp", "--world-size", "2", "--batch-size", "8"]
    peaks = {}
    for batch in ("8", "1"):
        args = [*TINY_DDP, *base[:-1], batch, "--out", str(tmp_path / batch)]
        assert main(args) == 0
        rows = json.loads((tmp_path / batch / "estimate.json").read_text())["rows"]
        peaks[batch] = rows[0]["peak_bytes"]
    assert peaks["1"] < peaks["8"]
    usable = (peaks["1"] + peaks["8"]) / 2
    gib = repr((usable + DEVICE_RESERVE_BYTES) / 2**30)
    out = tmp_path / "device"
    args = [*TINY_DDP, *base, "--device-memory", gib, "--calibrate", *calibrate, "--out", str(out)]
    assert main(args) == 0
    payload = json.loads((out / "estimate.json").read_text())
    rows = payload["rows"]
    assert rows[0]["knobs"] == {} and rows[0]["fits"] is False
    accumulated = {row["knobs"]["grad_accum"]: row for row in rows[1:]}
    assert sorted(accumulated) == [2, 4, 8]
    for row in accumulated.values():
        assert row["batch_size"] == 8, row  # the same samples per step
        assert row["predicted_step_ms"] > 0
    assert accumulated[8]["fits"] and accumulated[8]["peak_bytes"] < peaks["8"]
    (chosen,) = payload["recommendation"]
    assert chosen["strategy"] == "ddp" and "grad_accum" in chosen["knobs"]
    assert accumulated[chosen["knobs"]["grad_accum"]]["fits"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_what_the_step_waits_for_follows_the_overlap_model(
    fake_rows: dict[tuple[str, int, str], dict[str, Any]], strategy: str
) -> None:
    """No compute to hide behind: every byte waited for. Compute that dwarfs the links: only
    what nothing can hide (DDP's last bucket; FSDP's first gather and last reduce-scatter).
    No overlap (a CPU host): all of it, whatever the compute."""
    row = {**fake_rows[(strategy, 8, "plain")], "flops_per_sample": 1e12}
    bare = predict(row, _model(flops_rate=1e30))["predicted_parts_ms"]
    comm = sum(bare["comm"].values())
    assert bare["compute"] < 1e-9 and sum(bare["exposed_comm"].values()) == pytest.approx(comm)
    assert set(bare["exposed_comm"]) == set(bare["comm"])  # by collective and mesh dimension
    slow = predict(row, _model(flops_rate=1e9))  # seconds of compute per step
    parts = slow["predicted_parts_ms"]
    exposed = sum(parts["exposed_comm"].values())
    nbytes = sum(row["comm_bytes_per_step"].values())
    if strategy == "ddp":  # the last bucket: all but DDP's first 1 MiB (25 MiB cap)
        last = (nbytes - 2**20) * 2 * 7 / 8 / BUSBW * 1e3
        assert exposed == pytest.approx(last, rel=1e-9)
    else:  # the first gathers of forward and backward, and the last unit's reduce-scatter
        gathers, scatters = (parts["comm"][f"{kind}@shard"] for kind in PROBE_KINDS[1:])
        units = row["comm_calls_per_step"]["reduce_scatter"]  # every unit trains here
        # the root is gathered once: torch keeps it from the forward to the backward
        assert row["comm_calls_per_step"]["all_gather"] == 2 * units - 1
        # Each gather its own size's share (the root's first: embedding and head, larger
        # than a block's). Forward's first is the root's; the backward starts in the root,
        # still gathered, whose own backward hides the last block's gather.
        sizes = row["all_gather_bytes_by_call"]
        assert len(sizes) == 2 * units - 1 and sizes[0] > sizes[1]
        first_gathers = gathers * sizes[0] / sum(sizes)
        assert exposed == pytest.approx(first_gathers + scatters / units, rel=1e-9)
        average = {**row, "all_gather_bytes_by_call": None}  # without sizes: the average unit
        flat = predict(average, _model(flops_rate=1e9))["predicted_parts_ms"]["exposed_comm"]
        one = gathers / (2 * units - 1)
        assert sum(flat.values()) == pytest.approx(one + scatters / units, rel=1e-9)
    assert 0 < exposed < comm
    assert slow["predicted_step_ms"] == pytest.approx(parts["compute"] + exposed)
    flat = dataclasses.replace(_model(flops_rate=1e9), overlap=False)
    assert predict(row, flat)["predicted_step_ms"] == pytest.approx(parts["compute"] + comm)


def test_nothing_to_predict_from_is_no_prediction_and_mfu_stays_below_one(
    fake_rows: dict[tuple[str, int, str], dict[str, Any]],
) -> None:
    row = {**fake_rows[("ddp", 8, "plain")], "flops_per_sample": None}
    predicted = predict(row, _model())
    assert predicted["predicted_step_ms"] is None and predicted["predicted_mfu"] is None
    # bf16 parameters compute at the bf16 rate: their MFU is a share of the bf16 peak.
    fsdp = {**fake_rows[("fsdp", 8, "plain")], "knobs": {"param_dtype": "bf16"}}
    fsdp["flops_per_sample"] = 1e12
    model = dataclasses.replace(
        _model(), flops_rate=0.4e12, peak_flops=1e12, bf16_rate=4e12, bf16_peak=10e12
    )
    mfu = predict(fsdp, model)["predicted_mfu"]
    assert 0 < mfu <= 0.4 + 1e-9


def test_accumulation_that_reduces_every_micro_batch_exposes_each_ones_reduction(
    fake_rows: dict[tuple[str, int, str], dict[str, Any]],
) -> None:
    """grad_accum_sync=every: 2 micro-steps reduce-scatter twice the bytes, and each one's
    last reduce-scatter is exposed; with compute that hides everything else, the step waits
    for one more unit's reduce-scatter than with one reduction after the last micro-step."""
    row = {**fake_rows[("fsdp", 8, "accum")], "flops_per_sample": 1e12}
    once = predict(row, _model(flops_rate=1e9))["predicted_parts_ms"]
    every = {**row, "knobs": {**row["knobs"], "grad_accum_sync": "every"}}
    every["comm_bytes_by_dim"] = {
        dim: {kind: (2 * v if kind == "reduce_scatter" else v) for kind, v in kinds.items()}
        for dim, kinds in row["comm_bytes_by_dim"].items()
    }
    each = predict(every, _model(flops_rate=1e9))["predicted_parts_ms"]
    units = row["comm_calls_per_step"]["reduce_scatter"]
    one_unit = once["comm"]["reduce_scatter@shard"] / units
    exposed_once, exposed_each = (sum(p["exposed_comm"].values()) for p in (once, each))
    assert exposed_each == pytest.approx(exposed_once + one_unit, rel=1e-6)
