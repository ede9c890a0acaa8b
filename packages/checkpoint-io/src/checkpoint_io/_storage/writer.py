"""DCP's storage writer of format 4: the only code of a save that knows bytes.

Each rank streams the tensors DCP planned for it into one ``rank<r>.safetensors``, hashed as
written; its ``__metadata__`` holds DCP's sharding offsets (torch's ``HuggingFaceStorageReader``
reads it). Values that are not tensors reach the coordinator as JSON in the write results and
land in ``index.json`` with DCP's index.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from checkpoint_io._storage.index import Record, Value, encode_index
from checkpoint_io._storage.manifest import INDEX_FILE, FileTable
from dist_core import fsync_file, on_device
from safe_store import StreamWriter

# A write result that no state key has: a chunk's offsets are never negative.
_TABLE = MetadataIndex("checkpoint_io.file_table", offset=(-1,))


def data_file(rank: int) -> str:
    """The data file DCP's tensors of ``rank`` go to, relative to the checkpoint."""
    return f"rank{rank}.safetensors"


def write_tensors_file(
    file: Path, tensors: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str]
) -> dict[str, Any]:
    """One safetensors file of ``tensors``, flushed; its table entry (size, digests)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    writer = StreamWriter(file, [(n, t.dtype, tuple(t.shape)) for n, t in tensors], metadata)
    try:
        for name, tensor in tensors:
            writer.write(name, tensor)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


class SafeWriter(StorageWriter):
    """DCP's writer of format 4 into ``partial``, publishing it when DCP commits.

    DCP may call :meth:`write_data` from a thread of its own (a background save), where the
    current CUDA device is 0 whatever the rank: the writer enters ``device`` around it.

    Args:
        partial: The temporary directory the ranks agreed on.
        side_files: Writes this rank's RNG and stateful files there; their table entries.
        publish: Publishes the checkpoint on the coordinator, given every rank's file table.
        device: This rank's device; ``None`` or CPU: nothing to enter.
    """

    def __init__(
        self,
        partial: Path,
        side_files: Callable[[Path], FileTable],
        publish: Callable[[list[FileTable]], None],
        *,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.partial = partial
        self.device = device
        self._side_files = side_files
        self._publish = publish

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing kept between saves."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Any path: the ranks agreed on it before DCP began."""
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up (the directory was agreed before DCP began)."""

    def storage_meta(self) -> None:
        """No storage metadata: ``index.json`` holds what a reader needs."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """DCP's plan as it is."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: each rank's plan names its data file."""
        return [
            dataclasses.replace(plan, storage_data=data_file(rank))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's files; their table goes to the coordinator with the results.

        Raises:
            OSError, ValueError: If a file could not be written (DCP raises it everywhere).
        """
        file, root = str(plan.storage_data), self.partial
        done: Future[list[WriteResult]] = Future()
        root.mkdir(parents=True, exist_ok=True)  # on every rank: a node-local disk needs it
        table = self._side_files(root)
        tensors = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        results: list[WriteResult] = []
        with on_device(self.device):  # DCP's thread: this rank's device, not device 0
            if tensors:
                offsets = {i.index.fqn: list(i.tensor_data.chunk.offsets) for i in tensors}  # type: ignore[union-attr]
                sharding = {fqn: {"saved_offsets": at} for fqn, at in offsets.items()}
                writer = StreamWriter(
                    root / file,
                    [
                        (
                            item.index.fqn,
                            item.tensor_data.properties.dtype,  # type: ignore[union-attr]
                            tuple(item.tensor_data.chunk.sizes),  # type: ignore[union-attr]
                        )
                        for item in tensors
                    ],
                    {
                        "format": "pt",
                        "DCP_SHARDING_INFO": json.dumps(sharding),
                        "DCP_VERSION": "1.0",
                    },
                )
                try:
                    for item in tensors:
                        tensor = planner.resolve_data(item)
                        offset, length = writer.write(item.index.fqn, tensor)  # type: ignore[arg-type]
                        record = Record(file, offset, length)
                        results.append(WriteResult(item.index, length, record))
                except BaseException:
                    writer.abort()
                    raise
                table[file] = writer.close()
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                text = planner.resolve_data(item).getvalue().decode()  # type: ignore[union-attr]
                results.append(WriteResult(item.index, 0, Value(text)))
        done.set_result([*results, WriteResult(_TABLE, 0, table)])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: ``index.json``, then ``publish`` with every rank's file table."""
        tables: list[FileTable] = []
        where: dict[MetadataIndex, Any] = {}
        for each in results:
            tables.append(next((r.storage_data for r in each if r.index == _TABLE), {}))
            where.update({r.index: r.storage_data for r in each if r.index != _TABLE})
        index = self.partial / INDEX_FILE
        index.write_bytes(encode_index(metadata, where))
        fsync_file(index)
        self._publish(tables)
