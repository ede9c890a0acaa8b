"""Every rank reaches the same verdict: no rank raises alone, none waits forever."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from checkpoint_io._errors import CheckpointError
from dist_core import is_distributed, rank

_T = TypeVar("_T")


def agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank if ``error`` happened on any rank (collective).

    The failing rank re-raises its own error; the others raise the same type
    (``FileNotFoundError``, ``FileExistsError`` or :class:`CheckpointError`) naming that rank.
    """
    if not is_distributed():
        if error is not None:
            raise error
        return
    report = None if error is None else (type(error).__name__, str(error))
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if error is not None:
        raise error
    failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
    if failed:
        first, (kind, message) = failed[0]
        others = {"FileNotFoundError": FileNotFoundError, "FileExistsError": FileExistsError}
        raise others.get(kind, CheckpointError)(
            f"{what} failed on rank(s) {[r for r, _ in failed]}; rank {first}: {message}"
        )


def from_rank0(value: _T) -> _T:
    """Rank 0's ``value`` on every rank (itself without a process group)."""
    if not is_distributed():
        return value
    box = [value if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Without a process group, DCP warns that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        if not is_distributed():
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to", category=UserWarning
            )
        yield
