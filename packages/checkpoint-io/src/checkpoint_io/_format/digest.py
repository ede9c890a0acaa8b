"""Per-file digests: each rank hashes the files it writes; a reader, the bytes it reads.

No tensor is gathered to check a checkpoint: the manifest records every file's size and
digest, each rank computes those of the files it wrote (O(model / world)), and a verified
read (:mod:`checkpoint_io._read.files`) hashes the very bytes it decodes (:class:`Digest`).

The digest is xxHash's XXH3-128 (the ``xxhash`` package), built for speed and for damage,
not for tampering (a checkpoint from an untrusted source is safe to read for other reasons:
:mod:`checkpoint_io._format.metadata`, :mod:`checkpoint_io._format.values`): about 20 GB/s on
one core here, where sha256 runs at 1.1 GB/s. A writer maps the file (no copy out of the page
cache) and hashes it a window at a time. A flipped bit, swapped words, a zeroed, stale or
truncated page: each changes it (the size is checked as well).

Checkpoints of format 2 recorded ``wsum64`` (sums of 64-bit words per 64 KiB block and a
position-weighted sum of the blocks' sums, modulo 2**64): still verified with it.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from checkpoint_io._errors import CheckpointError, open_regular
from checkpoint_io._format.metadata import inside

ALGORITHM = "xxh3_128"
"""The digest new checkpoints record (manifest format 3)."""


RECORDS = "records"
"""A data file's entry: ``[offset, length, digest]`` of each record (xxh3-128)."""
LEGACY = "wsum64"
"""The checksum of format 2, still verified."""


_BLOCK = 64 << 10  # wsum64: bytes summed together; the blocks' sums are weighted by position


_WINDOW = 256 << 20  # bytes mapped at a time (a multiple of _BLOCK and of the page size)
_PIECE = 256 << 10  # bytes hashed into a record's digest and the file's while in the cache

Spans = list[tuple[int, int]]  # (offset, length) of a data file's records, by offset


_WORD = np.dtype("<u8")
_SHARED = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # prefaulted by the kernel


# name (relative to the checkpoint directory, "/"-separated)
#   -> {"bytes": n, "xxh3_128" (or "wsum64"): hex, "rank": the rank that wrote it}
FileTable = dict[str, dict[str, Any]]


def file_entry(file: Path, records: Iterable[tuple[int, int]] = ()) -> dict[str, Any]:
    """``{"bytes": size, "xxh3_128": digest}`` of one file, and its records' digests.

    One pass: the file is mapped a window at a time (prefaulted, no copy out of the page
    cache), each window stretched to the end of the last record that starts in it, so that
    the file's digest and every record's come from the same mapping, each byte read from
    memory once.

    Args:
        file: The file.
        records: ``(offset, length)`` of the records a DCP data file holds: each gets its own
            digest under ``"records"`` (``[offset, length, digest]``, by offset), so that a
            rank reading a few records of a file checks those bytes alone.
    """
    spans = sorted(set(records))
    digest = xxhash.xxh3_128()
    found: list[list[Any]] = []
    with open_regular(file) as stream:
        size = os.fstat(stream.fileno()).st_size
        start = first = 0
        while start < size:
            end, last = min(size, start + _WINDOW), first
            while last < len(spans) and spans[last][0] < end:
                end = max(end, min(size, sum(spans[last])))
                last += 1
            base = start - start % mmap.ALLOCATIONGRANULARITY
            with (
                mmap.mmap(
                    stream.fileno(), end - base, flags=_SHARED, prot=mmap.PROT_READ, offset=base
                ) as mapped,
                memoryview(mapped) as view,
            ):
                found += _hash_window(view, base, start, end, spans[first:last], digest)
            start, first = end, last
    entry: dict[str, Any] = {"bytes": size, ALGORITHM: digest.hexdigest()}
    if spans:
        entry[RECORDS] = found
    return entry


def _hash_window(
    view: memoryview, base: int, start: int, end: int, spans: Spans, digest: Any
) -> list[list[Any]]:
    """Feed ``[start, end)`` of the file (mapped from ``base``) to ``digest``; the records'.

    Each byte is read from memory once: a record is hashed a piece at a time into its own
    digest and the file's while the piece is in the cache. A record that overlaps the one
    before (never written so by DCP) is hashed on its own; one past the end has no digest.
    """
    found: list[list[Any]] = []
    position = start
    for offset, length in spans:
        stop = offset + length
        if stop > end:
            continue
        if offset < position:
            with view[offset - base : stop - base] as part:
                found.append([offset, length, record_digest(part)])
            continue
        _feed(view, base, position, offset, digest)
        record = xxhash.xxh3_128()
        _feed(view, base, offset, stop, digest, record)
        found.append([offset, length, str(record.hexdigest())])
        position = stop
    _feed(view, base, position, end, digest)
    return found


def _feed(view: memoryview, base: int, start: int, stop: int, *hashers: Any) -> None:
    for at in range(start, stop, _PIECE):
        with view[at - base : min(stop, at + _PIECE) - base] as piece:
            for hasher in hashers:
                hasher.update(piece)


def record_digest(data: bytes | memoryview) -> str:
    """The digest of one record's bytes, as :func:`file_entry` records it."""
    return str(xxhash.xxh3_128(data).hexdigest())


class _Wsum64:
    """Format 2's checksum, fed a piece at a time (see the module's docstring)."""

    def __init__(self) -> None:
        self._pending = b""  # the bytes of a block not yet complete
        self._total = self._weighted = self._blocks = 0

    def update(self, data: bytes | memoryview) -> None:
        """Add the next bytes of the file."""
        view = memoryview(data).cast("B")
        if self._pending:
            taken = _BLOCK - len(self._pending)
            self._pending += bytes(view[:taken])
            view = view[taken:]
            if len(self._pending) < _BLOCK:
                return
            self._add(np.frombuffer(self._pending, dtype=_WORD).sum(dtype=np.uint64).reshape(1))
            self._pending = b""
        whole = len(view) - len(view) % _BLOCK
        if whole:
            words = np.frombuffer(view[:whole], dtype=_WORD).reshape(-1, _BLOCK // 8)
            self._add(words.sum(axis=1, dtype=np.uint64))
        self._pending = bytes(view[whole:])

    def _add(self, sums: np.ndarray[Any, Any]) -> None:
        index = np.arange(self._blocks + 1, self._blocks + 1 + len(sums), dtype=np.uint64)
        self._total += int(sums.sum(dtype=np.uint64))
        self._weighted += int((sums * index).sum(dtype=np.uint64))
        self._blocks += len(sums)

    def hexdigest(self) -> str:
        """The checksum of every byte fed so far (the last block padded with zeros)."""
        total, weighted = self._total, self._weighted
        if self._pending:
            padded = self._pending + bytes(-len(self._pending) % 8)
            last = int(np.frombuffer(padded, dtype=_WORD).sum(dtype=np.uint64))
            total += last
            weighted += last * (self._blocks + 1)
        mask = (1 << 64) - 1
        return f"{total & mask:016x}{weighted & mask:016x}"


class Digest:
    """The digest a file table's entry records, computed from the bytes fed to it.

    Args:
        entry: The file's entry in the manifest (``xxh3_128``, or format 2's ``wsum64``).
    """

    def __init__(self, entry: Mapping[str, Any]) -> None:
        self.algorithm = ALGORITHM if ALGORITHM in entry else LEGACY
        self.expected = str(entry.get(self.algorithm))
        self._hasher: Any = xxhash.xxh3_128() if self.algorithm == ALGORITHM else _Wsum64()

    def update(self, data: bytes | memoryview) -> None:
        """Add the next bytes of the file."""
        self._hasher.update(data)

    def found(self) -> str:
        """The digest of the bytes fed so far."""
        return str(self._hasher.hexdigest())


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
