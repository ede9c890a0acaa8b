"""DCP's file writer that records each file's size and digest as it is written."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint_io._format.digest import FileTable, file_entry
from dist_core import on_device


def hash_files(
    root: Path, names: Iterable[str], records: Mapping[str, list[tuple[int, int]]] | None = None
) -> FileTable:
    """The entries of ``names`` (paths relative to ``root``), with ``records``' digests."""
    spans = records or {}
    return {name: file_entry(root / name, spans.get(name, ())) for name in sorted(names)}


class HashingWriter(FileSystemWriter):
    """DCP's file writer that also records the size and checksum of every file this rank wrote.

    Each data file's entry also holds the digest of each record in it (``records``): a
    rank that loads a few records of a file checks them without reading the rest.

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
        records: dict[str, list[tuple[int, int]]] = {}
        for result in results:
            info = result.storage_data
            if getattr(info, "relative_path", None) is not None:
                span = (int(info.offset), int(info.length))
                records.setdefault(str(info.relative_path), []).append(span)
        self._files = _SUMMING.submit(hash_files, self.root, list(records), records)
        return written


# One thread sums the files of the save in progress (one save at a time per process).
_SUMMING = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-sum")
