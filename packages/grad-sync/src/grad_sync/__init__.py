"""Gradient accumulation and clipping that are right under DDP, FSDP2 and one process."""

from __future__ import annotations

from grad_sync._clip import clip_grad_norm
from grad_sync._no_sync import no_sync

__all__ = ["clip_grad_norm", "no_sync"]
