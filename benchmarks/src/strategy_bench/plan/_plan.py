"""The points of a run, as plain picklable values (they travel to spawned ranks)."""

from __future__ import annotations

import dataclasses
from typing import Any

from strategy_bench.measure import RunOptions
from strategy_bench.workload import WorkloadSpec


@dataclasses.dataclass(frozen=True)
class Config:
    """One measured point: a workload (index into the plan's), a strategy and its knobs."""

    workload: int
    strategy: str
    knobs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def describe(self, workloads: list[WorkloadSpec]) -> dict[str, Any]:
        """A JSON-friendly description (for the skipped list)."""
        spec = workloads[self.workload]
        name = spec.preset or (spec.model_factory or "").rsplit(":", 1)[-1]
        return {"model": name, "strategy": self.strategy, "knobs": dict(self.knobs)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A whole run.

    Attributes:
        device: ``"cpu"`` or ``"cuda"``.
        world_size: Ranks when spawning (ignored under torchrun, which says).
        workloads: The models.
        configs: The points, measured in this order.
        options: How each point is measured.
        out_dir: Where rank 0 writes ``results.json``.
        time_budget_s: Skip the remaining points once this would be exceeded (``None``: never).
        max_points: Measure at most this many points; the rest are skipped (``None``: all).
        pg_timeout_s: Collective timeout: a lost rank fails the others after this at worst.
        kind: ``"run"`` or ``"sweep"`` (recorded in the results).
        first_index: Position of ``configs[0]`` in the whole run (for progress lines).
        total: Points in the whole run (``None``: ``len(configs)``).
        prior_rows: Rows of an earlier run kept by ``--resume``; written before the new ones.
        peak_tflops: ``--peak-tflops``: the MFU denominator per rank (else the datasheet's).
        matmul_flops: The matmul rate measured by the run's first point, handed to the others.
        comm_probe: The links the run's first point fitted (``env.comm_probe``), handed on.
        threads_per_rank: Each rank's intra-op threads (``None``: the host's cores shared by
            its ranks).
    """

    device: str
    world_size: int
    workloads: list[WorkloadSpec]
    configs: list[Config]
    options: RunOptions
    out_dir: str
    time_budget_s: float | None = None
    max_points: int | None = None
    pg_timeout_s: float = 300.0
    kind: str = "run"
    first_index: int = 0
    total: int | None = None
    prior_rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    peak_tflops: float | None = None
    matmul_flops: float | None = None
    comm_probe: dict[str, Any] | None = None
    threads_per_rank: int | None = None

    def budget_text(self) -> str:
        """The budget, for progress lines of skipped points."""
        parts = [] if self.time_budget_s is None else [f"time budget {self.time_budget_s:.0f} s"]
        if self.max_points is not None:
            parts.append(f"--max-points {self.max_points}")
        return ", ".join(parts) or "no budget"

    @property
    def backend(self) -> str:
        """NCCL on CUDA, gloo on CPU."""
        return "nccl" if self.device == "cuda" else "gloo"
