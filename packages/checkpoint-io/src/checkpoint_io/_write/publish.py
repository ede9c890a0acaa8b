"""A save's two ends: its arguments and temporary directory; the manifest, fsyncs and rename."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checkpoint_io._collective import agree, from_rank0
from checkpoint_io._format.digest import FileTable
from checkpoint_io._format.manifest import (
    MANIFEST,
    METADATA_FILE,
    RNG_DIR,
    write_manifest,
)
from checkpoint_io._state.stateful import StatefulParts, check_stateful
from checkpoint_io._state.stateful import file_name as stateful_file
from checkpoint_io._write.hashing import HashingWriter, hash_files
from checkpoint_io._write.inflight import settle_in_flight
from dist_core import (
    fsync_dir,
    fsync_file,
    fsync_tree,
    rank,
)
from rng_fork import RngState

logger = logging.getLogger(__name__)


# Test hook: a rank with this set to a checkpoint's directory name (``step-6``) kills itself
# with SIGKILL inside that save, after its files are written and before the checkpoint is
# published (the restart tests use it).
TEST_KILL_IN_SAVE = "CHECKPOINT_IO_TEST_KILL_IN_SAVE"


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
