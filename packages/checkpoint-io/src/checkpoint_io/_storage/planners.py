"""DCP's load planners, every value that is not a tensor decoded from tagged JSON."""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from checkpoint_io._compat import EmptyStateDictLoadPlanner, set_element
from checkpoint_io._errors import CheckpointError, shown
from safe_store import loads


class _JsonBytes:
    """A load planner's ``load_bytes`` decoding safe-store's JSON (no code, no tensors)."""

    flatten_state_dict: bool
    original_state_dict: Any
    mappings: Any
    state_dict: Any

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Decode one value; refuse what is not the codec's JSON."""
        fqn = read_item.dest_index.fqn
        try:
            loaded = loads(value.getvalue(), what=f"the checkpoint's value {shown(fqn)}")
        except ValueError as error:
            raise CheckpointError(f"{error}; the index is corrupt or crafted") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class SafeLoadPlanner(_JsonBytes, DefaultLoadPlanner):
    """DCP's load planner, every value decoded from JSON."""


class SafeWholePlanner(_JsonBytes, EmptyStateDictLoadPlanner):
    """DCP's planner that rebuilds the whole state from the index, values from JSON."""


class Whole:
    """A value DCP keeps as one entry (it would walk into a list of dicts, key by key).

    Args:
        value: The value (the optimizer's parameter groups).
    """

    def __init__(self, value: Any) -> None:
        self.value = value
