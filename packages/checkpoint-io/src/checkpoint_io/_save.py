"""``save_checkpoint``, top to bottom: check, collect, claim, write with DCP, publish.

Atomic, collective, portable: every rank collects its state (no collective), the ranks agree
on the temporary directory (a failure on any rank raises on every rank there: nothing is
written), DCP plans the write, each rank writes its files, and rank 0 publishes the
checkpoint at DCP's commit (manifest, every file flushed, one rename, the parent flushed,
only then the old checkpoint removed).
"""

from __future__ import annotations

import functools
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from checkpoint_io._arguments import begin
from checkpoint_io._claim import ClaimPlanner, claim_now
from checkpoint_io._collective import single_process_quiet
from checkpoint_io._compat import CheckpointException, dcp_failure
from checkpoint_io._errors import CheckpointError
from checkpoint_io._model import (
    model_class,
    model_state,
    require_model_device,
    tied_names,
)
from checkpoint_io._optimizer import optimizer_state
from checkpoint_io._rng import rng_tensors
from checkpoint_io._stateful import StatefulParts
from checkpoint_io._stateful import collect as collect_stateful
from checkpoint_io._storage.manifest import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_FILE,
    MODEL,
    OPTIM,
    STATEFUL,
    FileTable,
    PathLike,
    file_entry,
    next_sequence,
    rng_file,
    stateful_file,
    write_manifest,
)
from checkpoint_io._storage.writer import SafeWriter, write_tensors_file
from dist_core import (
    bound_device,
    compute_device,
    log_rank0,
    on_device,
    rank,
    strategy_of,
    unwrap_model,
    world_size,
)
from rng_fork import RngState, capture_rng_state
from safe_store import publish

logger = logging.getLogger(__name__)


def save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    stateful: Mapping[str, Any] | None = None,
    rng: bool = True,
    overwrite: bool = False,
) -> Path:
    """Save ``model`` (and the optimizer, other state, every rank's RNG) to a directory.

    Collective (or in one process without a process group). Keys are the plain model's
    ``state_dict()`` keys whatever the wrapping, and the optimizer state is keyed by
    parameter name, so the checkpoint loads under any strategy and world size. Atomic: written
    to a temporary sibling, renamed to ``path`` once every rank has finished; if any rank
    fails, every rank raises and an existing checkpoint at ``path`` is left intact.

    Args:
        path: The checkpoint directory to create.
        model: A plain module, a DDP wrapper (ours or torch's), an FSDP2 model, or any of
            them under ``torch.compile``.
        optimizer: Its optimizer, if it is to be resumed too.
        step: The training step, returned by ``load_checkpoint`` in ``CheckpointInfo.step``.
        extra: A JSON-serialisable mapping stored in ``checkpoint.json``.
        stateful: Other objects with ``state_dict()`` / ``load_state_dict()`` (LR scheduler,
            EMA module, sampler), by name.
        rng: Save every rank's RNG state (CPU and this rank's device).
        overwrite: Replace an existing checkpoint at ``path`` (only once the new one is
            complete).

    Returns:
        ``path`` as a ``pathlib.Path``.

    Raises:
        TypeError: If an argument has the wrong type (named in the message).
        FileExistsError: If ``path`` exists and ``overwrite`` is false.
        CheckpointError: If writing failed on any rank (the rank and its error are named).
    """
    target = begin(path, model, optimizer, step, extra, stateful)
    started = time.perf_counter()
    state, writer = agreed_write(target, overwrite, model, optimizer, step, extra, stateful, rng)
    try:
        with single_process_quiet(), on_device(bound_device()):  # NCCL: the group's own
            dcp_save(state, storage_writer=writer, planner=ClaimPlanner())  # published at commit
    except CheckpointException as error:  # a BaseException: make it an Exception
        discard(writer.partial)
        raise CheckpointError(dcp_failure(f"writing {str(target)!r}", error)) from None
    except BaseException:
        discard(writer.partial)
        raise
    log_rank0(
        logger,
        logging.INFO,
        "saved %s (%s, %d rank(s), step %s) in %.2f s",
        target,
        strategy_of(model),
        world_size(),
        step,
        time.perf_counter() - started,
    )
    return target


def agreed_write(
    target: Path,
    overwrite: bool,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
    extra: Mapping[str, Any] | None,
    stateful: Mapping[str, Any] | None,
    rng: bool,
    staging: Callable[[dict[str, Any]], tuple[dict[str, Any], str]] | None = None,
) -> tuple[dict[str, Any], SafeWriter]:
    """This rank's state (``staging`` applied), agreed by every rank, and DCP's writer.

    Every rank collects first (no collective), then :func:`claim_now` agrees: a failure on
    any rank raises on every rank there, before DCP starts. The writer writes each rank's RNG
    and stateful files, then its data; at DCP's commit rank 0 seals and publishes.
    """
    state: dict[str, Any] = {}
    parts: StatefulParts | None = None
    rng_state = failure = None
    layout = ""
    manifest: dict[str, Any] = {}
    try:
        state, parts = collect_state(model, optimizer, stateful)
        manifest = new_manifest(model, optimizer, step, extra, parts, rng)
        rng_state = capture_rng_state(compute_device(model)) if rng else None
        if staging is not None:
            state, layout = staging(state)
    except Exception as error:
        failure = error
    partial = claim_now(target, overwrite, failure, parts, layout)
    if parts is not None:  # every rank's digests, known once agreed
        manifest["stateful_state"] = parts.manifest()
    writer = SafeWriter(
        partial,
        functools.partial(_side_files, rng_state, parts),
        functools.partial(seal, partial, target, manifest),
        device=compute_device(model),
    )
    return state, writer


def discard(partial: Path) -> None:
    """On rank 0, remove a save's temporary directory (nothing was published)."""
    if rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)


def collect_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stateful: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], StatefulParts | None]:
    """The state DCP writes (plain names) and the ``stateful=`` parts (no collective)."""
    state: dict[str, Any] = {}
    parts: StatefulParts | None = None
    require_model_device(model, "save_checkpoint")
    state[MODEL] = model_state(model)
    if optimizer is not None:
        state[OPTIM] = optimizer_state(model, optimizer)
    if stateful:
        parts = collect_stateful(stateful)
        if parts.sharded:  # only the DTensor leaves go through DCP
            state[STATEFUL] = parts.sharded
    return state, parts


def new_manifest(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
    extra: Mapping[str, Any] | None,
    parts: StatefulParts | None,
    rng: bool,
) -> dict[str, Any]:
    """``checkpoint.json`` without its file table (``finish`` adds it)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size(),
        "strategy": strategy_of(model),
        "torch_version": torch.__version__,
        "model_class": model_class(model),
        "parameters": sum(p.numel() for p in unwrap_model(model).parameters()),
        "optimizer": optimizer is not None,
        "stateful": [] if parts is None else sorted(parts.classes),
        "stateful_state": {},  # every rank's digests: filled in once the ranks agreed
        "rng": rng,
        "tied": tied_names(model),
        "model_keys": list(unwrap_model(model).state_dict(keep_vars=True)),
        "extra": dict(extra or {}),
    }


def _side_files(rng_state: RngState | None, parts: StatefulParts | None, root: Path) -> FileTable:
    """Write and flush this rank's RNG and stateful files; their table entries."""
    table: FileTable = {}
    if rng_state is not None:
        name = rng_file(rank())
        table[name] = write_tensors_file(root / name, *rng_tensors(rng_state))
    if parts is not None and parts.writes_file(rank()):
        name = stateful_file(rank())
        tensors = [(f"t{i}", t) for i, t in enumerate(parts.tensors)]
        table[name] = write_tensors_file(root / name, tensors, {"state": parts.text})
    return table


def seal(partial: Path, target: Path, manifest: dict[str, Any], tables: list[FileTable]) -> None:
    """On rank 0, once every rank's files are written: the manifest, then the publish."""
    table: FileTable = {INDEX_FILE: {**file_entry(partial / INDEX_FILE), "rank": 0}}
    for writer_rank, each in enumerate(tables):
        table.update({name: {**entry, "rank": writer_rank} for name, entry in each.items()})
    # NOTE: the place in the saving order, from the checkpoints beside it (a manager's root):
    # after a roll-back, the newest saved is not the highest step.
    sequence = next_sequence(target.parent)
    write_manifest(partial, {**manifest, "files": table, "sequence": sequence})
    aside = target.parent / f".{target.name}.old-{partial.name.rsplit('-', 1)[1]}"
    publish(partial, target, aside=aside)  # every file flushed, renamed, the parent flushed
