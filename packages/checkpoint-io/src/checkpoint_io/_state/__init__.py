"""The live objects' state: the model's and optimizer's, keyed by plain names; stateful objects."""

from __future__ import annotations

__all__: list[str] = []
