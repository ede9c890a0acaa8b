"""Stopping on a signal: which signals, every rank told, and the job requeued after the save.

A handler only sets a flag; at the next step boundary the ranks agree (one all-reduce on a
gloo group), every rank saves, and after the publish rank 0 requeues the job (``scontrol
requeue $SLURM_JOB_ID``, or the caller's function) before every rank exits 0.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from checkpoint_io._collective import gloo_group
from dist_core import is_distributed, log_rank0, rank, slurm_job_id

logger = logging.getLogger(__name__)


Requeue = bool | Callable[[], object]


_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


class StopSignals:
    """The signals a run stops on, their handlers, the ranks' agreement and the requeue.

    Args:
        signals: The signals to act on (``signal.SIGTERM``, ``signal.SIGUSR1``, names or
            numbers).
        requeue: ``True``: run ``scontrol requeue $SLURM_JOB_ID`` on rank 0 after the save;
            a callable: call it there instead (another scheduler); ``False``: nothing.

    Raises:
        ValueError: A signal that cannot be caught or does not exist, ``requeue=True`` outside
            a SLURM job, a requeue without signals, or signals outside the main thread.
        TypeError: A requeue that is neither a bool nor a callable.
    """

    def __init__(self, signals: Iterable[int | str | signal.Signals], requeue: Requeue) -> None:
        self.signals = tuple(_signal(s) for s in signals)
        if not isinstance(requeue, bool) and not callable(requeue):
            raise TypeError(
                f"requeue must be a bool or a callable, got {type(requeue).__name__} ({requeue!r})"
            )
        if requeue is not False and not self.signals:
            raise ValueError(
                "requeue needs a signal to act on: pass signals=(signal.SIGUSR1,) (what "
                "sbatch --signal=USR1@120 sends) or on_sigterm=True"
            )
        self._job: int | None = None
        if requeue is True:
            try:
                self._job = slurm_job_id()
            except ValueError as error:
                raise ValueError(
                    f"requeue=True runs `scontrol requeue $SLURM_JOB_ID`, but {error}; pass a "
                    "callable that requeues with your scheduler"
                ) from None
        self.requeue = requeue
        self.received: signal.Signals | None = None
        self._event = threading.Event()
        self._previous: dict[signal.Signals, Any] = {}
        self._group: dist.ProcessGroup | None = None
        if self.signals:
            if threading.current_thread() is not threading.main_thread():
                raise ValueError(
                    "stopping on a signal installs a signal handler, which only the main thread "
                    "can do; create the CheckpointManager in the main thread"
                )
            self._group = gloo_group("stop") if is_distributed() else None
            for number in self.signals:
                self._previous[number] = signal.signal(number, _Handler(self, number))

    @property
    def active(self) -> bool:
        """Whether handlers are installed."""
        return bool(self._previous)

    def agreed(self) -> bool:
        """Whether a stop signal reached any rank (collective where a group exists)."""
        if not self.active:
            return False
        if self._group is None:
            return self._event.is_set()
        flag = torch.tensor([1 if self._event.is_set() else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def exit_after_save(self, path: object) -> NoReturn:
        """Log, requeue (rank 0, :meth:`after_save`) and exit 0: the stop's checkpoint is out.

        Raises:
            SystemExit: Always, with code 0.
        """
        received = self.received
        log_rank0(
            logger,
            logging.WARNING,
            "%s: saved %s; exiting with code 0",
            received.name if received is not None else "a stop signal on another rank",
            path,
        )
        self.after_save()
        raise SystemExit(0)

    def after_save(self) -> None:
        """On rank 0, requeue the job (after the checkpoint is published).

        Raises:
            RuntimeError: If ``scontrol requeue`` failed (its output named) or is missing.
        """
        if self.requeue is False or rank() != 0:
            return
        if callable(self.requeue):
            self.requeue()
            logger.warning("requeued the job (%s)", getattr(self.requeue, "__name__", "callable"))
            return
        job = str(self._job)
        try:
            done = subprocess.run(
                ["scontrol", "requeue", job], capture_output=True, text=True, check=False
            )
        except FileNotFoundError:
            raise RuntimeError(
                f"the checkpoint is saved, but scontrol is not on PATH to requeue job {job}; "
                "resubmit the job"
            ) from None
        if done.returncode != 0:
            raise RuntimeError(
                f"the checkpoint is saved, but `scontrol requeue {job}` failed "
                f"({done.returncode}: {(done.stderr or done.stdout).strip()}); resubmit the job"
            )
        logger.warning("requeued SLURM job %s", job)

    def restore(self) -> None:
        """Put the previous handlers back where this object's is still the current one.

        A handler installed over it since stays; this one, inactive, passes the signal on.
        """
        for number, previous in self._previous.items():
            if getattr(signal.getsignal(number), "_stop_signals", None) is self:
                signal.signal(number, _unwrapped(previous))
        self._previous.clear()

    def _notice(self, number: signal.Signals) -> None:
        self.received = number
        self._event.set()


class _Handler:
    """Tells a live :class:`StopSignals`; once it is closed or gone, acts as ``previous`` did."""

    def __init__(self, stop: StopSignals, number: signal.Signals) -> None:
        self._alive = weakref.ref(stop)
        self.number = number
        self.previous = signal.getsignal(number)

    @property
    def _stop_signals(self) -> StopSignals | None:
        return self._alive()

    def __call__(self, signum: int, frame: types.FrameType | None) -> None:
        target = self._alive()
        if target is not None and target.active:
            target._notice(self.number)
            return
        previous = _unwrapped(self.previous)
        if callable(previous):
            previous(signum, frame)  # a handler stacked under ours: it still acts
        elif previous != signal.SIG_IGN:
            # NOTE: the default action (or an unknown one) is taken, not swallowed: a dropped
            # manager must not make SIGTERM harmless.
            signal.signal(self.number, signal.SIG_DFL)
            signal.raise_signal(signum)


def _unwrapped(handler: Any) -> Any:
    """``handler``, past any inactive handlers of ours (what acts when it is called)."""
    while isinstance(handler, _Handler):
        target = handler._stop_signals
        if target is not None and target.active:
            return handler
        handler = handler.previous
    return signal.SIG_DFL if handler is None else handler


def _signal(value: int | str | signal.Signals) -> signal.Signals:
    try:
        if isinstance(value, str):
            name = value.upper()
            number = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        else:
            number = signal.Signals(value)
    except (KeyError, ValueError):
        raise ValueError(f"signals: {value!r} is not a signal (e.g. signal.SIGUSR1)") from None
    if number in _UNCATCHABLE:
        raise ValueError(f"signals: {number.name} cannot be caught; use SIGTERM or SIGUSR1")
    return number
