"""The one save in flight: a new save first waits for it, and a failure nobody saw surfaces."""

from __future__ import annotations

import concurrent.futures
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


class PendingCheckpoint:
    """A checkpoint being written in the background by :func:`async_save_checkpoint`.

    The state was staged (copied) before the call returned: training may change the model and
    the optimizer at once. The checkpoint directory appears, complete, when the write is done.

    Attributes:
        path: The checkpoint directory it will be published at.
    """

    def __init__(self, path: Path, future: concurrent.futures.Future[Path]) -> None:
        self.path = path
        self._future = future
        self._seen = False

    def done(self) -> bool:
        """Whether the write has finished (published, or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the checkpoint is published; return its path.

        Args:
            timeout: Seconds to wait at most (``None``: as long as it takes).

        Raises:
            CheckpointError: If the write failed on any rank (raised on every rank; nothing
                was published and the previous checkpoint at ``path``, if any, is intact).
            TimeoutError: If ``timeout`` passed first.
        """
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"the background save of {str(self.path)!r} did not finish within {timeout} s"
            ) from None
        except BaseException:
            self._seen = True
            raise

    def __repr__(self) -> str:
        state = "done" if self.done() else "writing"
        return f"PendingCheckpoint({str(self.path)!r}, {state})"


_IN_FLIGHT: list[PendingCheckpoint] = []


def track(pending: PendingCheckpoint) -> None:
    """Record ``pending`` as the save in flight."""
    _IN_FLIGHT[:] = [pending]


def settle_in_flight() -> None:
    """Wait for the save in flight, if any; re-raise its failure unless ``wait()`` did already.

    Raises:
        CheckpointError: The previous background save failed and nobody waited for it.
    """
    if not _IN_FLIGHT:
        return
    pending = _IN_FLIGHT[-1]
    if not pending.done():
        logger.info("waiting for the background save of %s to finish", pending.path)
    seen = pending._seen
    try:
        pending.wait()
    except BaseException:
        if pending.done():  # finished, failed: settled (an interrupted wait stays in flight)
            _IN_FLIGHT.clear()
        if not seen or not pending.done():
            raise
    else:
        # Only now: popped before the wait, an interrupted wait (KeyboardInterrupt, a signal)
        # let the next save reuse the staging buffers the old write was still reading.
        _IN_FLIGHT.clear()
