"""A save's two ends: its arguments; the side files, the manifest, fsyncs and rename."""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from checkpoint_io._format.digest import FileTable, file_entry
from checkpoint_io._format.manifest import (
    INDEX_FILE,
    MANIFEST,
    next_sequence,
    rng_file,
    stateful_file,
    write_manifest,
)
from checkpoint_io._state.stateful import StatefulParts, check_stateful
from checkpoint_io._write.claim import SaveClaim
from checkpoint_io._write.inflight import settle_in_flight
from checkpoint_io._write.storage import SafeWriter, write_tensors_file
from dist_core import fsync_dir, fsync_file, fsync_tree, rank
from rng_fork import RngState
from safe_store import dumps


def publishing_writer(
    claim: SaveClaim,
    rng_state: RngState | None,
    parts: StatefulParts | None,
    *,
    device: torch.device | None,
) -> SafeWriter:
    """DCP's writer for ``claim``'s save that publishes it when DCP commits.

    The ranks settle the temporary directory in DCP's planning (:class:`SaveClaim`); each
    writes its RNG and stateful files, then its data file; once the index is written, rank 0
    adds the file tables to the manifest, flushes everything to the disk and renames the
    temporary directory to the target. A failure anywhere is raised on every rank (by DCP, or
    by the claim once DCP returns), and nothing is published.
    """
    return SafeWriter(
        claim,
        functools.partial(_side_files, rng_state, parts),
        functools.partial(seal, claim),
        device=device,
    )


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


def rng_tensors(state: RngState) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """An RNG state as a safetensors file's tensors (uint8) and ``__metadata__`` (JSON)."""
    device = state["device"]
    tensors = [("cpu", state["cpu"])]
    if device is not None:
        tensors.append(("device", device["state"]))
    described = {
        "format": state["format"],
        "device": None if device is None else {"type": device["type"], "index": device["index"]},
        "python": state["python"],
        "numpy": state["numpy"],
    }
    return tensors, {"rng": dumps(described, what="the RNG state")}


def seal(claim: SaveClaim, tables: list[FileTable]) -> None:
    """On rank 0, every rank's files written: the manifest, the fsyncs, then the rename."""
    partial, target, manifest = claim.partial, claim.target, claim.manifest
    if partial is None:  # DCP publishes only after the plans are settled
        raise RuntimeError("the save's directory was not settled before publishing")
    table: FileTable = {INDEX_FILE: {**file_entry(partial / INDEX_FILE), "rank": 0}}
    for writer_rank, each in enumerate(tables):
        table.update({name: {**entry, "rank": writer_rank} for name, entry in each.items()})
    # NOTE: the place in the saving order, from the checkpoints beside it (a manager's root):
    # after a roll-back, the newest saved is not the highest step.
    sequence = next_sequence(target.parent)
    write_manifest(partial, {**manifest, "files": table, "sequence": sequence})
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
            json.dumps(dict(extra), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"extra must be JSON-serialisable (it goes into checkpoint.json): {error}; "
                "store tensors and other objects through stateful= instead"
            ) from None
    check_stateful(stateful)
    settle_in_flight()
    return Path(os.fspath(path))
