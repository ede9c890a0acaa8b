"""The estimate against the published record: recipes, a cluster's network, per-GPU MFU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench_cli import QUICK, USER_MODEL, assert_png, bench
from strategy_bench import main
from strategy_bench.estimate import (
    DATASHEET_MFU,
    DEVICE_RESERVE_BYTES,
    TimeModel,
    datasheet_model,
    predict,
)
from strategy_bench.estimate._estimate import estimate_point
from strategy_bench.estimate._points import EstimateOptions, EstimatePoint
from strategy_bench.measure import PROBE_KINDS, bus_factor
from strategy_bench.report import plot_published
from strategy_bench.workload import WorkloadSpec

DOCS = Path(__file__).resolve().parents[2] / "docs"
PUBLISHED = DOCS / "results" / "estimate-published" / "published.json"

INTRA_GBS, NIC_GBS = 450.0, 50.0  # NVLink per GPU; one 400 Gb/s NIC per GPU


def _links(busbw_gbps: float) -> dict[str, dict[str, float]]:
    return {kind: {"latency_us": 0.0, "busbw_gbps": busbw_gbps} for kind in PROBE_KINDS}


def _network(gpus_per_node: int) -> TimeModel:
    return TimeModel(
        links={"intra_node": _links(INTRA_GBS), "inter_node": _links(NIC_GBS)},
        points={},
        models={},
        flops_rate=1e30,
        peak_flops=None,
        gpus_per_node=gpus_per_node,
        sources={},
    )


def _row(strategy: str, world: int, by_dim: dict[str, dict[str, int]]) -> dict[str, Any]:
    return {
        "status": "ok",
        "model": "m",
        "strategy": strategy,
        "knobs": {},
        "world_size": world,
        "batch_size": 1,
        "flops_per_sample": 1.0,
        "comm_bytes_by_dim": by_dim,
        "comm_calls_per_step": {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1},
    }


@pytest.mark.parametrize(("gpus_per_node", "busbw"), [(64, INTRA_GBS), (8, 400.0), (4, 200.0)])
def test_a_ring_across_nodes_moves_every_nic_of_the_node(gpus_per_node: int, busbw: float) -> None:
    """FSDP over 64 ranks: one node, NVLink; 8 nodes of 8, 8 NICs' worth (min NVLink); 16 of
    4, 4 NICs'. HSDP's replicate all-reduce (one rank per node) gets one NIC."""
    nbytes = 2**30
    row = _row("fsdp", 64, {"world": {"all_gather": nbytes, "reduce_scatter": nbytes}})
    comm = predict(row, _network(gpus_per_node))["predicted_parts_ms"]["comm"]
    for kind in ("all_gather", "reduce_scatter"):
        expected = nbytes * bus_factor(kind, 64) / (busbw * 1e9) * 1e3
        assert comm[f"{kind}@world"] == pytest.approx(expected, rel=1e-9), kind
    hsdp = _row(
        "hsdp",
        64,
        {
            "shard": {"all_gather": nbytes, "reduce_scatter": nbytes},
            "replicate": {"all_reduce": nbytes},
        },
    )
    parts = predict(hsdp, _network(8))["predicted_parts_ms"]["comm"]
    one_nic = nbytes * bus_factor("all_reduce", 8) / (NIC_GBS * 1e9) * 1e3
    assert parts["all_reduce@replicate"] == pytest.approx(one_nic, rel=1e-9)
    inside = nbytes * bus_factor("all_gather", 8) / (INTRA_GBS * 1e9) * 1e3
    assert parts["all_gather@shard"] == pytest.approx(inside, rel=1e-9)


def test_each_gpu_defaults_to_its_published_mfu() -> None:
    """A100s train at a higher MFU than H100s (published: 0.52-0.64 against 0.33-0.46); each
    default names its source; --assumed-mfu still overrides."""
    rates = {}
    for gpu in ("A100-80GB", "H100", "H200"):
        model = datasheet_model(
            gpu, "bf16", assumed_mfu=None, inter_node_gbps=None, gpus_per_node=8
        )
        assert model is not None and model.peak_flops is not None
        mfu, source = DATASHEET_MFU[gpu]
        assert model.flops_rate == pytest.approx(model.peak_flops * mfu)
        assert source in model.sources["compute"] and "recompute" in model.sources["compute"]
        rates[gpu] = mfu
    assert rates["A100-80GB"] == 0.55 and rates["H100"] == 0.40
    given = datasheet_model("H100", "bf16", assumed_mfu=0.3, inter_node_gbps=None, gpus_per_node=8)
    assert given is not None and given.peak_flops is not None
    assert given.flops_rate == pytest.approx(given.peak_flops * 0.3)
    assert "--assumed-mfu 0.3" in given.sources["compute"]
    assert "ranks per node x the per-GPU figure" in given.sources["inter_node"]


def _estimate(tmp_path: Path, name: str, *recipe: str) -> list[dict[str, Any]]:
    out = tmp_path / name
    args = ["estimate", "--models", "tiny", "--world-size", "16", "--gpu", "H100", "--jobs", "1"]
    assert main([*args, "--batch-size", "2", *recipe, "--out", str(out)]) == 0
    return json.loads((out / "estimate.json").read_text())["rows"]


def test_each_recipe_gets_its_row(tmp_path: Path) -> None:
    """Every strategy gets the recipe's row: HSDP with bf16 parameters too, DDP as bf16
    autocast (no reduce_dtype); checkpointing keeps none > selective > full of the
    activations, at the same predicted time (MFU as published); accumulation multiplies the
    batch; tokens/s per GPU from the preset's length."""
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for mode in ("none", "full", "selective"):
        found = _estimate(
            tmp_path, mode, "--param-dtype", "bf16", "--activation-checkpointing", mode
        )
        rows[mode] = {row["strategy"]: row for row in found}
        assert sorted(rows[mode]) == ["ddp", "fsdp", "hsdp"]
    checkpointed = {"activation_checkpointing": "full"}
    assert rows["full"]["ddp"]["knobs"] == {"param_dtype": "bf16", **checkpointed}
    for strategy in ("fsdp", "hsdp"):
        knobs = {"param_dtype": "bf16", "reduce_dtype": "fp32", **checkpointed}
        assert rows["full"][strategy]["knobs"] == knobs
        assert set(rows["full"][strategy]["comm_bytes_by_dtype"]["all_gather"]) == {"bf16"}
    for strategy in ("ddp", "fsdp", "hsdp"):
        kept = {mode: rows[mode][strategy]["activation_peak_bytes"] for mode in rows}
        assert kept["full"] < kept["selective"] < kept["none"], (strategy, kept)
        peaks = {mode: rows[mode][strategy]["peak_bytes"] for mode in rows}
        assert peaks["full"] < peaks["selective"] < peaks["none"], (strategy, peaks)
        steps = {mode: rows[mode][strategy]["predicted_step_ms"] for mode in rows}
        assert steps["full"] == pytest.approx(steps["none"]), steps
        row = rows["none"][strategy]
        per_gpu = row["predicted_samples_per_s"] / 16 * row["tokens_per_sample"]
        assert row["predicted_tokens_per_s_per_gpu"] == pytest.approx(per_gpu)
    accumulated = {
        row["strategy"]: row for row in _estimate(tmp_path, "accum", "--grad-accum", "3")
    }
    for strategy, row in accumulated.items():
        assert row["knobs"] == {"grad_accum": 3} and row["batch_size"] == 6, strategy
    every = ("--grad-accum", "3", "--grad-accum-sync", "every")
    synced = {row["strategy"]: row for row in _estimate(tmp_path, "every", *every)}
    for strategy in ("fsdp", "hsdp"):
        once, each = accumulated[strategy], synced[strategy]
        assert each["knobs"] == {"grad_accum": 3, "grad_accum_sync": "every"}
        sent, sent_once = each["comm_bytes_per_step"], once["comm_bytes_per_step"]
        assert sent["reduce_scatter"] == 3 * sent_once["reduce_scatter"]  # every micro-batch
        assert each["peak_bytes"] < once["peak_bytes"]  # no unsharded gradients held


def test_offload_moves_the_sharded_state_to_the_host_and_costs_its_copies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--offload cpu (issue 47): FSDP and HSDP rows keep their parameter, gradient and
    optimizer shards in host memory (host_bytes), the device peak without them, and the
    host-link copies per step (each parameter shard in before each of its 2 all-gathers, each
    gradient shard out once); the step costs the copies at the H100's PCIe rate and the
    optimizer at the host's bandwidth. DDP has nothing to offload: its row is the plain one.
    --compile is refused by the estimate by name."""
    from strategy_bench.estimate._time_inputs import HOST_LINK_EFFICIENCY, HOST_OPTIMIZER_GBS

    plain = {row["strategy"]: row for row in _estimate(tmp_path, "plain")}
    offloaded = {row["strategy"]: row for row in _estimate(tmp_path, "cpu", "--offload", "cpu")}
    assert offloaded["ddp"]["knobs"] == {} and "host_bytes" not in offloaded["ddp"]
    for strategy in ("fsdp", "hsdp"):
        row, base = offloaded[strategy], plain[strategy]
        assert row["knobs"] == {"offload": "cpu"}
        state = row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"]
        assert row["host_bytes"] == state > 0
        assert row["device_peak_bytes"] == row["peak_bytes"] - state
        assert row["offload_h2d_bytes_per_step"] == 2 * row["param_bytes"]
        assert row["offload_d2h_bytes_per_step"] == row["grad_bytes"]
        copies = row["offload_h2d_bytes_per_step"] + row["offload_d2h_bytes_per_step"]
        link = 64e9 * HOST_LINK_EFFICIENCY
        parts, base_parts = row["predicted_parts_ms"], base["predicted_parts_ms"]
        assert parts["host_copy"] == pytest.approx(copies / link * 1e3)
        slower = 3350 / HOST_OPTIMIZER_GBS  # the H100's HBM against the host's bandwidth
        assert parts["optimizer"] == pytest.approx(base_parts["optimizer"] * slower)
        assert row["predicted_step_ms"] > base["predicted_step_ms"]
    args = ["estimate", "--models", "tiny", "--world-size", "16", "--gpu", "H100", "--compile"]
    assert main([*args, "--out", str(tmp_path / "compiled")]) == 2
    assert "--compile: the estimate steps the model on fake tensors" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_run_measures_the_recipe_keys(tmp_path: Path) -> None:
    """run --offload cpu --activation-checkpointing selective on 2 gloo ranks: the FSDP row
    carries both keys and the bytes it keeps in host memory (all of its shards, on a CPU run);
    compile's first-step seconds are their own field and column (empty without --compile).
    DDP's share of a recipe (no offload) is test_the_offload_knob_is_strategy_configs'."""
    out = tmp_path / "run"
    recipe = ("--offload", "cpu", "--activation-checkpointing", "selective")
    done = bench(
        "run", *QUICK, "--models", "tiny", "--strategies", "fsdp", *recipe, "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    (fsdp,) = json.loads((out / "results.json").read_text())["results"]
    assert fsdp["knobs"] == {"activation_checkpointing": "selective", "offload": "cpu"}
    state = fsdp["param_bytes"] + fsdp["grad_bytes"] + fsdp["optimizer_bytes"]
    assert fsdp["host_bytes"] == pytest.approx(state, rel=0.05) and state > 0
    assert fsdp["compile_s"] is None
    assert "compile s" in (out / "report.md").read_text()


def test_the_offload_knob_is_strategy_configs() -> None:
    """The bench's offload knob: strategy-config's values and DDP refusal, dropped from DDP's
    share of a recipe; FSDP gets wrap_module_fsdp's bool."""
    from strategy_bench._errors import BenchUsageError
    from strategy_bench.workload import fsdp_wrap_knobs, offloads, recipe_for

    assert offloads("fsdp", {"offload": "CPU"}) and not offloads("fsdp", {})
    with pytest.raises(BenchUsageError, match=r"offload='cpu' needs a sharded strategy"):
        offloads("ddp", {"offload": "cpu"})
    with pytest.raises(
        BenchUsageError,
        match=r"offload must be one of \{none, cpu\}, got .gpu. \(did you mean .cpu.\?\)",
    ):
        offloads("fsdp", {"offload": "gpu"})
    assert recipe_for("ddp", {"offload": "cpu", "compile": True}) == {"compile": True}
    assert fsdp_wrap_knobs("hsdp", {"offload": "cpu", "grad_accum": 2}) == {"offload": True}


def test_a_calibrated_full_checkpoint_recomputes_the_forward_a_selective_does_not() -> None:
    """Calibrated without checkpointing: full adds the forward again (+1/3), selective adds no
    matmul (its recompute is the cheap ops)."""
    model = TimeModel(
        links={"intra_node": _links(INTRA_GBS), "inter_node": _links(NIC_GBS)},
        points={},
        models={("m", "fp32", "fp32", None): {"ms_per_sample": 3.0, "optimizer_ms": 0.0}},
        flops_rate=None,
        peak_flops=None,
        gpus_per_node=8,
        sources={},
        calibrated=True,
    )
    steps = {}
    for mode in ("none", "full", "selective"):
        row = {**_row("ddp", 1, {}), "dtype": "fp32", "knobs": {"activation_checkpointing": mode}}
        steps[mode] = predict(row, model)["predicted_step_ms"]
    assert steps == pytest.approx({"none": 3.0, "full": 4.0, "selective": 3.0})


def test_mpt_13b_is_predicted_flat_from_8_to_64_h100s(monkeypatch: pytest.MonkeyPatch) -> None:
    """LLM Foundry's MPT-13B on H100 trained at 4,767-4,811 tokens/s/GPU from 8 to 64 GPUs.
    With the NICs of a node counted, the estimate is flat within 5% there and FSDP no more than
    15% behind HSDP (one NIC per ring gave 0.28x and 'HSDP 122% faster')."""
    monkeypatch.syspath_prepend(str(DOCS / "examples"))
    spec = WorkloadSpec(
        model_factory="published_models:mpt_13b",
        input_factory="published_models:mpt_batch",
        tokens_per_sample=2048,
    )
    options = EstimateOptions(batch_size=2, dtype="bf16")
    model = datasheet_model("H100", "bf16", assumed_mfu=None, inter_node_gbps=None, gpus_per_node=8)
    assert model is not None
    knobs = {"reduce_dtype": "bf16"}
    tokens = {}
    for strategy, world in (("fsdp", 8), ("fsdp", 64), ("hsdp", 64)):
        row = estimate_point(spec, EstimatePoint(0, strategy, knobs, world), options)
        assert row["status"] == "ok", row
        assert row["params"] == 12_853_954_560  # the published count
        row["flops_per_sample"] = 6 * 12_853_954_560 * 2048  # the step's model FLOPs, about
        tokens[(strategy, world)] = predict(row, model)["predicted_tokens_per_s_per_gpu"]
    assert tokens[("fsdp", 64)] == pytest.approx(tokens[("fsdp", 8)], rel=0.05), tokens
    assert tokens[("fsdp", 64)] >= 0.85 * tokens[("hsdp", 64)], tokens


def test_the_committed_side_by_side_holds_the_published_record() -> None:
    """docs/results/estimate-published (benchmarks/published_runs.py): every run within
    0.75-1.33x of its published tokens/s/GPU, the median within 15%, the issue's 80 GB runs
    fit and no other 80 GB run is estimated more than 2% over the usable memory."""
    payload = json.loads(PUBLISHED.read_text())
    entries = payload["entries"]
    assert len(entries) >= 10
    usable = 79.2 - DEVICE_RESERVE_BYTES / 2**30  # an 80 GB part as CUDA sees it, less the reserve
    for entry in entries:
        assert 0.75 <= entry["ratio"] <= 1.33, entry
        if entry["memory_gb"] == 80 and entry["gpu"] == "H100":  # the named runs
            assert entry["fits"], entry
        if entry["memory_gb"] == 80:  # the others: at most 2% over (MPT-7B 6 x 2 on A100s)
            assert entry["peak_gib"] <= 1.02 * usable, entry
    checks = payload["checks"]
    assert checks["median_abs_error"] <= 0.15 and checks["mpt13b_spread"] <= 0.05
    assert checks["mpt13b_fsdp_behind_hsdp_max"] <= 0.15


def test_the_published_side_by_side_plots(tmp_path: Path) -> None:
    """The committed published.json draws as published.png (published_runs.py --plot-only),
    and the committed README links that plot."""
    entries = json.loads(PUBLISHED.read_text())["entries"]
    assert_png(plot_published(entries, tmp_path / "published.png"))
    assert "](published.png)" in (PUBLISHED.parent / "README.md").read_text()


@pytest.mark.multiprocess
def test_compute_ms_runs_in_the_points_parameter_dtype(tmp_path: Path) -> None:
    """A point with bf16 parameters computes in bf16 under FSDP; its compute_ms (the unwrapped
    fp32 copy the time model calibrates from) must too, not in fp32."""
    log = tmp_path / "dtypes.log"
    done = bench(
        "run",
        *QUICK[:2],
        *("--world-size", "1", "--steps", "2", "--warmup", "1", "--ckpt-samples", "0"),
        *("--model-factory", "bench_factories:dtype_probe"),
        *USER_MODEL[4:6],
        *("--strategies", "fsdp", "--param-dtype", "bf16", "--probe-mib"),
        *("--out", str(tmp_path / "out")),
        env={"BENCH_DTYPE_LOG": str(log)},
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    seen = [tuple(line.split()) for line in log.read_text().splitlines()]
    real = {(kind, out) for kind, is_real, out in seen if is_real == "True"}
    # The FSDP steps and the unwrapped copy (compute_ms), both in bf16.
    assert real == {("FSDPDtypeProbe", "torch.bfloat16"), ("DtypeProbe", "torch.bfloat16")}, seen
    row = json.loads((tmp_path / "out" / "results.json").read_text())["results"][0]
    assert row["knobs"] == {"param_dtype": "bf16", "reduce_dtype": "fp32"}
    assert row["compute_ms"] > 0
