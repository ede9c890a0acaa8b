"""Private torch names that checkpoint-io relies on, kept in one place."""

from __future__ import annotations

import datetime
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

__all__ = ["CheckpointException", "dcp_failure", "default_group_timeout", "load_whole"]


def load_whole(path: Path) -> dict[str, Any]:
    """Every entry of a DCP checkpoint as plain tensors and objects, in this one process."""
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        return _load_state_dict_from_keys(checkpoint_id=str(path))


def dcp_failure(what: str, error: CheckpointException) -> str:
    """One line for DCP's failure: the ranks, and the first rank's error (no traceback)."""
    failures = error.failures
    if not failures:
        return f"{what} failed: {str(error).strip().splitlines()[-1]}"
    first = min(failures)
    exc = failures[first][0]
    return f"{what} failed on rank(s) {sorted(failures)}; rank {first}: {type(exc).__name__}: {exc}"


def default_group_timeout() -> datetime.timedelta | None:
    """The collective timeout the default group was initialized with (``None``: unknown).

    ``new_group`` does not inherit it (it takes the backend's default, 30 minutes for gloo);
    a group made for checkpoint-io takes this one, so that a rank whose peer died fails as
    soon as the training loop's collectives would. Read through a private attribute.
    """
    world = dist.group.WORLD
    try:
        backend = world._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        timeout = backend.options._timeout
    except (AttributeError, RuntimeError):
        try:
            backend = world._get_backend(torch.device("cuda"))  # type: ignore[union-attr]
            timeout = backend.options._timeout
        except (AttributeError, RuntimeError):
            return None
    return timeout if isinstance(timeout, datetime.timedelta) else None
