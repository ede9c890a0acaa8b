"""Save and resume across DDP, FSDP2, world sizes and one process (on DCP)."""

from __future__ import annotations

from checkpoint_io._errors import CheckpointError
from checkpoint_io._full import consolidate_checkpoint, full_state_dict
from checkpoint_io._load import load_checkpoint
from checkpoint_io._manifest import CheckpointInfo
from checkpoint_io._save import save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "consolidate_checkpoint",
    "full_state_dict",
    "load_checkpoint",
    "save_checkpoint",
]
