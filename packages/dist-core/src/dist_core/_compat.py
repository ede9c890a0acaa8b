"""What differs between the torch versions dist-core supports (2.6 and later)."""

from __future__ import annotations

from typing import Any


def fsdp_param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list from torch 2.8, one group (or none) before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]
