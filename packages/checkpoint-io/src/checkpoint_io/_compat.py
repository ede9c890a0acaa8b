"""Private torch names that checkpoint-io relies on, kept in one place."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

__all__ = ["CheckpointException", "load_whole"]


def load_whole(path: Path) -> dict[str, Any]:
    """Every entry of a DCP checkpoint as plain tensors and objects, in this one process."""
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        return _load_state_dict_from_keys(checkpoint_id=str(path))
