"""Private torch names that checkpoint-io relies on, kept in one place."""

from __future__ import annotations

import datetime
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save

__all__ = [
    "CheckpointException",
    "CheckpointWrapper",
    "EmptyStateDictLoadPlanner",
    "async_save_staged",
    "dcp_failure",
    "default_group_timeout",
    "load_in_process",
    "rank_failures",
    "set_element",
]


def load_in_process(state: dict[str, Any], reader: Any, planner: Any) -> None:
    """DCP's load into ``state`` in this process, with no process group.

    With an empty ``state`` and a planner that rebuilds it from the index, the whole
    checkpoint; the public ``dcp.load`` copies back only the keys ``state`` had.
    """
    _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)


def rank_failures(error: BaseException) -> dict[int, BaseException]:
    """What each rank raised, inside DCP's ``CheckpointException`` (else ``{}``).

    DCP keeps each as ``(error, traceback)``; the traceback is left behind.
    """
    failures = getattr(error, "failures", None) or {}
    return {r: f[0] if isinstance(f, tuple) else f for r, f in sorted(failures.items())}


def dcp_failure(what: str, error: CheckpointException) -> str:
    """One line for DCP's failure: the ranks, and the first rank's error (no traceback)."""
    failures = rank_failures(error)
    if not failures:
        return f"{what} failed: {str(error).strip().splitlines()[-1]}"
    first = min(failures)
    exc = failures[first]
    return f"{what} failed on rank(s) {sorted(failures)}; rank {first}: {type(exc).__name__}: {exc}"


def default_group_timeout() -> datetime.timedelta | None:
    """The default group's collective timeout (``None``: unknown): ``new_group`` drops it."""
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


def async_save_staged(
    state: dict[str, Any], writer: Any, planner: Any, group: Any, *, no_dist: bool
) -> Any:
    """``dcp.async_save`` of a state already staged in host memory: DCP copies nothing.

    torch 2.6's takes no stager and no ``no_dist`` (checked by the signature, not the version).
    """
    if not _TAKES_STAGER:  # torch 2.6
        return dcp_async_save(state, storage_writer=writer, planner=planner, process_group=group)
    return dcp_async_save(
        state,
        storage_writer=writer,
        planner=planner,
        process_group=group,
        async_stager=_AlreadyStaged(),
        no_dist=no_dist,
    )


_TAKES_STAGER = "async_stager" in inspect.signature(dcp_async_save).parameters


class _AlreadyStaged:
    """DCP's stager protocol for a state that was staged already."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        """Nothing to synchronize: staging was done in the foreground."""
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The state as it is."""
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing to wait for."""

    def close(self) -> None:
        """Nothing to release."""
