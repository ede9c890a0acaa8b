"""What a checkpoint is on disk: its manifest, DCP's index and its checks, digests, values."""

from __future__ import annotations

__all__: list[str] = []
