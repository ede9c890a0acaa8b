"""Every rank reaches the same verdict: no rank raises alone, none waits forever."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from checkpoint_io._compat import default_group_timeout
from checkpoint_io._errors import CheckpointError
from dist_core import agree as _agree
from dist_core import is_distributed, rank

_T = TypeVar("_T")


def agree(
    error: BaseException | None,
    what: str,
    group: dist.ProcessGroup | None = None,
    *,
    share: Any = None,
) -> list[Any]:
    """dist-core's ``agree`` with checkpoint-io's error types; every rank's ``share``.

    The failing rank re-raises its own error; the others raise the same type
    (``FileNotFoundError``, ``FileExistsError`` or :class:`CheckpointError`) naming that rank.
    """
    return _agree(error, what, group, share=share, kinds=_KINDS, default=CheckpointError)


_KINDS = {"FileNotFoundError": FileNotFoundError, "FileExistsError": FileExistsError}


def from_rank0(value: _T, group: dist.ProcessGroup | None = None) -> _T:
    """Rank 0's ``value`` on every rank (itself without a process group)."""
    if not is_distributed():
        return value
    box = [value if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]  # type: ignore[return-value]


def gloo_group(purpose: str) -> dist.ProcessGroup | None:
    """A gloo group over every rank, one per ``purpose`` and default group (collective).

    Background saves run their collectives on ``gloo_group("background")``, never interleaved
    with the training loop's on the default group; the SIGTERM agreement uses its own. Made
    the first time (every rank must call it then), with the default group's timeout. ``None``
    without a process group.
    """
    if not is_distributed():
        return None
    default = dist.group.WORLD
    made = _GROUPS.get(purpose)
    if made is None or made[0] is not default:
        timeout = default_group_timeout()
        made = (default, dist.new_group(backend="gloo", timeout=timeout))
        _GROUPS[purpose] = made
    group: dist.ProcessGroup | None = made[1]
    return group


_GROUPS: dict[str, tuple[Any, Any]] = {}  # purpose -> (the default group, the gloo group)


_SINGLE_PROCESS_NOTICE = ".*assuming the intent is to"


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Without a process group, DCP warns that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        if not is_distributed():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTICE, category=UserWarning)
        yield


def quiet_single_process_notice_in_background() -> None:
    """Ignore DCP's one-process notice for the process (its thread is out of a block's reach)."""
    if not is_distributed():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTICE, category=UserWarning)
