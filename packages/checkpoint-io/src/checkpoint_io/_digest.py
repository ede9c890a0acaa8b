"""Per-file digests: each rank hashes the files it writes, and a share of the files it reads.

No tensor is gathered to check a checkpoint: the manifest records every file's size and
digest, each rank computes those of the files it wrote (O(model / world)), and a verified
load splits the files among the ranks so that each file is read once.

The digest is xxHash's XXH3-128 (the ``xxhash`` package), built for speed and for damage, not
for tampering (a checkpoint from an untrusted source is safe to read for other reasons, see
:mod:`checkpoint_io._safe`): about 20 GB/s on one core here, where sha256 runs at 1.1 GB/s.
The file is mapped (no copy out of the page cache) and hashed a window at a time. A flipped
bit, swapped words, a zeroed, stale or truncated page: each changes it (the size is checked
as well).

Checkpoints of format 2 recorded ``wsum64`` (sums of 64-bit words per 64 KiB block and a
position-weighted sum of the blocks' sums, modulo 2**64): still verified with it.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint_io._errors import CheckpointError, open_regular
from checkpoint_io._safe import inside
from dist_core import on_device

ALGORITHM = "xxh3_128"
"""The digest new checkpoints record (manifest format 3)."""
LEGACY = "wsum64"
"""The checksum of format 2, still verified."""
_BLOCK = 64 << 10  # wsum64: bytes summed together; the blocks' sums are weighted by position
_WINDOW = 256 << 20  # bytes mapped at a time (a multiple of _BLOCK and of the page size)
_WORD = np.dtype("<u8")
# name (relative to the checkpoint directory, "/"-separated)
#   -> {"bytes": n, "xxh3_128" (or "wsum64"): hex, "rank": the rank that wrote it}
FileTable = dict[str, dict[str, Any]]


def file_entry(file: Path) -> dict[str, Any]:
    """``{"bytes": size, "xxh3_128": digest}`` of one file, mapped a window at a time."""
    digest = xxhash.xxh3_128()
    with open_regular(file) as stream:
        size = os.fstat(stream.fileno()).st_size
        for offset in range(0, size, _WINDOW):
            length = min(_WINDOW, size - offset)
            with mmap.mmap(stream.fileno(), length, offset=offset, access=mmap.ACCESS_READ) as view:
                digest.update(view)
    return {"bytes": size, ALGORITHM: digest.hexdigest()}


def _wsum64(file: Path) -> str:
    """Format 2's checksum of one file (see the module's docstring)."""
    total = weighted = 0
    blocks = 0
    with open_regular(file) as stream:
        size = os.fstat(stream.fileno()).st_size
        for offset in range(0, size, _WINDOW):
            length = min(_WINDOW, size - offset)
            whole = length - length % _BLOCK
            sums = np.zeros(-(-length // _BLOCK), dtype=np.uint64)
            if whole:
                with mmap.mmap(
                    stream.fileno(), whole, offset=offset, access=mmap.ACCESS_READ
                ) as mapped:
                    words = np.frombuffer(mapped, dtype=_WORD).reshape(-1, _BLOCK // 8)
                    sums[: len(words)] = words.sum(axis=1, dtype=np.uint64)
                    del words  # the map closes only once no array refers to it
            if whole < length:  # the last block, padded with zeros
                stream.seek(offset + whole)
                tail = stream.read(length - whole)
                padded = tail + bytes(-len(tail) % 8)
                sums[-1] = np.frombuffer(padded, dtype=_WORD).sum(dtype=np.uint64)
            index = np.arange(blocks + 1, blocks + 1 + len(sums), dtype=np.uint64)
            total += int(sums.sum(dtype=np.uint64))
            weighted += int((sums * index).sum(dtype=np.uint64))
            blocks += len(sums)
    mask = (1 << 64) - 1
    return f"{total & mask:016x}{weighted & mask:016x}"


def hash_files(root: Path, names: Iterable[str]) -> FileTable:
    """The entries of ``names`` (paths relative to ``root``)."""
    return {name: file_entry(root / name) for name in sorted(names)}


class HashingWriter(FileSystemWriter):
    """DCP's file writer that also records the size and checksum of every file this rank wrote.

    The checksums are computed in a thread once DCP has written this rank's files, while DCP
    gathers the plans' results and writes its metadata (time a rank mostly spends waiting for
    the others); :attr:`files` waits for them.

    DCP may call :meth:`write_data` from a thread of its own (a background save), where the
    current CUDA device is 0 whatever the rank: DCP's copying loader takes that device's
    current stream. The writer enters ``device`` (this rank's) around the write. A state
    staged on the host (``host_only``) is written without DCP's device loader at all.

    Args:
        path: The directory written.
        device: This rank's device (the model's); ``None`` or CPU: nothing to enter.
        host_only: Every tensor written is already in host memory (a staged state).
    """

    def __init__(
        self, path: Path, *, device: torch.device | None = None, host_only: bool = False
    ) -> None:
        # per_thread_copy_ahead=0 makes DCP copy with its serial loader, which leaves host
        # tensors as they are and touches no device stream.
        super().__init__(str(path), per_thread_copy_ahead=0 if host_only else 10_000_000)
        self.root = path
        self.device = device
        self._files: concurrent.futures.Future[FileTable] | None = None

    @property
    def files(self) -> FileTable:
        """The entries of the data files this rank wrote (waits for their checksums).

        Raises:
            OSError: If a file could not be read back.
        """
        return {} if self._files is None else self._files.result()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's files (DCP), then start summing them while in the page cache."""
        with on_device(self.device):  # DCP's thread: this rank's device, not device 0
            written = super().write_data(plan, planner)
        results = written.wait()
        names = {
            str(result.storage_data.relative_path)
            for result in results
            if getattr(result.storage_data, "relative_path", None) is not None
        }
        self._files = _SUMMING.submit(hash_files, self.root, names)
        return written


# One thread sums the files of the save in progress (one save at a time per process).
_SUMMING = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-sum")


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
        file = inside(root, name, source=str(root / "checkpoint.json"))
        size = file.stat().st_size if file.is_file() else -1
        if size != int(entry["bytes"]):
            found = "missing" if size < 0 else f"{size} bytes, {entry['bytes']} were written"
            raise CheckpointError(
                f"the checkpoint is truncated or corrupt: {name} is {found}; save it again "
                "(or restore it from a copy)"
            )


def check_digests(root: Path, files: Mapping[str, Mapping[str, Any]], names: list[str]) -> None:
    """The files ``names`` have the checksums recorded in ``files``.

    Raises:
        CheckpointError: Naming the first file whose content differs.
    """
    for name in names:
        file = inside(root, name, source=str(root / "checkpoint.json"))
        entry = files[name]
        if ALGORITHM in entry:
            expected, found = entry[ALGORITHM], file_entry(file)[ALGORITHM]
        else:  # format 2
            expected, found = entry[LEGACY], _wsum64(file)
        if found != expected:
            raise CheckpointError(
                f"verification failed for {str(root)!r}: {name} has checksum {found}, the "
                f"checkpoint recorded {expected}; the file was changed or damaged after "
                "saving. Nothing was loaded"
            )
