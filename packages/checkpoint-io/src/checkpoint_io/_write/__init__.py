"""The write path: collect, write (DCP), hash, fsync, publish; async staging."""

from __future__ import annotations

__all__: list[str] = []
