"""DCP's load planners, every non-tensor value read through :mod:`._format.values`."""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from checkpoint_io._compat import EmptyStateDictLoadPlanner, set_element
from checkpoint_io._errors import CheckpointError
from checkpoint_io._format.values import load_value


class _SafeBytes:
    """A load planner's ``load_bytes`` reading every non-tensor value ``weights_only``."""

    flatten_state_dict: bool
    original_state_dict: Any
    mappings: Any
    state_dict: Any

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Read one non-tensor value; refuse anything but tensors, containers and primitives."""
        loaded = load_value(value, f"the checkpoint's value {read_item.dest_index.fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's load planner, every non-tensor value read ``weights_only``."""


class SafeWholePlanner(_SafeBytes, EmptyStateDictLoadPlanner):
    """DCP's planner that rebuilds the whole state from the index, values ``weights_only``."""


def unsafe_cause(error: BaseException) -> CheckpointError | None:
    """The refusal inside a DCP failure (DCP wraps what a rank raised), or ``None``."""
    if isinstance(error, CheckpointError):
        return error
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            found = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(found, CheckpointError):
                return found
    cause = error.__cause__ or error.__context__
    return unsafe_cause(cause) if cause is not None else None
