"""strategy-bench's pieces that need no ranks: alternation, the memory budget, the timers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest

from dist_harness import run_ranks
from strategy_bench.measure._point import COLD_SAMPLES, _alternating
from strategy_bench.report import budgeted, recommend


def test_cold_and_warm_wraps_alternate_which_goes_first() -> None:
    order = _alternating(6)
    assert order == ["raw", "ours", "ours", "raw", "raw", "ours"]
    assert order.count("raw") == order.count("ours") == 3


def _row(strategy: str, speed: float, allocated: int, reserved: int | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "strategy": strategy,
        "model": "m",
        "knobs": {},
        "samples_per_s": speed,
        "peak_mem_bytes": allocated,
    }
    if reserved is not None:
        row["peak_reserved_bytes"] = reserved
    return row


def test_memory_budget_applies_to_reserved_memory() -> None:
    gib = 2**30
    # DDP allocates 30 GiB but its allocator reserves 44: it does not fit a 40 GiB budget.
    ddp = _row("ddp", 100.0, 30 * gib, 44 * gib)
    fsdp = _row("fsdp", 80.0, 20 * gib, 26 * gib)
    assert budgeted(ddp) == 44 * gib
    assert budgeted(_row("ddp", 1.0, 5, None)) == 5  # schema 1 rows: the allocated peak
    found = recommend([ddp, fsdp], 40 * gib)
    assert found is not None
    section, best, reason = found
    assert best is fsdp and section["strategy"] == "fsdp"
    assert "26624 MiB reserved" in reason
    assert recommend([ddp, fsdp], None) is not None
    assert recommend([ddp, fsdp], 10 * gib) is None


def test_timeout_under_torchrun_ends_the_rank() -> None:
    """Under torchrun no watchdog process exists: each rank's timer ends it."""
    code = textwrap.dedent(
        """
        import os, time
        os.environ["RANK"] = "3"
        from strategy_bench.launch._launch import _exit_after
        _exit_after(0.2)
        time.sleep(30)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert "strategy-bench: timed out (--timeout 0.2 s) on rank 3" in done.stderr


@pytest.mark.multiprocess
def test_each_cold_wrap_gets_a_new_group_that_is_destroyed() -> None:
    from bench_workers import cold_wrap_groups

    for result in run_ranks(cold_wrap_groups, world_size=1):
        assert len(result["made"]) == 2 * COLD_SAMPLES
        assert sorted(result["destroyed"]) == sorted(result["made"])
        assert len(result["cold"]) == COLD_SAMPLES
        assert result["ckpt_bytes"] > 0  # DTensor collectives after the groups were made
        assert result["live_at_step"] == [1]  # the step's model; every wrap copy freed


@pytest.mark.multiprocess
def test_the_probe_fits_each_link_of_a_run_across_nodes() -> None:
    """4 ranks as 2 nodes of 2: every collective timed inside a node (2 ranks) and across
    (one rank of each node), the same figures on every rank.

    Whether a fit exists depends on the machine's load (a 64 KiB collective can take longer
    than a 4 MiB one on a busy host), so each collective is either fitted or listed as not
    fitted with its reason; never silently missing. The fit itself is tested on synthetic
    times (test_time_model.py, test_the_fit_recovers_a_known_latency_and_bandwidth).
    """
    from bench_workers import probe_two_nodes

    results = run_ranks(probe_two_nodes, world_size=4)
    assert all(result == results[0] for result in results)
    probe = results[0]
    assert probe["sizes_mib"] == [0.0625, 4.0]
    not_fitted = probe.get("not_fitted", {})
    assert set(not_fitted) <= {"intra_node", "inter_node"}, probe
    for link in ("intra_node", "inter_node"):
        fitted = probe.get(link, {})
        missing = not_fitted.get(link, {})
        assert sorted([*fitted, *missing]) == ["all_gather", "all_reduce", "reduce_scatter"]
        for fit in fitted.values():
            assert fit["ranks"] == 2 and fit["busbw_gbps"] > 0 and fit["latency_us"] >= 0
            assert [size for size, _ in fit["samples"]] == [2**16, 2**22]
        for reason in missing.values():
            assert "times do not grow with the message size" in reason


def test_counted_flops_agree_with_the_preset_formula() -> None:
    import torch

    from strategy_bench import PRESETS, BenchTransformer
    from strategy_bench.measure import count_step_flops
    from strategy_bench.workload import next_token_loss, synthetic_tokens

    preset = PRESETS["small"]
    model = BenchTransformer(**preset.init_params())
    tokens = synthetic_tokens(
        2, preset.seq_len, preset.vocab, torch.device("cpu"), torch.Generator()
    )
    counted = count_step_flops(lambda: next_token_loss(model, tokens).backward()) / 2
    assert counted == pytest.approx(preset.flops_per_sample(), rel=0.05)
    # The embedding is a lookup: counting its parameters as matmul work overstated ~19%.
    with_embedding = preset.flops_per_sample() + 6 * preset.vocab * preset.width * preset.seq_len
    assert with_embedding / counted > 1.15


def test_peak_flops_sources() -> None:
    from strategy_bench.measure import datasheet_peak, peak_flops

    assert datasheet_peak("NVIDIA H100 80GB HBM3", "bf16") == (
        989.4e12,
        "datasheet: H100 dense bf16 989.4 TFLOP/s",
    )
    assert datasheet_peak("NVIDIA H100 PCIe", "fp32") == (
        51.2e12,
        "datasheet: H100 PCIe dense fp32 51.2 TFLOP/s",
    )
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", "bf16") is not None
    assert datasheet_peak("NVIDIA L40S", "bf16")[1].startswith("datasheet: L40S")  # not L4
    assert datasheet_peak("NVIDIA B200", "fp32") is None  # not in the table: no MFU
    assert datasheet_peak("AMD EPYC", "fp32") is None
    assert peak_flops("NVIDIA H200", "bf16", 500.0) == (500e12, "--peak-tflops 500")
    assert peak_flops("x86_64", "fp32", None) == (None, None)


def _tiny_model() -> Any:
    import torch

    from strategy_bench import PRESETS, BenchTransformer

    torch.manual_seed(0)
    return BenchTransformer(**PRESETS["tiny"].init_params())


def _grads(model: Any, tokens: Any) -> list[Any]:
    from strategy_bench.workload import next_token_loss

    model.zero_grad(set_to_none=True)
    next_token_loss(model, tokens).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_block_knobs_change_how_the_step_runs_not_what_it_computes() -> None:
    """Activation checkpointing and per-block compile (eager backend: no C++ compiler
    needed) on the shard units; the gradients stay those of the plain model."""
    import copy

    import torch

    from strategy_bench.measure import saved_activation_bytes
    from strategy_bench.workload import prepare_blocks

    tokens = torch.randint(0, 512, (2, 17))
    plain = _tiny_model()
    reference = _grads(plain, tokens)
    assert prepare_blocks(plain, {"grad_accum": 2}) == []  # not a block knob
    checkpointed = copy.deepcopy(plain)
    blocks = prepare_blocks(checkpointed, {"activation_checkpointing": True})
    assert {id(b) for b in blocks} == {id(b) for b in checkpointed.blocks}
    for got, want in zip(_grads(checkpointed, tokens), reference, strict=True):
        torch.testing.assert_close(got, want)
    with saved_activation_bytes(plain) as full:
        plain(tokens[:, :-1])
    with saved_activation_bytes(checkpointed) as kept:
        checkpointed(tokens[:, :-1])
    assert 0 < kept[0] < full[0] / 2  # a block keeps its input, not its activations
    twin = copy.deepcopy(checkpointed)  # the checkpointed forward follows the copy
    assert twin.blocks[0].forward.__self__ is twin.blocks[0]
    compiled = copy.deepcopy(plain)
    prepare_blocks(compiled, {"compile": "eager"})
    try:
        with warnings.catch_warnings():  # dynamo's tracing warns on torch internals
            warnings.simplefilter("ignore", UserWarning)
            grads = _grads(compiled, tokens)
        for got, want in zip(grads, reference, strict=True):
            torch.testing.assert_close(got, want)
        assert all(block._compiled_call_impl is not None for block in compiled.blocks)
    finally:
        torch.compiler.reset()


def test_selective_checkpointing_keeps_matmuls_and_changes_no_gradient() -> None:
    """``selective`` (torchtitan's op-level policy): the same gradients, bit for bit, as no
    checkpointing and ``full``; it keeps more than ``full`` (the matmul and attention outputs)
    and less than none, and the activation count sees what it keeps."""
    import copy

    import torch

    from strategy_bench.measure import saved_activation_bytes
    from strategy_bench.workload import checkpoint_mode, knob_key, prepare_blocks

    tokens = torch.randint(0, 512, (2, 17))
    plain = _tiny_model()
    reference = _grads(plain, tokens)
    kept = {}
    for mode in ("none", "full", "selective"):
        model = copy.deepcopy(plain)
        prepare_blocks(model, {"activation_checkpointing": mode})
        for got, want in zip(_grads(model, tokens), reference, strict=True):
            assert torch.equal(got, want), mode
        with saved_activation_bytes(model) as total:
            model(tokens[:, :-1])
        kept[mode] = total[0]
    assert kept["full"] < kept["selective"] < kept["none"], kept
    assert checkpoint_mode({"activation_checkpointing": True}) == "full"  # older results
    assert knob_key({"activation_checkpointing": True}) == (("activation_checkpointing", "full"),)
    with pytest.raises(Exception, match="must be one of none, full, selective, got 'some'"):
        checkpoint_mode({"activation_checkpointing": "some"})


def test_bf16_autocast_keeps_no_weight_cache() -> None:
    """bf16 autocast's weight cache held a bf16 copy of every FSDP-gathered weight through the
    whole forward; the bench's (and the estimate's) bf16 steps run without it."""
    import torch

    from strategy_bench.measure import autocast

    with autocast("bf16", torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu")
        assert not torch.is_autocast_cache_enabled()


def test_block_knobs_need_blocks() -> None:
    from torch import nn

    from strategy_bench._errors import BenchUsageError
    from strategy_bench.workload import micro_steps, prepare_blocks

    with pytest.raises(BenchUsageError, match="Linear has no repeated blocks"):
        prepare_blocks(nn.Linear(2, 2), {"activation_checkpointing": True})
    with pytest.raises(BenchUsageError, match="grad_accum must be an integer >= 1, got 0"):
        micro_steps({"grad_accum": 0})


def test_agreement_flags_each_kind_beyond_its_tolerance() -> None:
    from strategy_bench.estimate import agreement

    measured = {
        "model": "m",
        "strategy": "fsdp",
        "knobs": {},
        "world_size": 2,
        "batch_size": 2,
        "dtype": "fp32",
        "param_bytes": 100,
        "grad_bytes": 100,
        "optimizer_bytes": 200,
        "activation_peak_bytes": 1000,
        "comm_bytes_per_step": {"all_gather": 800, "reduce_scatter": 200},
    }
    close = {**measured, "activation_peak_bytes": 1190}  # 19%: within 20%
    assert [r["ok"] for r in agreement([close], [measured])] == [True]
    for change in (
        {"optimizer_bytes": 222},  # static 5.5% off
        {"activation_peak_bytes": 1210},  # 21%
        {"comm_bytes_per_step": {"all_gather": 811, "reduce_scatter": 200}},  # 1.1%
    ):
        [row] = agreement([{**measured, **change}], [measured])
        assert not row["ok"], change
    other_ranks = {**measured, "world_size": 4}
    assert agreement([other_ranks], [measured]) == []  # only the world sizes measured


def test_one_rank_runs_name_no_communication_winner(tmp_path: Any) -> None:
    """At world size 1 nothing is communicated: the verdict says what the ratio is and names
    no winner; report.md says what is compared."""
    from strategy_bench.report import ONE_RANK_NOTE, verdict, write_report

    def row(strategy: str, samples: float) -> dict[str, Any]:
        return {
            "model": "small",
            "strategy": strategy,
            "knobs": {},
            "world_size": 1,
            "status": "ok",
            "samples_per_s": samples,
            "param_bytes": 2**20,
            "grad_bytes": 2**20,
            "optimizer_bytes": 2**21,
            "ddp_bucket_bytes": 2**20 if strategy == "ddp" else 0,
            "activation_peak_bytes": 0,
            "step_ms_median": 1.0,
            "step_ms_p10": 1.0,
            "step_ms_p90": 1.0,
        }

    ddp, fsdp = row("ddp", 100.0), row("fsdp", 80.0)
    text = verdict(ddp, fsdp)
    assert text.startswith("- `small` at 1 rank: FSDP ran at 0.80x DDP's throughput")
    assert "no winner named" in text and "wins" not in text
    assert "static memory 4.0 vs 5.0 MiB" in text  # DDP's buckets count as static memory
    env = {"device": "cuda", "backend": "nccl", "world_size": 1, "options": {}}
    report = write_report(tmp_path, {"env": env, "results": [ddp, fsdp]}, []).read_text()
    assert ONE_RANK_NOTE in report and "no strategy wins on it" in report


@pytest.mark.multiprocess
def test_checkpoint_cost_keeps_one_checkpoint_and_records_failures() -> None:
    """One checkpoint on disk at a time (the raw save is gone before ours is written); too
    little free disk skips the measurement with the reason; a failing save is recorded as
    ``ckpt_error`` instead of failing the point."""
    from bench_workers import checkpoint_cost_cases
    from strategy_bench.measure._ckpt import CKPT_SAMPLED
    from strategy_bench.measure._options import CKPT_SAMPLES

    (result,) = run_ranks(checkpoint_cost_cases, world_size=1)
    # neither raw nor an earlier ours left, at any of the samples
    assert result["seen_at_ours"] == [[]] * (2 * CKPT_SAMPLES)
    # Alternating which goes first, sample by sample, starting as raw_first says.
    pairs = [result["order"][i : i + 2] for i in range(0, 4 * CKPT_SAMPLES, 2)]
    assert pairs[:CKPT_SAMPLES] == [["raw", "ours"], ["ours", "raw"], ["raw", "ours"]]
    assert pairs[CKPT_SAMPLES:] == [["ours", "raw"], ["raw", "ours"], ["ours", "raw"]]
    for raw_first in (True, False):
        out = result[f"normal_{raw_first}"]
        assert out["ckpt_bytes"] > 0 and "ckpt_error" not in out
        assert min(out["ckpt_save_ms"], out["raw_ckpt_save_ms"], out["ckpt_load_ms"]) > 0
        assert 0 < out["ckpt_async_stall_ms"]
        for key in CKPT_SAMPLED:  # the median of CKPT_SAMPLES samples, each kept
            assert len(out[f"{key}_all"]) == CKPT_SAMPLES
            assert out[key] == sorted(out[f"{key}_all"])[CKPT_SAMPLES // 2]
    failed = result["failed"]
    assert failed["ckpt_error"] == "OSError: [Errno 28] No space left on device"
    assert not {"ckpt_save_ms", "ckpt_load_ms", "ckpt_async_stall_ms"} & set(failed)
    skipped = result["small_disk"]["ckpt_error"]
    assert skipped.startswith("skipped: ") and "point TMPDIR at a larger disk" in skipped


def test_checkpoint_columns_carry_median_and_range() -> None:
    from strategy_bench.report._report import _checkpoint_text

    row = {
        "ckpt_save_ms": 101.0,
        "ckpt_save_ms_all": [95.0, 101.0, 130.0],
        "raw_ckpt_save_ms": 133.0,
        "raw_ckpt_save_ms_all": [120.0, 133.0, 140.0],
        "ckpt_load_ms": 99.0,
        "ckpt_load_ms_all": [97.0, 99.0, 103.0],
        "ckpt_async_stall_ms": 22.0,
        "ckpt_async_stall_ms_all": [21.0, 22.0, 25.0],
    }
    assert (
        _checkpoint_text(row)
        == "101 (95-130) / 133 (120-140) / 99 (97-103) / 22 (21-25), 3 samples"
    )
    once = {k: v for k, v in row.items() if not k.endswith("_all")}
    assert _checkpoint_text(once) == "101 / 133 / 99 / 22, 1 sample"  # an older results file
    assert _checkpoint_text({}) == "-"


def test_the_probe_times_a_cuda_collective_without_a_host_sync_inside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA path's invariant, on a CPU build: each timed call is preceded by a barrier and
    a device sync, and bracketed by CUDA events with no host sync between them (a sync around
    an NCCL collective adds about its latency again); one sync at the end reads the events."""
    import torch
    import torch.distributed as dist

    from strategy_bench.measure._timing import aligned_seconds

    log: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at = 0.0

        def record(self, stream: object = None) -> None:
            assert stream == "stream of cuda"  # the rank's device's current stream
            log.append("record")
            self.at = float(len(log))

        def elapsed_time(self, end: Event) -> float:
            return (end.at - self.at) * 1e3  # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(dist, "barrier", lambda group=None: log.append("barrier"))
    seconds = aligned_seconds(lambda: log.append("call"), repeats=2, device=torch.device("cuda"))
    one = ["barrier", "sync", "record", "call", "record"]
    assert log == [*one, *one, "sync"]
    assert seconds == [2.0, 2.0]  # two log entries from start to end, in seconds
    log.clear()
    seconds = aligned_seconds(
        lambda: log.append("call"), repeats=2, device=torch.device("cuda"), calls=4
    )
    batch = ["barrier", "sync", "record", "call", "call", "call", "call", "record"]
    assert log == [*batch, *batch, "sync"]  # k calls between two events, no sync inside
    assert seconds == [5.0 / 4, 5.0 / 4]  # the sample divided by k


def test_the_probe_batches_the_small_messages() -> None:
    """Latency-bound sizes are timed 20 calls a sample (one call on an idle stream measured
    its launch and the ranks' skew); 64 MiB one call, so a sample stays bounded."""
    from strategy_bench.measure._probe import calls_per_sample

    assert [calls_per_sample(2**20 * m) for m in (0.0625, 1, 16, 64, 256)] == [20, 20, 4, 1, 1]


def test_an_unknown_accumulation_sync_is_refused_by_name() -> None:
    from strategy_bench._errors import BenchUsageError
    from strategy_bench.workload import syncs_every_micro_step

    assert syncs_every_micro_step({}) is False
    assert syncs_every_micro_step({"grad_accum_sync": "every"}) is True
    with pytest.raises(BenchUsageError, match="grad_accum_sync must be one of last, every, got"):
        syncs_every_micro_step({"grad_accum_sync": "sometimes"})
