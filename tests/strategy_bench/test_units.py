"""strategy-bench's pieces that need no ranks: alternation, the memory budget, the timers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest

from dist_harness import run_ranks
from strategy_bench._measure import COLD_SAMPLES, _alternating
from strategy_bench._sweep import budgeted, recommend


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
        from strategy_bench._launch import _exit_after
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


def test_counted_flops_agree_with_the_preset_formula() -> None:
    import torch

    from strategy_bench import PRESETS, BenchTransformer
    from strategy_bench._flops import count_step_flops
    from strategy_bench._presets import next_token_loss, synthetic_tokens

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
    from strategy_bench._flops import datasheet_peak, peak_flops

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
    from strategy_bench._presets import next_token_loss

    model.zero_grad(set_to_none=True)
    next_token_loss(model, tokens).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_block_knobs_change_how_the_step_runs_not_what_it_computes() -> None:
    """Activation checkpointing and per-block compile (eager backend: no C++ compiler
    needed) on the shard units; the gradients stay those of the plain model."""
    import copy

    import torch

    from strategy_bench._accounting import saved_activation_bytes
    from strategy_bench._knobs import prepare_blocks

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


def test_block_knobs_need_blocks() -> None:
    from torch import nn

    from strategy_bench._errors import BenchUsageError
    from strategy_bench._knobs import micro_steps, prepare_blocks

    with pytest.raises(BenchUsageError, match="Linear has no repeated blocks"):
        prepare_blocks(nn.Linear(2, 2), {"activation_checkpointing": True})
    with pytest.raises(BenchUsageError, match="grad_accum must be an integer >= 1, got 0"):
        micro_steps({"grad_accum": 0})


def test_agreement_flags_each_kind_beyond_its_tolerance() -> None:
    from strategy_bench._estimate import agreement

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
