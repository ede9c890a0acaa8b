"""``async_save_checkpoint``: stage now, write in the background, publish when complete."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpoint_io._arguments import begin
from checkpoint_io._background.inflight import PendingCheckpoint, track
from checkpoint_io._background.staging import replicated_share, stage
from checkpoint_io._claim import ClaimPlanner
from checkpoint_io._collective import (
    gloo_group,
    quiet_single_process_notice_in_background,
    single_process_quiet,
)
from checkpoint_io._compat import CheckpointException, async_save_staged, dcp_failure
from checkpoint_io._errors import CheckpointError
from checkpoint_io._save import agreed_write, discard
from checkpoint_io._storage.manifest import PathLike
from dist_core import is_distributed, log_rank0, rank, world_size

logger = logging.getLogger(__name__)


def async_save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    stateful: Mapping[str, Any] | None = None,
    rng: bool = True,
    overwrite: bool = False,
) -> PendingCheckpoint:
    """Save like :func:`save_checkpoint`, but return once the state is staged.

    Collective, with the arguments and the checkpoint of ``save_checkpoint``. The model,
    optimizer and stateful states are copied to host memory (staged) before the call returns,
    so the next training step may change them at once; torch's ``dcp.async_save`` then writes
    them in a background thread, whose collectives run on a gloo group of their own (never
    interleaved with the training loop's). The checkpoint is published atomically at ``path``
    when every rank has written its files. One save is in flight at a time: a new save (this
    one or ``save_checkpoint``) first waits for the previous one.

    The staged copy lives in host buffers kept between saves: this rank's shards and its
    share of the replicated tensors (with 2 DDP ranks, half the state each).

    Returns:
        A :class:`PendingCheckpoint`: ``wait()`` returns the path or re-raises a failure (on
        every rank); a failure that nobody waited for is raised by the next save.

    Raises:
        TypeError: If an argument has the wrong type.
        FileExistsError: If ``path`` exists and ``overwrite`` is false.
        CheckpointError: If staging failed on any rank, the ranks' replicated tensors
            differ (keys, shapes, dtypes), or the previous background save failed and was not
            waited for.
    """
    return start_async_save(
        path, model, optimizer, step, extra, stateful, rng=rng, overwrite=overwrite
    )


def start_async_save(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
    extra: Mapping[str, Any] | None,
    stateful: Mapping[str, Any] | None,
    *,
    rng: bool,
    overwrite: bool,
    after_publish: Callable[[], object] | None = None,
) -> PendingCheckpoint:
    """:func:`async_save_checkpoint`, plus an action after publishing.

    ``after_publish`` runs on rank 0 in the writing thread once the checkpoint is published,
    before ``wait()`` returns.
    """
    target = begin(path, model, optimizer, step, extra, stateful)
    started = time.perf_counter()
    state, writer = agreed_write(
        target, overwrite, model, optimizer, step, extra, stateful, rng, staging=_staged_share
    )
    try:  # every rank agreed: from here a failure removes the directory rank 0 made
        group = gloo_group("background")
        quiet_single_process_notice_in_background()
        with single_process_quiet():
            upload = async_save_staged(
                state, writer, ClaimPlanner(), group, no_dist=not is_distributed()
            )
    except BaseException:
        discard(writer.partial)
        raise
    staged_s = time.perf_counter() - started

    def complete() -> Path:
        try:
            if not isinstance(upload, concurrent.futures.Future):  # staged in the foreground
                raise TypeError(f"dcp.async_save returned {type(upload).__name__}")
            try:
                upload.result()  # published when DCP commits, which raises on every rank
            except CheckpointException as error:  # a BaseException: make it an Exception
                raise CheckpointError(dcp_failure(f"writing {str(target)!r}", error)) from None
            if after_publish is not None and rank() == 0:
                after_publish()
        except BaseException:
            discard(writer.partial)
            raise
        log_rank0(
            logger,
            logging.INFO,
            "saved %s in the background (step %s): staged in %.2f s, published after %.2f s",
            target,
            step,
            staged_s,
            time.perf_counter() - started,
        )
        return target

    pending = PendingCheckpoint(target, _EXECUTOR.submit(complete))
    track(pending)
    return pending


def _staged_share(state: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """This rank's share of ``state`` staged in host memory, and the layout ranks compare."""
    share, layout = replicated_share(state, rank(), world_size())
    return stage(share), layout


# The thread that finishes background saves (one in flight, so one thread).
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-async")
