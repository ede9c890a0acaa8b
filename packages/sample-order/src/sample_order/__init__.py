"""Which samples each rank reads at each step: the same global batches at any world size.

And the record of a run: which samples each committed step trained on, and which were lost.
"""

from __future__ import annotations

from sample_order._order import SampleOrder
from sample_order._record import SampleHistory, SampleLog, read_sample_log

__all__ = ["SampleHistory", "SampleLog", "SampleOrder", "read_sample_log"]
