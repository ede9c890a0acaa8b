"""Shared set-up of the microbenchmarks: a one-rank gloo group, and the ours/raw ratios.

Every case is a pair of benchmarks in one group, ``raw`` (plain torch) and ``ours``. At the
end of the session the ratio of their medians is printed beside the target and saved to
``bench-results/microbench-ratios.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

# group -> {"raw": median s, "ours": median s}; filled by the ``paired`` fixture.
_MEDIANS: dict[str, dict[str, float]] = {}
_EXTRA: dict[str, dict[str, Any]] = {}
TARGETS = {
    "ddp-wrap: attribute read": 1.25,
    "ddp-wrap: delegated method call": 2.0,
    "ddp-wrap: training step": 1.03,
    "ddp-wrap: wrap vs DDP construction": 1.10,
    "replica-init: build vs bare recipe": 1.05,
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
        return result

    def note(self, **values: Any) -> None:
        """Extra figures for the summary (e.g. throughput)."""
        _EXTRA.setdefault(self.group, {}).update({f"{self.side}_{k}": v for k, v in values.items()})


@pytest.fixture(params=["raw", "ours"])
def paired(request: pytest.FixtureRequest, benchmark: Any) -> Paired:
    """The side (``raw`` first, then ``ours``) of the case named by the test's ``GROUP``."""
    return Paired(benchmark, request.module.GROUPS[request.node.originalname], request.param)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _MEDIANS:
        return
    rows = []
    terminalreporter.section("ours / raw torch (ratio of medians; lower is better)")
    for group, sides in _MEDIANS.items():
        if "raw" not in sides or "ours" not in sides:
            continue
        ratio = sides["ours"] / sides["raw"]
        target = TARGETS.get(group)
        verdict = "" if target is None else (" ok" if ratio <= target else " OVER TARGET")
        line = (
            f"{group:<40} raw {sides['raw'] * 1e6:11.2f} us  ours {sides['ours'] * 1e6:11.2f} us"
            f"  ratio {ratio:5.2f}" + ("" if target is None else f" (target <= {target})") + verdict
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
                "target": target,
                **extra,
            }
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps({"threads": os.environ.get("OMP_NUM_THREADS"), "cases": rows}, indent=2) + "\n"
    )
    terminalreporter.write_line(f"saved {RESULTS}")
