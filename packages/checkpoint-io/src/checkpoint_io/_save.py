"""``save_checkpoint``: atomic, collective, portable."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from checkpoint_io import _state
from checkpoint_io._collective import agree, from_rank0, single_process_quiet
from checkpoint_io._compat import CheckpointException, dcp_failure
from checkpoint_io._digest import FileTable, HashingWriter, hash_files
from checkpoint_io._errors import CheckpointError
from checkpoint_io._inflight import settle_in_flight
from checkpoint_io._manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    METADATA_FILE,
    RNG_DIR,
    write_manifest,
)
from checkpoint_io._stateful import StatefulParts
from checkpoint_io._stateful import collect as collect_stateful
from checkpoint_io._stateful import file_name as stateful_file
from dist_core import (
    fsync_dir,
    fsync_file,
    fsync_tree,
    log_rank0,
    rank,
    strategy_of,
    unwrap_model,
    world_size,
)
from rng_fork import RngState, capture_rng_state

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
# Test hook: a rank with this set to a checkpoint's directory name (``step-6``) kills itself
# with SIGKILL inside that save, after its files are written and before the checkpoint is
# published (the restart tests use it).
TEST_KILL_IN_SAVE = "CHECKPOINT_IO_TEST_KILL_IN_SAVE"


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

    Collective: every rank of the default group calls it; without a process group it runs in
    one process. The directory holds the ``torch.distributed.checkpoint`` files (each rank
    writes its shards; replicated tensors are written once), ``checkpoint.json`` and, with
    ``rng``, each rank's RNG state. Keys are the plain model's ``state_dict()`` keys whatever
    the wrapping (DDP, FSDP2, ``torch.compile``), and the optimizer state is keyed by
    parameter name, so the checkpoint loads under any strategy and world size.

    Atomic: everything is written to a temporary sibling directory, which is renamed to
    ``path`` once every rank has finished. If any rank fails, every rank raises, an existing
    checkpoint at ``path`` is left intact and no partial directory is left behind.

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
    target, partial = begin(path, model, optimizer, step, extra, stateful, overwrite)
    started = time.perf_counter()
    try:
        _write(partial, target, model, optimizer, step, extra, stateful, rng)
    except BaseException:
        if rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
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


def _write(
    partial: Path,
    target: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
    extra: Mapping[str, Any] | None,
    stateful: Mapping[str, Any] | None,
    rng: bool,
) -> None:
    state, parts = collect_state(model, optimizer, stateful)
    manifest = new_manifest(model, optimizer, step, extra, parts, rng)
    rng_state = capture_rng_state(_state.model_device(model)) if rng else None
    writer = HashingWriter(partial, device=_state.model_device(model))
    try:
        with single_process_quiet():
            dcp_save(state, storage_writer=writer)
    except CheckpointException as error:  # a BaseException: make it an Exception
        raise CheckpointError(dcp_failure(f"writing {str(target)!r}", error)) from None
    finish(partial, target, manifest, writer, rng_state, parts=parts)


def collect_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stateful: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], StatefulParts | None]:
    """The state DCP writes, keyed by plain names, and the ``stateful=`` objects' parts.

    Collective: a failure raises everywhere, before anything is written.

    Raises:
        TypeError: A stateful value that could not be read back safely (on the rank that
            holds it; the others raise ``CheckpointError`` naming that rank).
    """
    state: dict[str, Any] = {}
    parts: StatefulParts | None = None
    failure: BaseException | None = None
    try:
        _state.require_model_device(model, "save_checkpoint")
        state[_state.MODEL] = _state.model_state(model)
        if optimizer is not None:
            state[_state.OPTIM] = _state.optimizer_state(model, optimizer)
        if stateful:
            parts = collect_stateful(stateful)
            if parts.sharded:  # only the DTensor leaves go through DCP
                state[_state.STATEFUL] = parts.sharded
    except Exception as error:
        failure = error
    everyone = agree(
        failure, "collecting the state to save", share=None if parts is None else parts.digests
    )
    if parts is not None:
        parts.everyone = everyone
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
        "model_class": _state.model_class(model),
        "parameters": sum(p.numel() for p in unwrap_model(model).parameters()),
        "optimizer": optimizer is not None,
        "stateful": [] if parts is None else sorted(parts.classes),
        "stateful_state": {} if parts is None else parts.manifest(),
        "rng": rng,
        "tied": _state.tied_names(model),
        "model_keys": list(unwrap_model(model).state_dict(keep_vars=True)),
        "extra": dict(extra or {}),
    }


def finish(
    partial: Path,
    target: Path,
    manifest: dict[str, Any],
    writer: HashingWriter,
    rng_state: RngState | None,
    group: dist.ProcessGroup | None = None,
    *,
    parts: StatefulParts | None = None,
) -> None:
    """After DCP wrote ``partial``: RNG and stateful files, file table, manifest, rename.

    Everything is fsynced before the rename.

    Collective over ``group``: ``writer`` has the entries of the data files this rank wrote;
    every rank's are gathered to rank 0, which adds ``.metadata``, writes the manifest and
    publishes once every file and directory is on the disk. A failure on any rank raises on
    every rank and nothing is published.
    """
    failure: BaseException | None = None
    files: FileTable = {}
    try:
        if rng_state is not None:
            name = f"{RNG_DIR}/rank{rank()}.pt"
            (partial / RNG_DIR).mkdir(parents=True, exist_ok=True)
            torch.save(rng_state, partial / name)
            fsync_file(partial / name)
            files.update(hash_files(partial, [name]))
        if parts is not None and parts.writes_file(rank()):
            name = stateful_file(rank())
            (partial / name).parent.mkdir(parents=True, exist_ok=True)
            (partial / name).write_bytes(parts.blob)
            fsync_file(partial / name)
            files.update(hash_files(partial, [name]))
        files.update(writer.files)  # summed in a thread since DCP wrote them
    except Exception as error:
        failure = error
    if os.environ.get(TEST_KILL_IN_SAVE) == target.name:  # the restart test: a kill mid-save
        os.kill(os.getpid(), signal.SIGKILL)
    tables = agree(failure, "saving the RNG states and checksumming the files", group, share=files)
    failure = None
    if rank() == 0:
        try:
            table: FileTable = {}
            tables[0] = {**tables[0], **hash_files(partial, [METADATA_FILE])}
            for writer_rank, each in enumerate(tables):
                table.update({name: {**entry, "rank": writer_rank} for name, entry in each.items()})
            write_manifest(partial, {**manifest, "files": table})
            fsync_file(partial / MANIFEST)
            fsync_tree(partial)  # every file's directory entry, then the rename
            _publish(partial, target)
        except Exception as error:
            failure = error
    agree(failure, f"publishing {str(target)!r}", group)


def begin(
    path: object,
    model: object,
    optimizer: object,
    step: object,
    extra: object,
    stateful: object,
    overwrite: bool,
) -> tuple[Path, Path]:
    """Check the arguments, settle a save still in flight, name the temporary sibling.

    Returns:
        ``(target, partial)``: the checkpoint directory and where it is written first.
    """
    target = _check_arguments(path, model, optimizer, step, extra, stateful)
    settle_in_flight()
    exists, token = from_rank0((target.exists(), uuid.uuid4().hex[:12]))
    if exists and not overwrite:
        raise FileExistsError(
            f"{str(target)!r} already exists; pass overwrite=True to replace it (the old "
            "checkpoint is removed only once the new one is complete), or choose a new path"
        )
    return target, target.parent / f".{target.name}.partial-{token}"


def _publish(partial: Path, target: Path) -> None:
    """Rename the complete checkpoint into place; an old one goes only after that."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{partial.name.rsplit('-', 1)[1]}"
        target.rename(old)
    try:
        partial.rename(target)
    except BaseException:
        if old is not None:
            old.rename(target)
        raise
    fsync_dir(target.parent)  # the rename is on the disk before the old checkpoint goes
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _check_arguments(
    path: object,
    model: object,
    optimizer: object,
    step: object,
    extra: object,
    stateful: object,
) -> Path:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} ({path!r})")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"step must be an int or None, got {type(step).__name__} ({step!r})")
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise TypeError(f"extra must be a mapping or None, got {type(extra).__name__}")
        try:
            json.dumps(dict(extra))
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"extra must be JSON-serialisable (it goes into checkpoint.json): {error}; "
                "store tensors and other objects through stateful= instead"
            ) from None
    check_stateful(stateful)
    return Path(os.fspath(path))


def check_stateful(stateful: object) -> None:
    """``stateful`` is ``None`` or a mapping of names to objects with both state methods."""
    if stateful is None:
        return
    if not isinstance(stateful, Mapping):
        raise TypeError(
            f"stateful must be a mapping of names to objects, got {type(stateful).__name__}"
        )
    for name, obj in stateful.items():
        if not isinstance(name, str):
            raise TypeError(f"stateful keys must be strings, got {name!r}")
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"stateful[{name!r}] is a {type(obj).__name__}, which lacks state_dict() and "
                "load_state_dict(); pass an object with both (LR scheduler, module, sampler)"
            )
