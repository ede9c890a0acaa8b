"""``CheckpointManager``: every N steps, keep K, async, stop on a signal, resume the latest."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpoint_io._async import start_async_save
from checkpoint_io._collective import from_rank0
from checkpoint_io._errors import CheckpointError
from checkpoint_io._inflight import PendingCheckpoint
from checkpoint_io._latest import (
    check_root,
    complete_checkpoints,
    latest_checkpoint,
    prune,
    remove_leftovers,
    step_path,
)
from checkpoint_io._load import load_checkpoint
from checkpoint_io._save import save_checkpoint
from checkpoint_io._stop import Requeue, StopSignals
from dist_core import log_rank0, make_dirs, rank

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Checkpoints of a long run under one root: ``root/step-<N>``.

    Every method that saves or loads is collective (every rank calls it, in the same order);
    with ``on_sigterm=True`` so is the constructor. Without a process group it all runs in one
    process.

    Example::

        manager = CheckpointManager("ckpt", every=500, keep_last=3, async_save=True,
                                    on_sigterm=True)
        start = manager.resume(model, optimizer)           # 0 on a fresh run
        for step in range(start, total_steps):
            train_one_step(step)
            manager.maybe_save(step + 1, model, optimizer)  # steps completed so far
        manager.wait()

    Args:
        root: The directory of the ``step-<N>`` checkpoints (created when first saved).
        every: Save when the step passed to ``maybe_save`` is a multiple of it.
        keep_last: Keep only the newest ``keep_last`` complete checkpoints; older ones are
            removed once a new one is published. The one just published, and any at a
            higher step (a roll-back's abandoned run), are never removed. ``None`` keeps all.
        async_save: Write in the background (:func:`async_save_checkpoint`): training goes on
            once the state is staged in host memory.
        on_sigterm: Install a SIGTERM handler (torchrun and schedulers send SIGTERM before
            SIGKILL): at the next ``maybe_save`` every rank learns of it, all save at that
            step, and the call raises ``SystemExit(0)`` once the checkpoint is published.
        signals: The signals to act on that way instead (``(signal.SIGUSR1,)`` for
            ``sbatch --signal=USR1@120``; names like ``"USR1"`` too); ``None`` is SIGTERM
            with ``on_sigterm``, else none.
        requeue: After such a save, on rank 0: ``True`` runs ``scontrol requeue
            $SLURM_JOB_ID`` (the job resumes from the checkpoint when it runs again); a
            callable requeues with another scheduler; ``False`` does nothing.

    Raises:
        TypeError: If ``root`` is not a path, or a flag is not a bool.
        ValueError: If ``every`` or ``keep_last`` is below 1, a signal cannot be caught,
            ``requeue=True`` outside a SLURM job, or signals are asked for outside the main
            thread.
        NotADirectoryError: If ``root`` is a file.
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
        for name, flag in (("async_save", async_save), ("on_sigterm", on_sigterm)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__} ({flag!r})")
        self.async_save = async_save
        self._pending: PendingCheckpoint | None = None
        if signals is None:
            signals = (signal.SIGTERM,) if on_sigterm else ()
        self._stop = StopSignals(signals, requeue)

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

        Pass the number of steps completed, so that :meth:`resume` returns the step to start
        from. Collective.

        Returns:
            The checkpoint's path (with ``async_save``, where it will be published), or
            ``None`` when nothing was saved.

        Raises:
            SystemExit: With code 0, after the checkpoint is published (and the job
                requeued), when a stop signal reached any rank.
            ValueError: If ``step`` is negative.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0 (steps completed), got {step!r}")
        stopping = self._stop.agreed()
        if not (force or stopping or step % self.every == 0):
            return None
        path = step_path(self.root, step)
        if rank() == 0:
            make_dirs(self.root)  # durable too: the root may be new
        if self.async_save and not stopping:
            self._pending = start_async_save(
                path,
                model,
                optimizer,
                step,
                extra,
                stateful,
                rng=True,
                overwrite=True,
                after_publish=lambda: self._prune(step),
            )
        else:
            save_checkpoint(
                path, model, optimizer, stateful=stateful, extra=extra, step=step, overwrite=True
            )
            self._pending = None
            if rank() == 0:
                self._prune(step)
        if stopping:
            received = self._stop.received
            log_rank0(
                logger,
                logging.WARNING,
                "%s: saved %s; exiting with code 0",
                received.name if received is not None else "a stop signal on another rank",
                path,
            )
            self.close()
            self._stop.after_save()
            raise SystemExit(0)
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
        """Load the latest complete checkpoint; return its step, the step to start from.

        Collective: rank 0 lists the complete checkpoints (newest first) and removes the
        temporary directories of saves that never finished; every rank loads the newest
        (any strategy, any world size). When it fails to load (a flipped bit, a malformed
        manifest), every rank warns, naming it and the reason, and tries the next older one.

        Returns:
            The saved step (0 when there is no checkpoint yet: start from the beginning).
        """
        candidates: list[Path] = []
        if rank() == 0:
            remove_leftovers(self.root)
            candidates = complete_checkpoints(self.root)
        for path in from_rank0(candidates):
            try:  # collective: every rank gets the same outcome
                info = load_checkpoint(path, model, optimizer, stateful=stateful)
                step = _resume_step(info.step, path)
            except CheckpointError as error:
                log_rank0(
                    logger,
                    logging.WARNING,
                    "cannot resume from %s (%s); trying the next older checkpoint",
                    path,
                    error,
                )
                continue
            log_rank0(logger, logging.INFO, "resuming from %s at step %d", path, step)
            return step
        log_rank0(logger, logging.INFO, "no checkpoint under %s: starting at step 0", self.root)
        return 0

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

    def _prune(self, published: int) -> None:
        if self.keep_last is not None:
            prune(self.root, self.keep_last, published)


def _resume_step(saved: object, path: Path) -> int:
    """The step to resume at: the manifest's, which must be a non-negative int.

    Raises:
        CheckpointError: A step of another type or a negative one (a malformed manifest).
    """
    if saved is None:
        return int(path.name.split("-")[-1])  # canonical step-<N> names only (_latest)
    if isinstance(saved, bool) or not isinstance(saved, int) or saved < 0:
        raise CheckpointError(
            f"{path}'s manifest gives the step as {saved!r}; a step is an int >= 0 "
            "(a malformed checkpoint)"
        )
    return saved


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value
