"""A run's checkpoints under one root: every N steps, keep K, resume, stop on a signal."""

from __future__ import annotations

__all__: list[str] = []
