"""``estimate``'s device memory (``fits``, ``headroom_bytes``) and ``--largest``, in-process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from strategy_bench import main
from strategy_bench.estimate import DEVICE_RESERVE_BYTES

TINY = ["estimate", "--models", "tiny", "--batch-size", "1", "--jobs", "1"]


def _estimate(out: Path, *args: str) -> dict[str, Any]:
    assert main([*TINY, *args, "--out", str(out)]) == 0
    return json.loads((out / "estimate.json").read_text())  # type: ignore[no-any-return]


def test_fits_flips_at_the_rows_own_peak(tmp_path: Path) -> None:
    first = _estimate(tmp_path / "plain", "--world-size", "2")
    row = next(r for r in first["rows"] if r["strategy"] == "fsdp" and not r["knobs"])
    # The peak is the sum of its parts, each a field.
    parts = row["peak_parts_bytes"]
    assert row["peak_bytes"] == row["tracked_peak_bytes"] > 0
    assert parts["optimizer"] == row["optimizer_bytes"] and parts["fsdp_gathered"] > 0
    assert row["peak_phase"] in ("forward", "backward", "optimizer")
    exact = row["peak_bytes"] + DEVICE_RESERVE_BYTES
    for extra, fits in ((0, True), (-1, False), (1, True)):
        out = tmp_path / f"device{extra}"
        gib = (exact + extra) / 2**30
        again = _estimate(out, "--world-size", "2", "--device-memory", repr(gib))
        same = next(r for r in again["rows"] if r["strategy"] == "fsdp" and not r["knobs"])
        assert same["peak_bytes"] == row["peak_bytes"]
        assert same["fits"] is fits and same["headroom_bytes"] == extra, (extra, same)
        assert again["env"]["device_memory"]["usable_bytes"] == row["peak_bytes"] + extra


def test_largest_grows_with_the_world_under_fsdp_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 3 MiB device (after the reserve): the tiny family scaled in depth, at 2 and 8 ranks."""
    gib = (DEVICE_RESERVE_BYTES + 3 * 2**20) / 2**30
    args = ["--world-size", "2", "8", "--device-memory", repr(gib), "--largest"]
    args += ["--gpus-per-node", "4"]  # 8 ranks are 2 nodes: an HSDP line sharded over 4
    estimate = _estimate(tmp_path, *args)
    largest = {
        (e["strategy"], tuple(sorted(e["knobs"].items())), e["world_size"]): e
        for e in estimate["largest"]
    }
    ddp = [largest[("ddp", (), world)] for world in (2, 8)]
    fsdp = [largest[("fsdp", (), world)] for world in (2, 8)]
    assert ddp[0]["scale_value"] == ddp[1]["scale_value"] >= 1  # every rank holds it all
    assert fsdp[1]["scale_value"] > fsdp[0]["scale_value"] > ddp[0]["scale_value"]
    assert fsdp[1]["largest_params"] > fsdp[0]["largest_params"]
    hsdp = largest[("hsdp", (), 8)]  # 1/4 of the model per rank: between FSDP's 1/2 and 1/8
    assert ("hsdp", (), 2) not in largest
    assert fsdp[0]["scale_value"] <= hsdp["scale_value"] <= fsdp[1]["scale_value"]
    for entry in largest.values():
        assert entry["scale_param"] == "depth" and not entry["at_least"]
        assert 0 <= entry["headroom_bytes"] < entry["peak_bytes"]
    assert (tmp_path / "largest.png").stat().st_size > 0
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert "largest model that fits:" in capsys.readouterr().out


def test_hsdp_keeps_all_but_the_replicas_all_reduce_inside_the_node(tmp_path: Path) -> None:
    """8 GPUs per node at 16, 64 and 512 ranks, from the counted bytes of each fake step:
    HSDP sends less than FSDP across nodes by at least the shard degree (8), and nothing
    crosses a node at 8 ranks."""
    args = ["--world-size", "8", "16", "64", "512", "--strategies", "fsdp", "hsdp"]
    estimate = _estimate(tmp_path, *args, "--gpus-per-node", "8")
    rows = {(r["strategy"], r["world_size"]): r for r in estimate["rows"] if not r["knobs"]}
    assert ("hsdp", 8) not in rows  # one node: HSDP would be FSDP
    assert rows[("fsdp", 8)]["comm_bytes_by_scope"]["inter_node"] == 0
    for world in (16, 64, 512):
        fsdp = rows[("fsdp", world)]["comm_bytes_by_scope"]
        hsdp = rows[("hsdp", world)]["comm_bytes_by_scope"]
        assert fsdp["intra_node"] == 0 and fsdp["inter_node"] > 0
        assert 0 < hsdp["inter_node"] * 8 <= fsdp["inter_node"], (world, hsdp, fsdp)
        assert hsdp["intra_node"] > 0


def test_comm_bytes_by_dtype_and_the_verdict_flag() -> None:
    """bf16 all-gathers and fp32 reduce-scatters where configured; fp32 for both by default;
    the report flags a row whose configured dtype is not what travelled."""
    from strategy_bench.estimate._estimate import estimate_point
    from strategy_bench.estimate._points import EstimateOptions, EstimatePoint
    from strategy_bench.report._report import dtype_mismatches
    from strategy_bench.workload import WorkloadSpec

    spec = WorkloadSpec(preset="tiny")
    options = EstimateOptions(batch_size=1)
    rows = {}
    for name, knobs in (("plain", {}), ("mixed", {"param_dtype": "bf16", "reduce_dtype": "fp32"})):
        row = estimate_point(spec, EstimatePoint(0, "fsdp", knobs, 2), options)
        assert row["status"] == "ok", row
        rows[name] = row
    plain, mixed = (rows[n]["comm_bytes_by_dtype"] for n in ("plain", "mixed"))
    assert set(plain) == {"all_gather", "reduce_scatter"}, plain
    assert list(plain["all_gather"]) == ["fp32"] and list(plain["reduce_scatter"]) == ["fp32"]
    assert list(mixed["all_gather"]) == ["bf16"] and list(mixed["reduce_scatter"]) == ["fp32"]
    assert mixed["all_gather"]["bf16"] * 2 == plain["all_gather"]["fp32"]  # half the bytes
    assert sum(plain["all_gather"].values()) == rows["plain"]["comm_bytes_per_step"]["all_gather"]
    assert dtype_mismatches(rows["plain"]) == dtype_mismatches(rows["mixed"]) == []
    # A row configured bf16 whose all-gather still moved fp32 (torchtitan issue 3123's case).
    wrong = {**rows["plain"], "knobs": {"param_dtype": "bf16"}}
    (line,) = [m for m in dtype_mismatches(wrong) if "all_gather" in m]
    assert line.startswith("fsdp tiny param_dtype=bf16: all_gather moved fp32 ")
    assert "where the configuration says bf16" in line
    ddp = estimate_point(spec, EstimatePoint(0, "ddp", {}, 2), options)
    assert list(ddp["comm_bytes_by_dtype"]["all_reduce"]) == ["fp32"]
