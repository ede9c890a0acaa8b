"""The one exception type of checkpoint-io, and the file openers that raise it."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import dist_core


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read as asked; the message says why and what to do.

    Raised on every rank. DCP's own ``CheckpointException`` derives from ``BaseException``
    (``except Exception`` would not catch it); checkpoint-io turns it into this.
    """


def open_regular(file: Path) -> BinaryIO:
    """Open a checkpoint's file: a regular file, not through a link, never blocking.

    Raises:
        CheckpointError: If it is a symbolic link, a FIFO, a device, a socket or a directory.
        OSError: If it cannot be opened (missing, no permission).
    """
    return dist_core.open_regular(file, error=CheckpointError, holder="a checkpoint")


def read_regular(file: Path) -> bytes:
    """The whole content of a checkpoint's file, opened by :func:`open_regular`."""
    return dist_core.read_regular(file, error=CheckpointError, holder="a checkpoint")


_WEIGHTS_ONLY = "WeightsUnpickler error:"
"""Where torch's ``weights_only`` refusal gives its reason (after advice to bypass it)."""


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (at most 200 characters), for a one-line error.

    For torch's ``weights_only`` refusal, the first line of its reason ("Unsupported global:
    GLOBAL mod.Holder was not an allowed global by default"), without torch's advice to
    allow the global or to load without ``weights_only``.
    """
    message = str(error)
    if _WEIGHTS_ONLY in message:
        message = message.split(_WEIGHTS_ONLY, 1)[1].split(". Please use", 1)[0]
    text = message.strip().splitlines()
    return text[0][:200] if text else type(error).__name__
