"""Which samples each rank reads at each step: the same global batches at any world size."""

from __future__ import annotations

from sample_order._order import SampleOrder

__all__ = ["SampleOrder"]
