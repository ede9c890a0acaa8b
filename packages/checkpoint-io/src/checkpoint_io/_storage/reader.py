"""DCP's storage reader of format 4: the only code of a load that knows bytes.

Each data file is read once, in file order, through :class:`CheckpointFiles` (its safetensors
header checked, each record one of its tensors' bytes, verified before it is decoded); a
record is viewed as its tensor without a copy (``torch.frombuffer`` over the bytes read),
narrowed to the slice asked for and copied into the planner's target (a load's staging). A
value that is not a tensor comes from the index, as JSON, to the planner's ``load_bytes``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from checkpoint_io._errors import CheckpointError, shown
from checkpoint_io._storage.files import CheckpointFiles
from checkpoint_io._storage.index import Record, Value


class SafeReader(StorageReader):
    """DCP's storage reader over a checkpoint's checked files and index.

    Args:
        files: The checkpoint's files.
        metadata: Its index, read and checked by :func:`read_checked`.
        after_read: Checks what this rank read, once it is all read: what it raises, DCP
            raises on every rank (in the collective that ends its read, with no other).
    """

    def __init__(
        self,
        files: CheckpointFiles,
        metadata: Metadata,
        after_read: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.files = files
        self._metadata = metadata
        self._after_read = after_read

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing kept between loads."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Any path: the files were opened already."""
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The index already read and checked (no second read)."""
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Nothing to set up: the index was checked when it was read."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """DCP's plan as it is."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """DCP's plans as they are."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan``: each file once, each record once."""
        storage = self._metadata.storage_data
        per_file: dict[str, dict[tuple[int, int], list[ReadItem]]] = {}
        for item in plan.items:
            info = storage[item.storage_index]
            if isinstance(info, Value):
                planner.load_bytes(item, io.BytesIO(info.text.encode()))
                continue
            assert isinstance(info, Record)  # decode_index makes nothing else
            span = (info.offset, info.length)
            per_file.setdefault(info.file, {}).setdefault(span, []).append(item)
        for name, records in sorted(per_file.items()):
            spans = list(records)

            def each(index: int, data: memoryview, name: str = name, spans: Any = spans) -> None:
                for item in per_file[name][spans[index]]:
                    self._deliver(item, data, planner, f"{name} at byte {spans[index][0]}")

            self.files.read_records(name, spans, each)
        if self._after_read is not None:
            self._after_read()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _deliver(self, item: ReadItem, data: memoryview, planner: LoadPlanner, where: str) -> None:
        """View one record as its chunk, narrow it, copy it into the planner's target."""
        entry = self._metadata.state_dict_metadata[item.storage_index.fqn]
        what = f"the checkpoint's tensor {shown(item.dest_index.fqn)} ({where})"
        if item.type != LoadItemType.TENSOR or not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{what} is not a tensor in the index; the checkpoint is corrupt")
        sizes = next(c.sizes for c in entry.chunks if c.offsets == item.storage_index.offset)
        dtype = entry.properties.dtype
        tensor = (
            torch.frombuffer(data, dtype=dtype).view(sizes)
            if len(data)
            else torch.empty(sizes, dtype=dtype)
        )  # a view of the record: no copy
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointError(
                f"{what} has shape {tuple(tensor.shape)} where the load needs "
                f"{tuple(target.shape)}; the checkpoint is corrupt"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)
