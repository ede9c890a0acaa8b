"""The read path: every file opened once and checked from the bytes decoded; the load."""

from __future__ import annotations

__all__: list[str] = []
