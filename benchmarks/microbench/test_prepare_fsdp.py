"""FSDP's prepare_model from rank 0 on 2 gloo ranks: streamed into the shards (ours) against
the path before it (a full replica broadcast to every rank, verified, then sharded)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from microbench_spawn import run_two_ranks

from distributed_strategy import (
    assert_replicas_identical,
    build_replicated_model,
    prepare_model,
    wrap_module_fsdp,
)
from strategy_bench import PRESETS, BenchTransformer

GROUP = "prepare_model: FSDP from rank0, streamed vs full replica first (2 ranks)"
PARAMS = PRESETS["small"].init_params()
ROUNDS = 8


def _raw() -> None:
    model = build_replicated_model(
        BenchTransformer,
        PARAMS,
        device="cpu",
        default_dtype=torch.float32,
        seed=3,
        source="rank0",
    )
    assert_replicas_identical(model)
    wrap_module_fsdp(model, device="cpu")


def _ours() -> None:
    prepare_model(
        BenchTransformer,
        PARAMS,
        config={"strategy": "fsdp", "source": "rank0"},
        device="cpu",
        default_dtype=torch.float32,
        seed=3,
    )


def _rank(rank: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"raw": [], "ours": []}
    sides = {"raw": _raw, "ours": _ours}
    _raw(), _ours()  # warm-up
    for index in range(ROUNDS):
        for side in ("raw", "ours") if index % 2 == 0 else ("ours", "raw"):
            dist.barrier()
            begin = time.perf_counter()
            sides[side]()
            dist.barrier()  # the slowest rank's time
            times[side].append(time.perf_counter() - begin)
    return times


def test_prepare_fsdp_from_rank0(record_interleaved: Any) -> None:
    times = run_two_ranks(__file__, "_rank", timeout_s=300)
    record_interleaved(GROUP, times)
