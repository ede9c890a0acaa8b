"""A save's two ends: its arguments and temporary directory; the manifest, fsyncs and rename."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

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


def publishing_writer(
    partial: Path,
    target: Path,
    manifest: dict[str, Any],
    rng_state: RngState | None,
    parts: StatefulParts | None,
    *,
    device: torch.device | None,
    host_only: bool = False,
) -> HashingWriter:
    """DCP's writer for ``partial`` that publishes it at ``target`` when DCP commits.

    Each rank writes its RNG and stateful files, then its data files; once DCP has written
    ``.metadata``, rank 0 adds the file tables to ``manifest``, flushes everything to the
    disk and renames ``partial`` to ``target``. A failure anywhere is raised by DCP on every
    rank, and nothing is published.
    """
    return HashingWriter(
        partial,
        functools.partial(_side_files, partial, rng_state, parts),
        functools.partial(_seal, partial, target, manifest),
        device=device,
        host_only=host_only,
        written=functools.partial(_test_kill, target),
    )


def _side_files(
    partial: Path, rng_state: RngState | None, parts: StatefulParts | None
) -> FileTable:
    """This rank's RNG and stateful files, flushed to the disk, with their entries."""
    files: FileTable = {}
    if rng_state is not None:
        files.update(
            _side_file(partial, f"{RNG_DIR}/rank{rank()}.pt", lambda f: torch.save(rng_state, f))
        )
    if parts is not None and parts.writes_file(rank()):
        files.update(
            _side_file(partial, stateful_file(rank()), lambda f: f.write_bytes(parts.blob))
        )
    return files


def _side_file(partial: Path, name: str, write: Callable[[Path], object]) -> FileTable:
    """Write ``partial / name`` with ``write``, flush it to the disk; its entry."""
    (partial / name).parent.mkdir(parents=True, exist_ok=True)
    write(partial / name)
    fsync_file(partial / name)
    return hash_files(partial, [name])


def _test_kill(target: Path) -> None:
    """The restart test's kill mid-save: every file of this rank written, nothing published."""
    if os.environ.get(TEST_KILL_IN_SAVE) == target.name:
        os.kill(os.getpid(), signal.SIGKILL)


def _seal(partial: Path, target: Path, manifest: dict[str, Any], tables: list[FileTable]) -> None:
    """On rank 0, every rank's files written: the manifest, the fsyncs, then the rename."""
    table: FileTable = {}
    tables[0] = {**tables[0], **hash_files(partial, [METADATA_FILE])}
    for writer_rank, each in enumerate(tables):
        table.update({name: {**entry, "rank": writer_rank} for name, entry in each.items()})
    write_manifest(partial, {**manifest, "files": table})
    fsync_file(partial / MANIFEST)
    fsync_tree(partial)  # every file's directory entry, then the rename
    _publish(partial, target)


def claim(target: Path) -> tuple[bool, str]:
    """What rank 0 tells the others as a save starts: ``target`` exists; a temporary name."""
    return target.exists(), uuid.uuid4().hex[:12]


def partial_for(target: Path, overwrite: bool, claimed: tuple[bool, str]) -> Path:
    """Where a save writes first, from rank 0's :func:`claim` (the same on every rank).

    Raises:
        FileExistsError: If ``target`` exists and ``overwrite`` is false.
    """
    exists, token = claimed
    if exists and not overwrite:
        raise FileExistsError(
            f"{str(target)!r} already exists; pass overwrite=True to replace it (the old "
            "checkpoint is removed only once the new one is complete), or choose a new path"
        )
    return target.parent / f".{target.name}.partial-{token}"


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


def begin(
    path: object,
    model: object,
    optimizer: object,
    step: object,
    extra: object,
    stateful: object,
) -> Path:
    """Check the arguments and settle a save still in flight (no collective).

    Returns:
        The checkpoint directory.

    Raises:
        TypeError: An argument of the wrong type, named with its value.
    """
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
    settle_in_flight()
    return Path(os.fspath(path))
