"""``CheckpointManager``: every N steps, keep K, async, stop on a signal, resume the latest."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpoint_io._background.async_save import start_async_save
from checkpoint_io._background.inflight import PendingCheckpoint
from checkpoint_io._manager.steps import (
    check_root,
    latest_checkpoint,
    prune,
    resume_latest,
    step_path,
)
from checkpoint_io._manager.stop import Requeue, StopSignals
from checkpoint_io._save import save_checkpoint
from dist_core import make_dirs, rank

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Checkpoints of a long run under one root: ``root/step-<N>``.

    Every method that saves or loads is collective (every rank, in the same order), and so is
    the constructor with signals; without a process group it all runs in one process.

    Args:
        root: The directory of the ``step-<N>`` checkpoints (created when first saved).
        every: Save when the step passed to ``maybe_save`` is a multiple of it.
        keep_last: Keep only the newest ``keep_last`` complete checkpoints; older ones are
            removed once a new one is published. The one just published, and any at a
            higher step (a roll-back's abandoned run), are never removed. ``None`` keeps all.
        async_save: Write in the background (:func:`async_save_checkpoint`): training goes on
            once the state is staged in host memory.
        on_sigterm: Stop on SIGTERM (torchrun's and schedulers' warning before SIGKILL): at
            the next ``maybe_save`` every rank saves, then ``SystemExit(0)`` once published.
        signals: Other signals to stop on so (``"USR1"`` for ``sbatch --signal=USR1@120``,
            or ``signal.SIGUSR1``); ``None``: SIGTERM with ``on_sigterm``, else none.
        requeue: After such a save, rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` (``True``:
            the job resumes from it), or this callable (another scheduler); ``False``: nothing.

    Raises:
        TypeError: ``root`` is not a path, or a flag is not a bool.
        ValueError: ``every`` or ``keep_last`` below 1; a signal that cannot be caught;
            ``requeue=True`` outside a SLURM job; signals outside the main thread.
        NotADirectoryError: ``root`` is a file.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        every: int,
        keep_last: int | None = None,
        async_save: bool = False,
        on_sigterm: bool = False,
        signals: Iterable[int | str | signal.Signals] | None = None,
        requeue: Requeue = False,
    ) -> None:
        self.root = check_root(root)
        self.every = _positive("every", every)
        self.keep_last = None if keep_last is None else _positive("keep_last", keep_last)
        self.async_save = _flag("async_save", async_save)
        self._pending: PendingCheckpoint | None = None
        sigterm = (signal.SIGTERM,) if _flag("on_sigterm", on_sigterm) else ()
        self._stop = StopSignals(sigterm if signals is None else signals, requeue)

    def maybe_save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        stateful: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> Path | None:
        """Save ``root/step-<step>`` if ``step`` is a multiple of ``every``, forced, or stopping.

        Collective. Pass the number of steps completed: :meth:`resume` returns it.

        Returns:
            The checkpoint's path (async: where it will be published); ``None``: not saved.

        Raises:
            SystemExit: Code 0, once published (and requeued), when any rank got a stop signal.
            ValueError: If ``step`` is negative.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0 (steps completed), got {step!r}")
        stopping = self._stop.agreed()
        if not (force or stopping or step % self.every == 0):
            return None
        path = step_path(self.root, step)
        state = (model, optimizer, stateful, extra)
        background = self.async_save and not stopping
        keep = self.keep_last
        after = (lambda: None) if keep is None else (lambda: prune(self.root, keep, step))
        self._pending = _save(path, step, state, background, after=after)
        if stopping:
            self.close()
            self._stop.exit_after_save(path)
        return path

    def latest(self) -> Path | None:
        """The complete checkpoint of the highest step (no collective): ``latest_checkpoint``."""
        return latest_checkpoint(self.root)

    def resume(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        stateful: Mapping[str, Any] | None = None,
    ) -> int:
        """Load the latest complete checkpoint that loads; return its step (0: none yet).

        Collective; any strategy and world size. When the newest fails to load (a flipped
        bit, a malformed manifest), every rank warns with its name and the reason, and the
        next older one is tried.
        """
        return resume_latest(self.root, model, optimizer, stateful)

    def wait(self) -> Path | None:
        """Wait for a background save; its path (``None`` if none was in flight)."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.wait()

    def close(self) -> None:
        """Wait for a background save and put the previous signal handlers back."""
        try:
            self.wait()
        finally:
            self._stop.restore()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _save(
    path: Path,
    step: int,
    state: tuple[nn.Module, torch.optim.Optimizer | None, Any, Any],
    background: bool,
    *,
    after: Callable[[], object],
) -> PendingCheckpoint | None:
    """Save ``state`` (model, optimizer, stateful, extra) at ``path``; ``after`` on publish."""
    model, optimizer, stateful, extra = state
    if rank() == 0:
        make_dirs(path.parent)  # durable too: the root may be new
    if background:
        return start_async_save(
            path,
            model,
            optimizer,
            step,
            extra,
            stateful,
            rng=True,
            overwrite=True,
            after_publish=after,
        )
    save_checkpoint(
        path, model, optimizer, stateful=stateful, extra=extra, step=step, overwrite=True
    )
    if rank() == 0:
        after()
    return None


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value
