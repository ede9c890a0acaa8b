"""Per-file digests: each rank hashes the files it writes, and a share of the files it reads.

No tensor is gathered to check a checkpoint: the manifest records every file's size and
sha256, each rank computes the digests of the files it wrote (O(model / world)), and a verified
load splits the files among the ranks so that each file is hashed once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint_io._errors import CheckpointError

ALGORITHM = "sha256"
_CHUNK = 8 << 20
# name (relative to the checkpoint directory, "/"-separated)
#   -> {"bytes": n, "sha256": hex, "rank": the rank that wrote it}
FileTable = dict[str, dict[str, Any]]


def file_entry(file: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": digest}`` of one file."""
    digest = hashlib.new(ALGORITHM)
    size = 0
    with file.open("rb", buffering=0) as stream:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while read := stream.readinto(buffer):
            digest.update(view[:read])  # releases the GIL: other threads run meanwhile
            size += read
    return {"bytes": size, ALGORITHM: digest.hexdigest()}


def hash_files(root: Path, names: Iterable[str]) -> FileTable:
    """The entries of ``names`` (paths relative to ``root``)."""
    return {name: file_entry(root / name) for name in sorted(names)}


class HashingWriter(FileSystemWriter):
    """DCP's file writer that also records the size and digest of every file this rank wrote."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.root = path
        self.files: FileTable = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's files (DCP), then hash them while they are in the page cache."""
        written = super().write_data(plan, planner)
        results = written.wait()
        names = {
            str(result.storage_data.relative_path)
            for result in results
            if getattr(result.storage_data, "relative_path", None) is not None
        }
        self.files = hash_files(self.root, names)
        return written


def share(files: Mapping[str, Mapping[str, Any]], rank: int, world_size: int) -> list[str]:
    """The files that ``rank`` checks: each file goes to exactly one rank.

    A file goes to the rank that wrote it when that rank exists in this world (the same
    split as the save); the others are dealt round-robin.
    """
    mine = []
    for index, name in enumerate(sorted(files)):
        writer = files[name].get("rank")
        owner = writer if isinstance(writer, int) and writer < world_size else index % world_size
        if owner == rank:
            mine.append(name)
    return mine


def check_sizes(root: Path, files: Mapping[str, Mapping[str, Any]]) -> None:
    """Every recorded file is present at its recorded size (no read).

    Raises:
        CheckpointError: Naming the first file that is missing or has another size.
    """
    for name, entry in sorted(files.items()):
        file = root / name
        size = file.stat().st_size if file.is_file() else -1
        if size != int(entry["bytes"]):
            found = "missing" if size < 0 else f"{size} bytes, {entry['bytes']} were written"
            raise CheckpointError(
                f"the checkpoint is truncated or corrupt: {name} is {found}; save it again "
                "(or restore it from a copy)"
            )


def check_digests(root: Path, files: Mapping[str, Mapping[str, Any]], names: list[str]) -> None:
    """The files ``names`` have the digests recorded in ``files``.

    Raises:
        CheckpointError: Naming the first file whose content differs.
    """
    for name in names:
        expected = files[name][ALGORITHM]
        found = file_entry(root / name)[ALGORITHM]
        if found != expected:
            raise CheckpointError(
                f"verification failed for {str(root)!r}: {name} has sha256 {found[:16]}, the "
                f"checkpoint recorded {expected[:16]}; the file was changed or damaged after "
                "saving. Nothing was loaded"
            )
