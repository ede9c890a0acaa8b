"""Shared set-up of the microbenchmarks: a one-rank gloo group, and the ours/raw ratios.

Every case is a pair of benchmarks in one group, ``raw`` (plain torch) and ``ours``, each
measured by pytest-benchmark (the absolute times in its table and JSON). pytest-benchmark
measures one side after the other, so slow drift of a shared machine (frequency, memory,
neighbours) lands on one side; the ratio that is judged against the target therefore comes
from a second, interleaved measurement: rounds alternate raw and ours (in alternating order),
and the ratio is that of the two medians. Both ratios are printed and saved to
``bench-results/microbench-ratios.json``, with the spread of the interleaved rounds' own
ratios (their quartiles). Before each timed call the garbage collector runs, outside the
timing (as ``timeit`` keeps it out): a full collection costs about 100 ms in a process that
imported torch, and lands on whichever side happens to allocate when it is due.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

# group -> {"raw": median s, "ours": median s}; filled by the ``paired`` fixture.
_MEDIANS: dict[str, dict[str, float]] = {}
# group -> side -> (fn, setup, rounds, iterations): what the interleaved measurement runs.
_CASES: dict[str, dict[str, tuple[Any, Any, int, int]]] = {}
# group -> {"raw": median s, "ours": median s} of the interleaved measurement.
_INTERLEAVED: dict[str, dict[str, float]] = {}
# group -> (first quartile, third quartile) of the interleaved rounds' ratios.
_SPREAD: dict[str, tuple[float, float]] = {}
_EXTRA: dict[str, dict[str, Any]] = {}
TARGETS = {
    "ddp-wrap: attribute read": 1.25,
    "ddp-wrap: delegated method call": 2.0,
    "ddp-wrap: empty delegated method call": 2.0,
    "ddp-wrap: training step": 1.03,
    "ddp-wrap: wrap vs DDP construction": 1.10,
    "replica-init: build vs bare recipe": 1.05,
    "replica-init: rank0 coalesced vs per-tensor broadcast": 0.5,
    "prepare_model: FSDP from rank0, streamed vs full replica first (2 ranks)": 1.2,
    "grad-sync: DDP micro-step in no_sync": 1.02,
    "grad-sync: FSDP micro-step in no_sync": 1.02,
    "grad-sync: clip_grad_norm": 1.10,
    "checkpoint-io: save vs get_state_dict + dcp.save": 1.10,
    "checkpoint-io: load vs dcp.load + set_state_dict": 1.10,
    "checkpoint-io: load, verified, vs raw": 1.25,
    "checkpoint-io, 2 ranks, DDP: save vs get_state_dict + dcp.save": 1.10,
    "checkpoint-io, 2 ranks, FSDP: save vs get_state_dict + dcp.save": 1.10,
    "checkpoint-io, 2 ranks, DDP: load, verified, vs dcp.load + set_state_dict": 1.25,
    "checkpoint-io, 2 ranks, FSDP: load, verified, vs dcp.load + set_state_dict": 1.25,
    "checkpoint-io, 2 ranks, DDP: async save stall vs a synchronous save": 0.25,
    "checkpoint-io, 2 ranks, FSDP: async save stall vs a synchronous save": 0.25,
    "fsdp-wrap: an optimizer's first step (stale-optimizer check) vs raw": 1.10,
    "fsdp-wrap: an optimizer's later steps vs raw": 1.02,
}
RESULTS = Path(__file__).resolve().parents[2] / "bench-results" / "microbench-ratios.json"


@pytest.fixture(scope="session")
def process_group() -> None:
    """A one-rank gloo group for the session."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class Paired:
    """Runs one side of a case and records its median under the case's group."""

    def __init__(self, benchmark: Any, group: str, side: str) -> None:
        self.benchmark = benchmark
        self.group = group
        self.side = side
        benchmark.group = group
        benchmark.name = f"{group} [{side}]"

    def __call__(self, fn: Any, *, rounds: int = 50, iterations: int = 1, setup: Any = None) -> Any:
        if setup is None:
            result = self.benchmark.pedantic(
                fn, rounds=rounds, iterations=iterations, warmup_rounds=2
            )
        else:
            result = self.benchmark.pedantic(fn, setup=setup, rounds=rounds, warmup_rounds=2)
        _MEDIANS.setdefault(self.group, {})[self.side] = self.benchmark.stats.stats.median
        sides = _CASES.setdefault(self.group, {})
        sides[self.side] = (fn, setup, rounds, iterations)
        if len(sides) == 2:
            _record_interleaved(self.group, _interleave(sides), keep_sequential=True)
        return result

    def rename(self, group: str) -> None:
        """Record this case under another group (for a parametrized case)."""
        self.group = group
        self.benchmark.group = group
        self.benchmark.name = f"{group} [{self.side}]"

    def note(self, **values: Any) -> None:
        """Extra figures for the summary (e.g. throughput)."""
        _EXTRA.setdefault(self.group, {}).update({f"{self.side}_{k}": v for k, v in values.items()})


def _record_interleaved(
    group: str, times: dict[str, list[float]], *, keep_sequential: bool = False
) -> None:
    medians = {side: statistics.median(values) for side, values in times.items()}
    if not keep_sequential:
        _MEDIANS[group] = dict(medians)
    _INTERLEAVED[group] = dict(medians)
    ratios = [ours / raw for raw, ours in zip(times["raw"], times["ours"], strict=True)]
    if len(ratios) >= 2:
        quartiles = statistics.quantiles(ratios, n=4)
        _SPREAD[group] = (quartiles[0], quartiles[2])


@pytest.fixture
def record_interleaved() -> Any:
    """``record(group, {"raw": [s, ...], "ours": [s, ...]})``: a case measured elsewhere (on
    spawned ranks), in alternating rounds, reported with the others."""
    return _record_interleaved


def _interleave(sides: dict[str, tuple[Any, Any, int, int]]) -> dict[str, list[float]]:
    """Time per call of each side, by round, measured in alternating rounds."""
    times: dict[str, list[float]] = {"raw": [], "ours": []}
    rounds = max(case[2] for case in sides.values())
    for index in range(rounds):
        order = ("raw", "ours") if index % 2 == 0 else ("ours", "raw")
        for side in order:
            fn, setup, _, iterations = sides[side]
            args, kwargs = setup() if setup is not None else ((), {})
            gc.collect()  # outside the timing
            begin = time.perf_counter()
            for _ in range(iterations):
                fn(*args, **kwargs)
            times[side].append((time.perf_counter() - begin) / iterations)
    return times


@pytest.fixture(params=["raw", "ours"])
def paired(request: pytest.FixtureRequest, benchmark: Any) -> Paired:
    """The side (``raw`` first, then ``ours``) of the case named by the test's ``GROUP``."""
    return Paired(benchmark, request.module.GROUPS[request.node.originalname], request.param)


def _spread(group: str) -> str:
    quartiles = _SPREAD.get(group)
    return "" if quartiles is None else f" rounds {quartiles[0]:.2f}-{quartiles[1]:.2f}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _MEDIANS:
        return
    rows = []
    terminalreporter.section(
        "ours / raw torch: ratio of medians, interleaved rounds (lower is better)"
    )
    for group, sides in _MEDIANS.items():
        if "raw" not in sides or "ours" not in sides:
            continue
        sequential = sides["ours"] / sides["raw"]
        mixed = _INTERLEAVED.get(group)
        shown = mixed or sides  # the interleaved medians, which the ratio is taken from
        ratio = shown["ours"] / shown["raw"]
        target = TARGETS.get(group)
        verdict = "" if target is None else (" ok" if ratio <= target else " OVER TARGET")
        line = (
            f"{group:<40} raw {shown['raw'] * 1e6:11.2f} us  ours {shown['ours'] * 1e6:11.2f} us"
            f"  ratio {ratio:5.2f}"
            + ("" if target is None else f" (target <= {target})")
            + verdict
            + _spread(group)
            + f" [one side after the other: {sequential:4.2f}]"
        )
        extra = _EXTRA.get(group, {})
        if extra:
            line += "  " + ", ".join(f"{k}={v:.2f}" for k, v in extra.items())
        terminalreporter.write_line(line)
        rows.append(
            {
                "group": group,
                "raw_s": sides["raw"],
                "ours_s": sides["ours"],
                "ratio": ratio,
                "sequential_ratio": sequential,
                "interleaved_s": mixed,
                "round_ratio_quartiles": _SPREAD.get(group),
                "target": target,
                **extra,
            }
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps({"threads": os.environ.get("OMP_NUM_THREADS"), "cases": rows}, indent=2) + "\n"
    )
    terminalreporter.write_line(f"saved {RESULTS}")
