"""DCP's index checked against itself and the manifest before anything is read or allocated."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from checkpoint_io._errors import CheckpointError, shown
from checkpoint_io._storage.index import MAX_CHUNKS, Record

MAX_COMPARISONS = 1 << 22
"""Pairs of chunks whose rows meet that the overlap check compares, at most, per tensor."""


def check_index(root: Path, metadata: Metadata, manifest: Mapping[str, Any]) -> None:
    """Check the index against itself and against the manifest's file table.

    Raises:
        CheckpointError: Naming the first tensor whose chunks do not tile it, a record of
            another length than its bytes, or a data file not in the manifest.
    """
    storage = metadata.storage_data or {}
    recorded = manifest["files"]
    for info in storage.values():
        if isinstance(info, Record) and info.file not in recorded:
            raise CheckpointError(
                f"{root}: the index names the data file {shown(info.file)}, which the manifest "
                "did not record (a planted file is never read); refused as unsafe"
            )
    lengths = {
        (i.fqn, tuple(i.offset or ())): info.length
        for i, info in storage.items()
        if isinstance(info, Record)
    }
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            _check_tiling(root, fqn, entry, lengths)


def _check_tiling(
    root: Path,
    fqn: str,
    entry: TensorStorageMetadata,
    lengths: Mapping[tuple[str, tuple[int, ...]], int],
) -> None:
    size = tuple(int(d) for d in entry.size)
    item = entry.properties.dtype.itemsize
    chunks = entry.chunks
    if len(chunks) > MAX_CHUNKS or any(d < 0 for d in size):
        raise _bad(root, fqn, f"{len(chunks)} chunks of a tensor of size {size}")
    covered = 0
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for chunk in chunks:
        offsets = tuple(int(o) for o in chunk.offsets)
        sizes = tuple(int(s) for s in chunk.sizes)
        if (
            len(offsets) != len(size)
            or len(sizes) != len(size)
            or any(
                o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)
            )
        ):
            raise _bad(root, fqn, f"a chunk at {offsets} of {sizes} lies outside its size {size}")
        volume = math.prod(sizes)
        length = lengths.get((fqn, offsets))
        if length != volume * item:
            raise _bad(
                root,
                fqn,
                f"the chunk at {offsets} needs {volume * item} bytes but its record has "
                f"{length if length is not None else 'none'}",
            )
        if volume:
            boxes.append((offsets, sizes))
        covered += volume
    if covered != math.prod(size):
        raise _bad(
            root, fqn, f"its chunks cover {covered} of its {math.prod(size)} elements (size {size})"
        )
    _check_disjoint(root, fqn, boxes)


def _check_disjoint(
    root: Path, fqn: str, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> None:
    """No two chunks overlap: a sweep along dim 0 compares only chunks whose rows meet.

    With the volumes summing to the tensor's, disjoint chunks inside it tile it exactly.
    """
    if not boxes or not boxes[0][0]:
        if len(boxes) > 1:
            raise _bad(root, fqn, f"{len(boxes)} chunks of a scalar")
        return
    boxes.sort()
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    compared = 0
    for offsets, sizes in boxes:
        active = [box for box in active if box[0][0] + box[1][0] > offsets[0]]
        for other_offsets, other_sizes in active:
            compared += 1
            if compared > MAX_COMPARISONS:
                raise _bad(root, fqn, f"{len(boxes)} chunks too entangled to check")
            if all(
                o < oo + os and oo < o + s
                for o, s, oo, os in zip(offsets, sizes, other_offsets, other_sizes, strict=True)
            ):
                raise _bad(root, fqn, f"the chunks at {offsets} and {other_offsets} overlap")
        active.append((offsets, sizes))


def _bad(root: Path, fqn: str, fault: str) -> CheckpointError:
    return CheckpointError(
        f"{root}: the index is inconsistent for {shown(fqn)}: {fault}; the checkpoint is "
        "corrupt or "
        "crafted (refused, nothing was read)"
    )


def saved_entries(metadata: Metadata, top: str) -> dict[tuple[Any, ...], Any]:
    """``path -> storage metadata`` of the entries under ``top`` (paths without ``top``)."""
    paths = metadata.planner_data or {}
    found: dict[tuple[Any, ...], Any] = {}
    for key, storage in metadata.state_dict_metadata.items():
        path = paths.get(key, tuple(key.split(".", 1)))
        if path and path[0] == top:
            found[tuple(path[1:])] = storage
    return found
