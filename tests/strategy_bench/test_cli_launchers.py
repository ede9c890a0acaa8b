"""strategy-bench end to end under its launchers: torchrun, 2 nodes of 2, sweeps, kept results.

Apart from test_cli.py so that the strategy-bench session's two pytest workers share the work.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench_cli import QUICK, SUPPORT, assert_png, bench, exit_code
from distributed_strategy import DistributedConfig
from strategy_bench import sweep_points


@pytest.mark.multiprocess
def test_under_torchrun(tmp_path: Path) -> None:
    """torchrun starts the ranks; strategy-bench takes the rendezvous from the environment."""
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    done = bench(
        "run",
        "--device",
        "cpu",
        "--models",
        "tiny",
        "--strategies",
        "ddp",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--batch-size",
        "2",
        "--out",
        str(tmp_path),
        launcher=torchrun,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["env"]["world_size"] == 2
    assert [(r["strategy"], r["world_size"]) for r in payload["results"]] == [("ddp", 2)]
    assert done.stdout.count("results: ") == 1  # rank 0 alone reports
    assert_png(tmp_path / "throughput.png")


@pytest.mark.multiprocess
def test_hsdp_point_under_torchrun_two_nodes_of_two(tmp_path: Path) -> None:
    """Two torchrun agents on loopback, 2 ranks each (about 30 s here): HSDP shards within a
    node and replicates across the two; its bytes are split by mesh dimension."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])

    def torchrun(node: int) -> tuple[str, ...]:
        return (
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
        )

    args = ("run", "--device", "cpu", "--models", "tiny", "--strategies", "hsdp")
    args += ("--steps", "2", "--warmup", "1", "--batch-size", "2", "--out", str(tmp_path))
    path = os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    other = subprocess.Popen(
        [sys.executable, *torchrun(1), "-m", "strategy_bench", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    try:
        done = bench(*args, launcher=torchrun(0))
        _, other_err = other.communicate(timeout=120)
    finally:
        other.kill()
    assert done.returncode == 0, done.stderr[-3000:]
    assert other.returncode == 0, other_err[-3000:]
    (row,) = json.loads((tmp_path / "results.json").read_text())["results"]
    assert (row["strategy"], row["world_size"], row["status"]) == ("hsdp", 4, "ok")
    by_dim = row["comm_bytes_by_dim"]
    assert set(by_dim) == {"shard", "replicate"}
    assert set(by_dim["shard"]) == {"all_gather", "reduce_scatter"}
    assert set(by_dim["replicate"]) == {"all_reduce"}
    # Each replica all-reduces its half of the gradients: half the shard group's input.
    assert 2 * by_dim["replicate"]["all_reduce"] == by_dim["shard"]["reduce_scatter"]
    assert "HSDP ran at" in (tmp_path / "report.md").read_text()


@pytest.mark.multiprocess
def test_sweep_rows_budget_and_recommendation(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    knobs = ("activation_checkpointing", "grad_accum", "compile")
    # No C++ compiler for inductor: the compile points are skipped with the reason, learnt
    # once, and do not count against --max-points.
    done = bench(
        "sweep",
        *QUICK,
        "--models",
        "tiny",
        "--knobs",
        *knobs,
        "--max-points",
        "4",
        "--out",
        str(out),
        env={"CXX": str(tmp_path / "no-such-compiler")},
    )
    assert done.returncode == 0, done.stderr
    payload = json.loads((out / "results.json").read_text())
    points = [p for p in sweep_points(bf16=True) if not p[1] or any(k in p[1] for k in knobs)]
    assert points[:5] == [
        ("ddp", {}),  # the baseline comes first
        ("fsdp", {}),
        ("fsdp", {"activation_checkpointing": "full"}),
        ("ddp", {"compile": True}),
        ("fsdp", {"compile": True}),
    ]
    rows = payload["results"]
    assert [(r["strategy"], r["knobs"]) for r in rows] == points[:3] + points[5:6]
    baseline, checkpointed, accumulated = rows[1], rows[2], rows[3]
    assert checkpointed["activation_peak_bytes"] < baseline["activation_peak_bytes"] / 2
    assert checkpointed["comm_bytes_per_step"] == baseline["comm_bytes_per_step"]
    assert accumulated["knobs"] == {"grad_accum": 4}
    assert accumulated["batch_size"] == 4 * 2  # samples per rank per optimizer step
    # One all-reduce per optimizer step: the first 3 micro-steps ran under no_sync.
    assert accumulated["comm_calls_per_step"] == {"all_reduce": 1}
    assert accumulated["comm_bytes_per_step"]["all_reduce"] == accumulated["grad_bytes"]
    assert [(s["strategy"], s["knobs"]) for s in payload["skipped"]] == points[3:5] + points[6:]
    compile_skips = payload["skipped"][:2]
    for skipped in compile_skips:
        assert skipped["reason"].startswith("torch.compile does not work on cpu: "), skipped
        assert "no-such-compiler" in skipped["reason"]
    assert all("--max-points 4" in s["reason"] for s in payload["skipped"][2:])
    assert "skipped: ddp tiny compile=True (torch.compile does not work on cpu" in done.stdout
    section = json.loads((out / "recommended.json").read_text())
    config = DistributedConfig.from_mapping(section)  # the step knobs are not in it
    best = max(rows, key=lambda r: r["samples_per_s"])
    assert config.strategy == best["strategy"]
    assert "training:\n  distributed:\n    strategy: " in done.stdout
    if best["knobs"]:
        step_knob = next(iter(best["knobs"]))
        assert (
            f"  # the trainer's step settings this point was measured with:\n  {step_knob}: "
            in (done.stdout)
        )
    assert_png(out / "sweep.png")

    tight = tmp_path / "tight"
    done = bench(
        "sweep",
        *QUICK,
        "--models",
        "tiny",
        "--time-budget",
        "0.2",
        "--memory-budget",
        "1MiB",
        "--out",
        str(tight),
    )
    assert done.returncode == 0, done.stderr
    payload = json.loads((tight / "results.json").read_text())
    assert len(payload["results"]) == 1  # the first point always runs; nothing else fits
    assert len(payload["skipped"]) == len(sweep_points(bf16=True)) - 1
    assert payload["skipped"][0] == {
        "model": "tiny",
        "strategy": "fsdp",
        "knobs": {},
        "reason": "time budget 0 s",
    }
    assert "no measured point fits --memory-budget 1 MiB" in done.stdout
    assert not (tight / "recommended.json").exists()


@pytest.mark.multiprocess
def test_kept_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing measured is lost: a bad --out stops before any rank starts, an earlier run is
    not overwritten, an out-of-memory point is recorded and the run goes on, --resume adds
    only the missing points. A model that fits only sharded is measured under FSDP and
    recorded out of memory under DDP, in one run, and the verdict says so."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    # The refusals come before any rank starts: checked in-process.
    assert exit_code(["run", *QUICK, "--models", "tiny", "--out", str(a_file)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"strategy-bench: error: --out {str(a_file)!r} is a file; give a directory for the results"
    ]

    out = tmp_path / "run"
    user = ["--model-factory", "bench_factories:oom_on_rank1"]
    user += ["--input-factory", "bench_factories:make_batch"]
    done = bench("run", *QUICK, *user, "--strategies", "ddp", "fsdp", "--out", str(out))
    assert done.returncode == 0, done.stderr  # an oom row is a finding, FSDP was measured
    first = json.loads((out / "results.json").read_text())
    assert first["schema"] == 2
    oom, sharded = first["results"]
    assert (oom["model"], oom["strategy"], oom["status"]) == ("oom_on_rank1", "ddp", "oom")
    assert oom["failed_rank"] == 1 and oom["peak_mem_bytes"] > 0
    assert "OutOfMemoryError: CUDA out of memory" in oom["error"]
    assert (sharded["strategy"], sharded["status"]) == ("fsdp", "ok")
    assert sharded["flops_per_sample"] > 0  # counted without computing unsharded
    assert "ddp oom_on_rank1: out of memory at" in done.stdout
    assert "going on with the next point" in done.stderr
    verdict = (out / "report.md").read_text()
    assert "`oom_on_rank1`: only FSDP fits: DDP ran out of memory at " in verdict

    capsys.readouterr()
    assert exit_code(["run", *QUICK, "--models", "tiny", "--out", str(out)]) == 2
    refused = capsys.readouterr().err
    assert "already holds results" in refused and "--resume" in refused
    assert json.loads((out / "results.json").read_text()) == first

    # Rank 1 aborts (SIGABRT, as a C++ std::terminate at teardown) after each complete
    # point: the measured row is kept with teardown_error, and the exit code stays 0.
    more = bench(
        "run",
        *QUICK,
        *user,
        "--models",
        "tiny",
        "--strategies",
        "ddp",
        "--resume",
        "--out",
        str(out),
        env={"STRATEGY_BENCH_TEST_ABORT_AT_EXIT": "1"},
    )
    assert more.returncode == 0, more.stderr
    rows = json.loads((out / "results.json").read_text())["results"]
    assert rows[:2] == first["results"]  # kept as they were
    assert [(r["model"], r["strategy"], r["status"]) for r in rows[2:]] == [("tiny", "ddp", "ok")]
    assert rows[2]["step_ms_median"] > 0
    teardown = "rank 1 failed at teardown: exited with code -6 without a traceback"
    assert rows[2]["teardown_error"] == teardown
    assert (
        f"strategy-bench: warning: [1/1] ddp tiny was measured in full, then {teardown}; the "
        "measured row is kept"
    ) in more.stderr
    assert f"- ddp tiny: {teardown}" in (out / "report.md").read_text()
    assert "1 configuration(s)" in more.stderr  # oom_on_rank1 ddp was there already
    assert "ddp oom_on_rank1: out of memory at" in more.stdout  # the table and report say so
    assert "out of memory" in (out / "report.md").read_text()
    assert_png(out / "throughput.png")  # the plots show the measured points
