"""Save and resume across DDP, FSDP2, world sizes and one process (on DCP), for long runs."""

from __future__ import annotations

from checkpoint_io._background.async_save import async_save_checkpoint
from checkpoint_io._background.inflight import PendingCheckpoint
from checkpoint_io._errors import CheckpointError
from checkpoint_io._importer import import_checkpoint
from checkpoint_io._load import load_checkpoint
from checkpoint_io._manager.manager import CheckpointManager
from checkpoint_io._manager.steps import latest_checkpoint
from checkpoint_io._model import full_state_dict
from checkpoint_io._save import save_checkpoint
from checkpoint_io._storage.manifest import CheckpointInfo
from checkpoint_io._whole import consolidate_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "PendingCheckpoint",
    "async_save_checkpoint",
    "consolidate_checkpoint",
    "full_state_dict",
    "import_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
