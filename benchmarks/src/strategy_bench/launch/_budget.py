"""The time budget of a run or sweep: whether the next point still fits."""

from __future__ import annotations

import time


class TimeBudget:
    """Skip the remaining points once the next one would overrun the budget.

    A point's cost is estimated by the last measured point of the same workload (the model
    dominates the cost; the knobs hardly change it).

    Args:
        limit_s: Seconds for the whole run; ``None``: no time limit.
        max_points: Points to measure at most; ``None``: no limit.
    """

    def __init__(self, limit_s: float | None, max_points: int | None = None) -> None:
        self.limit_s = limit_s
        self.max_points = max_points
        self._started = time.monotonic()
        self._cost: dict[int, float] = {}
        self._measured = 0

    @property
    def unlimited(self) -> bool:
        """Whether nothing is ever skipped."""
        return self.limit_s is None and self.max_points is None

    def fits(self, workload: int) -> bool:
        """Whether a point of ``workload`` is expected to finish within the budget.

        The first point always runs (there is no cost to judge it by, and a run that measured
        nothing would say nothing), however little of the budget is left when it starts.
        """
        if self.max_points is not None and self._measured >= self.max_points:
            return False
        if self.limit_s is None or self._measured == 0:
            return True
        elapsed = time.monotonic() - self._started
        return elapsed + self._cost.get(workload, 0.0) <= self.limit_s

    def spent(self, workload: int, seconds: float) -> None:
        """Record what a point of ``workload`` cost."""
        self._cost[workload] = seconds
        self._measured += 1
