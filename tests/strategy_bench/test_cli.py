"""strategy-bench end to end on CPU: real spawned gloo ranks, real JSON and PNGs."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest

from bench_cli import QUICK, USER_MODEL, assert_png, bench, exit_code
from strategy_bench import SCHEMA, read_results
from strategy_bench.measure import PROBE_KINDS


@pytest.fixture(scope="module")
def smoke_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One short run of tiny (DDP and FSDP on 2 ranks), shared by the tests that read it."""
    out = tmp_path_factory.mktemp("smoke") / "run"
    three = [*QUICK[:-2], "--ckpt-samples", "3"]  # the default, with its median and range
    done = bench("run", *three, "--models", "tiny", "--peak-tflops", "0.5", "--out", str(out))
    return done, out


@pytest.mark.multiprocess
def test_run_smoke(
    smoke_run: tuple[subprocess.CompletedProcess[str], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    done, out = smoke_run
    assert done.returncode == 0, done.stderr
    payload = json.loads((out / "results.json").read_text())
    assert payload["schema"] == SCHEMA == 2
    assert payload["env"]["peak_flops"] == 0.5e12
    assert payload["env"]["peak_flops_source"] == "--peak-tflops 0.5"
    assert payload["env"]["matmul_flops"] is None  # measured on CUDA only
    env = payload["env"]
    assert env["backend"] == "gloo" and env["device"] == "cpu" and env["world_size"] == 2
    assert env["torch"] and "git" in env
    rows = payload["results"]
    assert [(r["strategy"], r["model"]) for r in rows] == [("ddp", "tiny"), ("fsdp", "tiny")]
    for row in rows:
        assert row["world_size"] == 2 and row["backend"] == "gloo"
        for key in (
            "init_ms",
            "init_rank0_ms",
            "wrap_ms",
            "raw_wrap_ms",
            "wrap_cold_ms",
            "raw_wrap_cold_ms",
            "step_ms_median",
            "samples_per_s",
            "tokens_per_s",
        ):
            assert row[key] > 0, key
        assert row["step_ms_p10"] <= row["step_ms_median"] <= row["step_ms_p90"]
        assert row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * 64)
        assert len(row["step_ms"]) == 2
        assert len(row["peak_mem_per_rank"]) == 2 and row["peak_mem_bytes"] > 0
        assert row["peak_reserved_bytes"] == row["peak_mem_bytes"]  # CPU: both are the RSS
        assert len(row["wrap_cold_ms_all"]) == len(row["raw_wrap_cold_ms_all"]) == 3
        assert row["wrap_cold_ms"] in row["wrap_cold_ms_all"]  # the median of 3
        for key in ("ckpt_save_ms", "raw_ckpt_save_ms", "ckpt_load_ms", "ckpt_async_stall_ms"):
            assert len(row[f"{key}_all"]) == 3 and row[key] in row[f"{key}_all"], key
        # FLOPs counted over a step of the model agree with the preset's formula.
        assert row["flops_per_sample"] == pytest.approx(row["analytic_flops_per_sample"], rel=0.05)
        assert row["mfu"] == pytest.approx(row["achieved_flops_per_rank"] / 0.5e12)
        assert row["mfu_vs_matmul"] is None
    # The probe on 2 gloo ranks: each collective fitted (positive and finite) or listed as not
    # fitted with its reason (under load a small message can outlast a large one).
    probe = env["comm_probe"]
    assert probe["sizes_mib"] == [0.0625, 16.0]
    assert set(probe) <= {"sizes_mib", "intra_node", "not_fitted"}, probe
    missing = probe.get("not_fitted", {}).get("intra_node", {})
    assert set(probe.get("not_fitted", {})) <= {"intra_node"}
    assert sorted([*probe.get("intra_node", {}), *missing]) == sorted(PROBE_KINDS)
    assert all("times do not grow with the message size" in why for why in missing.values())
    for fit in probe.get("intra_node", {}).values():
        assert math.isfinite(fit["busbw_gbps"]) and fit["busbw_gbps"] > 0, fit
        assert math.isfinite(fit["latency_us"]) and fit["latency_us"] >= 0, fit
        assert fit["ranks"] == 2 and len(fit["samples"]) == 2
    for row in rows:  # the step without communication, and its optimizer part (timed apart)
        assert row["compute_ms"] > 0 and row["optimizer_ms"] > 0, row
    read_results(out / "results.json")  # the schema check accepts it
    for name in (
        "throughput",
        "wrap_overhead",
        "memory",
        "step_spread",
        "init_time",
        "memory_breakdown",
        "checkpoint",
    ):
        assert_png(out / f"{name}.png")
    report = (out / "report.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert len(images) == 7 and all((out / image).exists() for image in images)
    assert "- `tiny`: FSDP ran at " in report
    assert "x DDP's bytes per step" in report and "% of static memory per rank" in report
    assert "0.5 TFLOP/s per rank (--peak-tflops 0.5)" in report
    assert "ckpt save / raw / load / async stall ms, median (range)" in report
    assert report.count(", 3 samples |") == 2
    assert "[1/2] ddp tiny" in done.stderr and "[2/2] fsdp tiny" in done.stderr
    assert "FSDP/DDP throughput" in done.stdout and "step ms (p10-p90)" in done.stdout
    assert "peak MiB alloc/reserved" in done.stdout

    # The estimate of the same points (fake process group, meta and fake tensors) agrees
    # with what the run measured on 2 real ranks, under both strategies.
    estimated = tmp_path / "estimate"
    code = exit_code(
        [
            "estimate",
            "--models",
            "tiny",
            "--world-size",
            "2",
            "512",
            "--batch-size",
            "2",
            "--jobs",
            "1",
            "--compare",
            str(out / "results.json"),
            "--out",
            str(estimated),
        ]
    )
    assert code == 0, capsys.readouterr().err
    estimate = json.loads((estimated / "estimate.json").read_text())
    checked = {row["strategy"]: row for row in estimate["agreement"]}
    assert sorted(checked) == ["ddp", "fsdp"]
    for row in checked.values():
        assert row["world_size"] == 2 and row["ok"], row
        assert row["static_error"] <= 0.05, row
        assert row["activation_error"] <= 0.20, row
        assert row["comm_error"] <= 0.01, row
        assert row["peak_error"] <= 0.10, row  # the tracked step's peak, run vs fake
    assert "estimate vs measured:" in capsys.readouterr().out
    assert_png(estimated / "estimate.png")
    # The init phase per source: "local" holds the whole model on every rank's host,
    # "rank0" on rank 0's only; FSDP's device never holds the whole model (512 ranks).
    init = {
        (r["strategy"], r["world_size"]): r["init_peak_bytes"]
        for r in estimate["rows"]
        if not r["knobs"]
    }
    whole = init[("ddp", 2)]["local"]["device"]
    for (strategy, _), peaks in init.items():
        assert peaks["local"]["host_rank0"] == peaks["local"]["host_other"] == whole, strategy
        assert peaks["rank0"]["host_rank0"] == whole and peaks["rank0"]["host_other"] == 0
    assert init[("fsdp", 512)]["rank0"]["device"] < init[("fsdp", 2)]["rank0"]["device"] < whole
    assert init[("fsdp", 512)]["local"]["device"] < whole

    compare = tmp_path / "compare"
    replot = ["plot", str(out / "results.json"), str(out / "results.json"), "--out", str(compare)]
    assert exit_code(replot) == 0
    assert_png(compare / "throughput.png")


@pytest.fixture(scope="module")
def user_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A run of the user's own model (factories), shared by the tests that read it."""
    out = tmp_path_factory.mktemp("user") / "user"
    return bench("run", *QUICK, *USER_MODEL, "--out", str(out)), out


@pytest.mark.multiprocess
def test_user_model_end_to_end(
    user_run: tuple[subprocess.CompletedProcess[str], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    done, out = user_run
    assert done.returncode == 0, done.stderr
    rows = json.loads((out / "results.json").read_text())["results"]
    assert {r["model"] for r in rows} == {"make_model"}
    params, trainable = 4 * (16 * 16 + 16), 3 * (16 * 16 + 16)  # the stem is frozen
    for row in rows:
        assert row["params"] == params and row["trainable_params"] == trainable
        assert row["tokens_per_s"] is None and row["samples_per_s"] > 0
        assert row["flops_per_sample"] > 0 and row["analytic_flops_per_sample"] is None
        assert row["ckpt_save_ms"] > 0 and row["raw_ckpt_save_ms"] > 0 and row["ckpt_bytes"] > 0
    # Exact local storage per rank (fp32; AdamW: two moments and a 4-byte step per tensor)
    # and the exact bytes each collective moves in one step, on 2 ranks.
    ddp, fsdp = rows
    assert (ddp["strategy"], fsdp["strategy"]) == ("ddp", "fsdp")
    assert ddp["param_bytes"] == 4 * params
    assert ddp["grad_bytes"] == 4 * trainable
    assert ddp["optimizer_bytes"] == 2 * 4 * trainable + 4 * 6
    assert ddp["comm_bytes_per_step"] == {"all_reduce": 4 * trainable}  # each gradient once
    assert fsdp["param_bytes"] == 4 * params // 2  # a shard: half of every tensor
    assert fsdp["grad_bytes"] == 4 * trainable // 2
    assert fsdp["optimizer_bytes"] == 4 * trainable + 4 * 6
    assert fsdp["comm_bytes_per_step"] == {
        # every block in forward and again in backward (resharded); the root's own (the stem)
        # once: torch keeps them from the forward to the backward
        "all_gather": 2 * 4 * params - 4 * (16 * 16 + 16),
        "reduce_scatter": 4 * trainable,  # every trainable gradient once
    }
    for row in rows:
        assert row["activation_peak_bytes"] > 0

    # The estimate of the user model, trainable policy included, at 2 ranks (checked against
    # the run) and at 64: a shard per rank, padded (16 rows do not split in 64).
    estimated = tmp_path / "estimate"
    args = ["estimate", *USER_MODEL, "--world-size", "2", "64", "--batch-size", "2"]
    args += ["--jobs", "2", "--compare", str(out / "results.json"), "--out", str(estimated)]
    assert exit_code(args) == 0, capsys.readouterr().err
    estimate = json.loads((estimated / "estimate.json").read_text())
    assert len(estimate["agreement"]) == 2 and all(r["ok"] for r in estimate["agreement"])
    by = {(r["strategy"], tuple(r["knobs"].items()), r["world_size"]): r for r in estimate["rows"]}
    assert by[("ddp", (), 64)]["param_bytes"] == 4 * params  # every rank holds all of it
    assert by[("ddp", (), 64)]["comm_bytes_per_step"] == {"all_reduce": 4 * trainable}
    wide = by[("fsdp", (), 64)]
    # Rank 0 of 64 holds one row of each of the 4 weights and one element of each bias.
    assert wide["param_bytes"] == 4 * 4 * (16 + 1)
    assert wide["trainable_params"] == trainable and wide["params"] == params
    unsharded = by[("fsdp", (("reshard_after_forward", False),), 64)]
    assert (
        unsharded["comm_bytes_per_step"]["all_gather"] < wide["comm_bytes_per_step"]["all_gather"]
    )
    mixed = by[("fsdp", (("param_dtype", "bf16"), ("reduce_dtype", "fp32")), 64)]
    assert (
        mixed["comm_bytes_per_step"]["all_gather"] * 2 == wide["comm_bytes_per_step"]["all_gather"]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--strategies", "zero"], "argument --strategies: invalid choice: 'zero'"),
        (["run", "--models", "huge"], "argument --models: invalid choice: 'huge'"),
        (["run", "--device", "cpu", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["run", "--device", "cpu", "--world-size", "0"], "--world-size must be >= 1, got 0"),
        (
            [
                "run",
                "--device",
                "cpu",
                "--model-factory",
                "nowhere.at_all:f",
                "--input-factory",
                "bench_factories:make_batch",
            ],
            "cannot import module 'nowhere.at_all'",
        ),
        (
            [
                "run",
                "--device",
                "cpu",
                "--model-factory",
                "bench_factories:NOT_CALLABLE",
                "--input-factory",
                "bench_factories:make_batch",
            ],
            "is a int, not a callable",
        ),
        (
            [
                "run",
                "--device",
                "cpu",
                "--model-factory",
                "bench_factories:missing",
                "--input-factory",
                "bench_factories:make_batch",
            ],
            "has no attribute 'missing'",
        ),
        (
            [
                "run",
                "--device",
                "cpu",
                "--model-factory",
                "bench_factories",
                "--input-factory",
                "bench_factories:make_batch",
            ],
            "must look like 'package.module:callable'",
        ),
        (
            [
                "run",
                "--device",
                "cpu",
                "--model-factory",
                "bench_factories:not_a_module",
                "--input-factory",
                "bench_factories:make_batch",
            ],
            "returned str, not an nn.Module",
        ),
        (
            [
                "run",
                "--device",
                "cpu",
                "--model-factory",
                "bench_factories:make_model",
                "--input-factory",
                "bench_factories:bad_batch",
            ],
            "the input factory returned int",
        ),
        (
            ["run", "--device", "cpu", "--model-factory", "bench_factories:make_model"],
            "add --input-factory",
        ),
        (
            [
                "run",
                "--device",
                "cpu",
                "--model-factory",
                "bench_factories:make_model",
                "--input-factory",
                "bench_factories:make_batch",
                "--init-params",
                "[1]",
            ],
            "--init-params must be a JSON object",
        ),
        (["sweep", "--device", "cpu", "--memory-budget", "lots"], "--memory-budget must be a size"),
        (
            ["sweep", "--device", "cpu", "--memory-budget", "0MiB"],
            "--memory-budget must be positive",
        ),
        (["sweep", "--device", "cpu", "--time-budget", "0"], "--time-budget must be positive"),
        (["run", "--device", "cpu", "--time-budget", "-5"], "--time-budget must be positive"),
        (["run", "--device", "cpu", "--ckpt-samples", "-1"], "--ckpt-samples must be >= 0"),
        (["sweep", "--device", "cpu", "--max-points", "0"], "--max-points must be >= 1, got 0"),
        (["run", "--device", "cpu", "--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["run", "--device", "cpu", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["run", "--device", "cpu", "--seq-len", "1"], "--seq-len must be >= 2, got 1"),
        (["run", "--device", "cpu", "--init-params", "{}"], "--init-params and --trainable need"),
        (
            [
                "run",
                "--device",
                "cpu",
                "--model-factory",
                "bench_factories:make_model",
                "--input-factory",
                "bench_factories:make_batch",
                "--init-params",
                "{oops",
            ],
            "--init-params must be a JSON object",
        ),
        (["plot", "/nonexistent/results.json"], "cannot read results file"),
        (["estimate", "--world-size", "8", "0"], "--world-size must be >= 1, got 0"),
        (["estimate", "--jobs", "0"], "--jobs must be >= 1, got 0"),
        (["estimate", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["estimate", "--compare", "/nonexistent/results.json"], "cannot read results file"),
        (
            [
                "estimate",
                "--model-factory",
                "bench_factories:NeedsData",
                "--input-factory",
                "bench_factories:make_batch",
            ],
            "the model is built on the meta device (no memory), and NeedsData(**{}) failed there",
        ),
        (
            ["sweep", "--device", "cpu", "--knobs", "warp_speed"],
            "--knobs: unknown knob 'warp_speed'; the sweep's knobs are activation_checkpointing",
        ),
        (
            ["run", "--device", "cpu", "--peak-tflops", "0"],
            "--peak-tflops must be positive TFLOP/s, got 0.0",
        ),
        (
            ["run", "--device", "cpu", "--overwrite", "--resume"],
            "--overwrite and --resume exclude each other; pick one",
        ),
        (
            ["estimate", "--device-memory", "-4"],
            "--device-memory must be a number of GiB above the 2 GiB reserved for the CUDA "
            "context and NCCL, got -4",
        ),
        (
            ["estimate", "--gpu", "H300"],
            "--gpu 'H300' is not in the datasheet table; known: B200, H200, H100, A100-80GB",
        ),
        (
            ["estimate", "--gpu", "H100", "--device-memory", "80"],
            "argument --device-memory: not allowed with argument --gpu",
        ),
        (["estimate", "--largest"], "--largest needs the device: give --gpu NAME or"),
        (
            ["estimate", "--scale-param", "depth"],
            "--scale-param names what --largest scales; add --largest",
        ),
        (
            ["estimate", "--largest", "--gpu", "H100", *USER_MODEL[:2], *USER_MODEL[4:6]],
            "--largest with --model-factory needs --scale-param NAME (an integer init parameter",
        ),
        (["estimate", "--gpus-per-node", "0"], "--gpus-per-node must be >= 1, got 0"),
        (
            ["run", "--device", "cpu", "--strategies", "hsdp"],
            "HSDP needs at least 4 ranks, an even number on one host (2 x world/2), got a world "
            "of 2; use --world-size 4, or leave hsdp out of --strategies",
        ),
        (
            ["estimate", "--largest", "--gpu", "H100", *USER_MODEL[:6], "--scale-param", "wide"],
            "--scale-param 'wide': the model factory 'make_model' takes no such parameter "
            "(it takes: depth, width)",
        ),
        (
            ["run", "--probe-mib", "0"],
            "--probe-mib takes two sizes or more, each above 0 MiB (or none), got 0",
        ),
        (["run", "--threads-per-rank", "0"], "--threads-per-rank must be >= 1, got 0"),
        (["estimate", "--inter-node-gbps", "0"], "--inter-node-gbps must be positive, got 0"),
        (
            ["estimate", "--gpu", "H100", "--assumed-mfu", "1.5"],
            "--assumed-mfu must be in (0, 1], got 1.5",
        ),
        (
            ["estimate", *USER_MODEL[:2], *USER_MODEL[4:6], "--seq-len", "64"],
            "--seq-len 64 sets a preset's sequence length, and --model-factory's length is what "
            "its --input-factory makes; drop --seq-len, make the input factory produce that "
            "length, and give --tokens-per-sample N for tokens/s",
        ),
        (
            ["estimate", "--tokens-per-sample", "64"],
            "--tokens-per-sample 64 is for --model-factory; a preset knows its own",
        ),
        (
            ["estimate", *USER_MODEL[:2], *USER_MODEL[4:6], "--tokens-per-sample", "0"],
            "--tokens-per-sample must be >= 1, got 0",
        ),
        (["run", "--grad-accum", "0"], "--grad-accum must be >= 1 (micro-batches per optimizer"),
        (["estimate", "--grad-accum", "-2"], "--grad-accum must be >= 1"),
        (
            ["estimate", "--grad-accum-sync", "every"],
            "--grad-accum-sync every says how an accumulation reduces; add --grad-accum N",
        ),
        (
            ["estimate", "--activation-checkpointing", "some"],
            "argument --activation-checkpointing: invalid choice: 'some'",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process: the checks run before any rank is spawned."""
    assert exit_code(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("strategy-bench: error: ") and message in lines[0], lines[0]
    assert captured.out == ""


def test_resume_needs_results_and_something_to_measure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process, before any rank starts; the results file is left as it was."""
    out = tmp_path / "run"
    assert exit_code(["run", "--device", "cpu", "--resume", "--out", str(out)]) == 2
    assert "--resume but" in capsys.readouterr().err and not out.exists()
    out.mkdir()
    failed = {"status": "failed", "knobs": {}, "error": "x"}
    payload = {
        "schema": 2,
        "env": {},
        "results": [{**failed, "model": "tiny", "strategy": s} for s in ("ddp", "fsdp")],
        "skipped": [],
    }
    (out / "results.json").write_text(json.dumps(payload))
    args = ["run", "--device", "cpu", "--models", "tiny", "--resume", "--out", str(out)]
    assert exit_code(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds every point of this run; nothing to measure" in err[0]
    assert json.loads((out / "results.json").read_text()) == payload


def test_estimate_keeps_an_earlier_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process: --out is checked before anything is estimated; nothing is overwritten."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert exit_code(["estimate", "--models", "tiny", "--out", str(a_file)]) == 2
    assert "is a file; give a directory for the estimate" in capsys.readouterr().err
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "estimate.json").write_text("{}")
    assert exit_code(["estimate", "--models", "tiny", "--out", str(earlier)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "already holds an estimate; pass --overwrite or another --out" in err[0]
    )
    assert (earlier / "estimate.json").read_text() == "{}"


def test_estimate_of_a_model_that_reads_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process (fake process groups only): each point gets a failed row with the reason,
    the command says what the model must avoid and exits 1."""
    args = ["estimate", "--model-factory", "bench_factories:ReadsValues"]
    args += ["--input-factory", "bench_factories:make_batch", "--world-size", "2", "4"]
    args += ["--strategies", "fsdp", "--jobs", "1", "--out", str(tmp_path)]
    assert exit_code(args) == 1
    rows = json.loads((tmp_path / "estimate.json").read_text())["rows"]
    assert len(rows) == 3 * 2 and {row["status"] for row in rows} == {"failed"}
    assert all(row["error"] for row in rows)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("strategy-bench: could not")]
    assert len(lines) == 1, err  # one line per model
    assert "could not estimate ReadsValues (6 point(s) failed" in lines[0]
    assert "no .item()" in lines[0]


def test_cuda_requests_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        code = exit_code(
            ["run", "--device", "cuda", "--world-size", str(torch.cuda.device_count() + 1)]
        )
        message = "GPU(s) are visible"
    else:
        code = exit_code(["run", "--device", "cuda"])
        message = "--device cuda but no CUDA device is visible"
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.multiprocess
def test_a_failing_rank_ends_the_run_promptly(tmp_path: Path) -> None:
    done = bench(
        "run",
        *QUICK,
        "--strategies",
        "ddp",
        "--model-factory",
        "bench_factories:fail_on_rank1",
        "--input-factory",
        "bench_factories:make_batch",
        "--out",
        str(tmp_path),
        timeout=240,
    )
    assert done.returncode == 1
    assert "rank 1 failed" in done.stderr
    assert "model construction failed on rank 1 (on purpose)" in done.stderr
    assert "Traceback" in done.stderr
    # Rank 0 waits in a collective that would only time out after 300 s; the run ended within
    # bench()'s deadline, set below that (a deadline, not a timing: it took ~15 s here), so
    # the watchdog ended it.


@pytest.mark.multiprocess
def test_every_rank_exits_0_run_after_run(
    smoke_run: tuple[subprocess.CompletedProcess[str], Path],
    user_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """Ranks that measured a point in full exit 0, run after run: a rank once aborted at
    teardown ("terminate called without an active exception", exit -6) and its complete
    point was recorded failed. (A rank that still fails after its point's results were
    written is tested in test_kept_results.) Two runs of this module, one after the other:
    the smoke run and the user model's."""
    for done, out in (smoke_run, user_run):
        assert done.returncode == 0, done.stderr
        assert "failed" not in done.stderr and "terminate called" not in done.stderr
        rows = json.loads((out / "results.json").read_text())["results"]
        assert [(r["strategy"], r["status"]) for r in rows] == [("ddp", "ok"), ("fsdp", "ok")]
        assert not any("teardown_error" in r for r in rows)
