"""DCP's file writer that records each file's size and digest as it is written."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystem,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint_io._format.digest import FileTable, Spans, file_entry
from checkpoint_io._format.records import zip_crc32
from checkpoint_io._write.claim import ClaimingWriter, SaveClaim
from dist_core import fsync_file, on_device


def hash_files(root: Path, names: Iterable[str]) -> FileTable:
    """The entries of ``names`` (paths relative to ``root``): whole files, no records."""
    return {name: file_entry(root / name) for name in sorted(names)}


class HashingWriter(ClaimingWriter):
    """DCP's file writer that also records the size and checksum of every file this rank wrote.

    Each data file's entry also holds the digest of each record in it (``records``): a
    rank that loads a few records of a file checks them without reading the rest.

    The file tables ride on DCP's own commit: each rank writes its ``side_files`` (flushed
    to the disk in the hashing thread while DCP writes) and its data files, and hands the
    entries to DCP with its write results; the coordinator (rank 0), once DCP has written
    ``.metadata``, calls ``publish`` with every rank's table. A failure there, or on any rank
    before, is raised by DCP on every rank. So a save adds no collective of its own.

    A file is hashed in a thread from the moment DCP has written its last byte and asks for
    it to be flushed to the disk (:class:`_HashingFileSystem`): the hashing reads the page
    cache while the rank waits for the disk, so a save costs little more than DCP's own. A
    file whose records DCP did not write where they were expected (another torch could
    write otherwise) is hashed again once its records are known.

    DCP may call :meth:`write_data` from a thread of its own (a background save), where the
    current CUDA device is 0 whatever the rank: DCP's copying loader takes that device's
    current stream. The writer enters ``device`` (this rank's) around the write. A state
    staged on the host (``host_only``) is written without DCP's device loader at all.

    Where it writes is settled in DCP's planning (:class:`ClaimingWriter`); when a rank
    failed before writing, no rank writes and the coordinator publishes nothing.

    Args:
        claim: The save's claim: the checkpoint directory and what the ranks settle.
        side_files: Writes this rank's other files (RNG, stateful) and returns their names
            (relative to the directory): the writer flushes and hashes them.
        publish: Publishes the checkpoint on the coordinator, given every rank's file table
            (by rank).
        device: This rank's device (the model's); ``None`` or CPU: nothing to enter.
        host_only: Every tensor written is already in host memory (a staged state).
        tensor_crc32: ``torch.save`` computes each tensor record's zip CRC32 (a rank that
            waits on the write does without: :func:`~checkpoint_io._format.records.zip_crc32`).
        written: Called on each rank once all its files are written and hashed.
    """

    def __init__(
        self,
        claim: SaveClaim,
        side_files: Callable[[], list[str]],
        publish: Callable[[list[FileTable]], None],
        *,
        device: torch.device | None = None,
        host_only: bool = False,
        tensor_crc32: bool = True,
        written: Callable[[], None] | None = None,
    ) -> None:
        # per_thread_copy_ahead=0 makes DCP copy with its serial loader, which leaves host
        # tensors as they are and touches no device stream.
        super().__init__(claim, per_thread_copy_ahead=0 if host_only else 10_000_000)
        self.root = claim.target  # the temporary directory once the plans are settled
        self.device = device
        self.host_only = host_only
        self.tensor_crc32 = tensor_crc32
        self.fs: _HashingFileSystem = _HashingFileSystem()
        self._side_files = side_files
        self._publish = publish
        self._written = written

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A staged state (``host_only``) as it is; otherwise DCP's copy to the host.

        torch 2.6's ``dcp.async_save`` stages through its writer.
        """
        return state_dict if self.host_only else super().stage(state_dict)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's files; their table goes to the coordinator with the results.

        Nothing, on every rank, when a rank failed before writing (the claim raises it once
        DCP returns).

        Raises:
            OSError: If a file could not be written or read back (DCP raises it everywhere).
        """
        settled = self.settled_plan(plan)
        done: Future[list[WriteResult]] = Future()
        if settled is None:
            done.set_result([])
            return done
        self.root = Path(self.path)
        names = self._side_files()  # small: flushed and hashed while DCP writes the data
        side = _SUMMING.submit(_flushed, self.root, names)
        try:
            # DCP's thread: this rank's device, not device 0
            with on_device(self.device), zip_crc32(self.tensor_crc32):
                results = super().write_data(settled, planner).wait()
        except BaseException:
            concurrent.futures.wait([side])  # nothing writes once the save has failed
            raise
        table = side.result()
        records: dict[str, Spans] = {}
        for result in results:
            info = result.storage_data
            if getattr(info, "relative_path", None) is not None:
                span = (int(info.offset), int(info.length))
                records.setdefault(str(info.relative_path), []).append(span)
        hashing = {name: self.fs.hashed(self.root / name, spans) for name, spans in records.items()}
        table.update({name: hashing[name].result() for name in sorted(hashing)})
        if self._written is not None:
            self._written()
        done.set_result([*results, WriteResult(index=_TABLE, size_in_bytes=0, storage_data=table)])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's ``.metadata`` (without the file tables), then ``publish`` with them.

        Nothing when a rank failed before writing.
        """
        if self.claim.failed:
            return
        tables: list[FileTable] = []
        for each in results:
            tables.append(next((r.storage_data for r in each if r.index == _TABLE), {}))
            each[:] = [result for result in each if result.index != _TABLE]
        super().finish(metadata, results)
        self._publish(tables)


def _flushed(root: Path, names: list[str]) -> FileTable:
    """Flush ``names`` (under ``root``) to the disk; their entries."""
    for name in names:
        fsync_file(root / name)
    return hash_files(root, names)


# A write result that no state key has: a chunk's offsets are never negative.
_TABLE = MetadataIndex("checkpoint_io.file_table", offset=(-1,))


class _HashingFileSystem(FileSystem):
    """DCP's local file system; each data file it writes is hashed as soon as it is complete.

    DCP asks for the position before and after each record it writes (its offset and
    length) and for the file's descriptor once the last record is written, to flush it to
    the disk: the stream it gets keeps those positions, and the descriptor starts the hash.
    """

    def __init__(self) -> None:
        super().__init__()
        self._started: dict[str, tuple[Spans, concurrent.futures.Future[dict[str, Any]]]] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        """DCP's stream; a data file opened to write is hashed once complete.

        Not ``.metadata`` (written as ``.metadata.tmp``, then renamed): it is small, and rank
        0 hashes it once it is in place, before publishing.
        """
        with super().create_stream(path, mode) as stream:
            data = mode == "wb" and Path(path).suffix == DEFAULT_SUFFIX
            yield _Positions(stream, Path(path), self._start) if data else stream

    def _start(self, path: Path, spans: Spans) -> None:
        future = _SUMMING.submit(file_entry, path, spans)
        with self._lock:
            self._started[os.fspath(path)] = (sorted(spans), future)

    def hashed(self, path: Path, records: Spans) -> concurrent.futures.Future[dict[str, Any]]:
        """The entry of ``path`` with its ``records``' digests (hashed again if needed)."""
        with self._lock:
            spans, future = self._started.pop(os.fspath(path), ([], None))
        if future is not None and spans == sorted(set(records)):
            return future
        return _SUMMING.submit(file_entry, path, records)


class _Positions:
    """A stream DCP writes, keeping the bounds of what was written between positions asked."""

    def __init__(self, stream: Any, path: Path, complete: Callable[[Path, Spans], None]) -> None:
        self._stream = stream
        self._path = path
        self._complete = complete
        self._spans: Spans = []
        self._start = 0

    def tell(self) -> int:
        """The position; what was written since the last call is a record."""
        position = int(self._stream.tell())
        if position != self._start:
            self._spans.append((self._start, position - self._start))
            self._start = position
        return position

    def fileno(self) -> int:
        """The descriptor (DCP wants it to flush the complete file): start the hash."""
        self._stream.flush()
        self._complete(self._path, self._spans)
        return int(self._stream.fileno())

    def __getattr__(self, name: str) -> Any:  # write, flush, close, ...
        return getattr(self._stream, name)


# One thread writes the side files and sums the files of the save in progress (one save at
# a time per process).
_SUMMING = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-sum")
