"""A save's two ends: its arguments; the side files, the manifest, fsyncs and rename."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
from collections.abc import Callable, Mapping
from pathlib import Path

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
from checkpoint_io._write.claim import SaveClaim
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
    claim: SaveClaim,
    rng_state: RngState | None,
    parts: StatefulParts | None,
    *,
    device: torch.device | None,
    host_only: bool = False,
    tensor_crc32: bool = True,
) -> HashingWriter:
    """DCP's writer for ``claim``'s save that publishes it when DCP commits.

    The ranks settle the temporary directory in DCP's planning (:class:`SaveClaim`); each
    writes its RNG and stateful files, then its data files; once DCP has written
    ``.metadata``, rank 0 adds the file tables to the manifest, flushes everything to the
    disk and renames the temporary directory to the target. A failure anywhere is raised on
    every rank (by DCP, or by the claim once DCP returns), and nothing is published.
    """
    return HashingWriter(
        claim,
        functools.partial(_side_files, claim, rng_state, parts),
        functools.partial(_seal, claim),
        device=device,
        host_only=host_only,
        tensor_crc32=tensor_crc32,
        written=functools.partial(_test_kill, claim.target),
    )


def _side_files(
    claim: SaveClaim, rng_state: RngState | None, parts: StatefulParts | None
) -> list[str]:
    """Write this rank's RNG and stateful files (not yet flushed); their names."""
    partial = _settled(claim)
    names: list[str] = []
    if rng_state is not None:
        names.append(f"{RNG_DIR}/rank{rank()}.pt")
        _side_file(partial / names[-1], lambda f: torch.save(rng_state, f))
    if parts is not None and parts.writes_file(rank()):
        names.append(stateful_file(rank()))
        _side_file(partial / names[-1], lambda f: f.write_bytes(parts.blob))
    return names


def _side_file(file: Path, write: Callable[[Path], object]) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    write(file)


def _test_kill(target: Path) -> None:
    """The restart test's kill mid-save: every file of this rank written, nothing published."""
    if os.environ.get(TEST_KILL_IN_SAVE) == target.name:
        os.kill(os.getpid(), signal.SIGKILL)


def _settled(claim: SaveClaim) -> Path:
    if claim.partial is None:  # DCP writes only after the plans are settled
        raise RuntimeError("the save's directory was not settled before writing")
    return claim.partial


def _seal(claim: SaveClaim, tables: list[FileTable]) -> None:
    """On rank 0, every rank's files written: the manifest, the fsyncs, then the rename."""
    partial, target, manifest = _settled(claim), claim.target, claim.manifest
    table: FileTable = {}
    tables[0] = {**tables[0], **hash_files(partial, [METADATA_FILE])}
    for writer_rank, each in enumerate(tables):
        table.update({name: {**entry, "rank": writer_rank} for name, entry in each.items()})
    write_manifest(partial, {**manifest, "files": table})
    fsync_file(partial / MANIFEST)
    fsync_tree(partial)  # every file's directory entry, then the rename
    _publish(partial, target)


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
