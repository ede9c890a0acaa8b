"""DCP's index as JSON (``index.json``), decoded field by field with caps: no code in it.

Each tensor's size, chunks and where each chunk's bytes lie (file, offset, length), and every
value that is not a tensor (safe-store's tagged JSON).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from checkpoint_io._errors import CheckpointError, shown
from safe_store import DTYPES, MAX_DIMS, strict_json

INDEX_FORMAT = "checkpoint_io.index/1"
MAX_CHUNKS = 1 << 16
"""Chunks one tensor may have (a world size of 65536 ranks); more is refused."""
MAX_PATH_INDEX = 1 << 24
"""The largest list position a key's path may hold (a state's list, a parameter group)."""
_NAMES = {str(dtype).removeprefix("torch."): dtype for dtype in DTYPES.values()}


@dataclasses.dataclass(frozen=True)
class Record:
    """Where one chunk's bytes lie: a data file, the offset and length of its bytes."""

    file: str
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class Value:
    """A value that is not a tensor: its tagged JSON text (safe-store's codec)."""

    text: str


def encode_index(metadata: Metadata, where: Mapping[MetadataIndex, Any]) -> bytes:
    """``index.json``'s bytes: DCP's ``metadata``, with each chunk's record and each value.

    Args:
        metadata: What DCP's planner made.
        where: The write results' storage data: a :class:`Record` per chunk, a
            :class:`Value` per value.
    """
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            value = where[MetadataIndex(fqn)]
            values[fqn] = json.loads(value.text)
            continue
        chunks = []
        for chunk in entry.chunks:
            record = where[MetadataIndex(fqn, chunk.offsets)]
            chunks.append(
                {
                    "offsets": list(chunk.offsets),
                    "sizes": list(chunk.sizes),
                    "file": record.file,
                    "at": record.offset,
                    "bytes": record.length,
                }
            )
        tensors[fqn] = {
            "dtype": str(entry.properties.dtype).removeprefix("torch."),
            "size": list(entry.size),
            "requires_grad": bool(entry.properties.requires_grad),
            "chunks": chunks,
        }
    paths = {k: list(v) for k, v in (metadata.planner_data or {}).items()}
    body = {"format": INDEX_FORMAT, "tensors": tensors, "values": values, "paths": paths}
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def decode_index(data: bytes, file: Path) -> Metadata:
    """DCP's ``Metadata`` from ``index.json``'s bytes, every field checked.

    ``storage_data`` maps each chunk to its :class:`Record` and each value to its
    :class:`Value`.

    Raises:
        CheckpointError: Naming the field and the fault.
    """
    try:
        body = strict_json(data, str(file))
    except ValueError as error:
        raise CheckpointError(
            f"{error}; the index is corrupt (refused, nothing was read)"
        ) from None
    if not isinstance(body, dict) or body.get("format") != INDEX_FORMAT:
        raise _malformed(file, "format", body.get("format") if isinstance(body, dict) else body)
    parts: list[dict[str, Any]] = []
    for field in ("tensors", "values", "paths"):
        found = body.get(field)
        if not isinstance(found, dict):
            raise _malformed(file, field, found)
        parts.append(found)
    tensors, values, paths = parts
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for fqn, entry in tensors.items():
        entries[fqn] = _tensor(file, fqn, entry, storage)
    for fqn, value in values.items():
        if fqn in entries:
            raise _malformed(file, f"values[{fqn!r}]", "a tensor's name")
        entries[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = Value(json.dumps(value, allow_nan=False))
    planner_data = {fqn: _path(file, fqn, path) for fqn, path in paths.items()}
    unknown = sorted(set(planner_data) - set(entries))
    if unknown or sorted(entries) != sorted(planner_data):
        odd = unknown or sorted(set(entries) - set(planner_data))
        raise _malformed(file, "paths", f"paths and entries that differ ({odd[:3]})")
    return Metadata(state_dict_metadata=entries, planner_data=planner_data, storage_data=storage)


def _tensor(
    file: Path, fqn: str, entry: Any, storage: dict[MetadataIndex, Any]
) -> TensorStorageMetadata:
    field = f"tensors[{shown(fqn, 80)}]"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "size", "requires_grad", "chunks"}:
        raise _malformed(file, field, entry)
    dtype = _NAMES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    size = entry["size"]
    if dtype is None:
        raise _malformed(file, f"{field}['dtype']", entry["dtype"])
    if not _dims(size):
        raise _malformed(file, f"{field}['size']", size)
    if type(entry["requires_grad"]) is not bool or not isinstance(entry["chunks"], list):
        raise _malformed(file, field, entry)
    if len(entry["chunks"]) > MAX_CHUNKS:
        raise _malformed(file, f"{field}['chunks']", f"{len(entry['chunks'])} chunks")
    chunks = []
    for chunk in entry["chunks"]:
        if (
            not isinstance(chunk, dict)
            or set(chunk) != {"offsets", "sizes", "file", "at", "bytes"}
            or not _dims(chunk["offsets"])
            or not _dims(chunk["sizes"])
            or not isinstance(chunk["file"], str)
            or not _natural(chunk["at"])
            or not _natural(chunk["bytes"])
        ):
            raise _malformed(file, f"{field}['chunks']", chunk)
        offsets = torch.Size(chunk["offsets"])
        chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(chunk["sizes"])))
        storage[MetadataIndex(fqn, offsets)] = Record(chunk["file"], chunk["at"], chunk["bytes"])
    properties = TensorProperties(dtype=dtype, requires_grad=entry["requires_grad"])
    return TensorStorageMetadata(properties=properties, size=torch.Size(size), chunks=chunks)


def _path(file: Path, fqn: str, path: Any) -> tuple[str | int, ...]:
    if (
        not isinstance(path, list)
        or not path
        or not all(isinstance(p, str) or (type(p) is int and p >= 0) for p in path)
        or ".".join(map(str, path)) != fqn
    ):
        raise _malformed(file, f"paths[{shown(fqn, 80)}]", path)
    past = [p for p in path if type(p) is int and p > MAX_PATH_INDEX]
    if past:
        raise CheckpointError(
            f"{file}'s paths[{shown(fqn, 80)}] holds the list position {past[0]}, past the "
            f"cap MAX_PATH_INDEX = {MAX_PATH_INDEX} (a list is rebuilt as long as its largest "
            "position); the index is corrupt or crafted (refused, nothing was read)"
        )
    return tuple(path)


def _dims(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= MAX_DIMS
        and all(_natural(d) and d < 1 << 62 for d in value)
    )


def _natural(value: Any) -> bool:
    return type(value) is int and value >= 0


def _malformed(file: Path, field: str, value: Any) -> CheckpointError:
    return CheckpointError(
        f"{file}'s {field} is malformed ({shown(value, 80)}); the index is corrupt or crafted "
        "(refused, nothing was read)"
    )
