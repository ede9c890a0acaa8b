"""The one exception type of checkpoint-io."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read as asked; the message says why and what to do.

    Raised on every rank. DCP's own ``CheckpointException`` derives from ``BaseException``
    (``except Exception`` would not catch it); checkpoint-io turns it into this.
    """
