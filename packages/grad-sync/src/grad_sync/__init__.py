"""Gradient accumulation, clipping and token-count losses, right under every strategy."""

from __future__ import annotations

from grad_sync._clip import clip_grad_norm
from grad_sync._count import count_mean, data_parallel_size, global_count
from grad_sync._no_sync import no_sync

__all__ = ["clip_grad_norm", "count_mean", "data_parallel_size", "global_count", "no_sync"]
