"""DCP's storage reader over the one read path: records decoded within their bounds, into staging.

Each data file is read once, in file order, through :class:`CheckpointFiles`; each tensor
record is decoded as a view of the bytes read (:func:`tensor_record`, no copy) or, when
unusual, by :func:`load_value`; each is narrowed to the slice asked for and copied into the
planner's target (a load's staging).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from checkpoint_io._errors import CheckpointError
from checkpoint_io._format.records import tensor_record
from checkpoint_io._format.values import load_value
from checkpoint_io._read.files import CheckpointFiles


class VerifyingReader(FileSystemReader):
    """DCP's storage reader, reading through :class:`CheckpointFiles`.

    Each data file is read once in file order; each record is decoded ``weights_only`` within
    its recorded length; each tensor is narrowed to the slice asked for and copied into the
    planner's target (staging, for a load).

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
        super().__init__(str(files.root))
        self.files = files
        self._metadata = metadata
        self._after_read = after_read

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The index already read and checked (no second read)."""
        meta = self._metadata.storage_meta
        if meta is None:
            meta = self._metadata.storage_meta = StorageMeta()
        meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan``: each file once, each record once."""
        per_file: dict[str, dict[tuple[int, int], list[ReadItem]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            span = (int(info.offset), int(info.length))
            per_file.setdefault(str(info.relative_path), {}).setdefault(span, []).append(item)
        for name, records in sorted(per_file.items()):
            spans = list(records)

            def each(index: int, data: memoryview, name: str = name, spans: Any = spans) -> None:
                for item in per_file[name][spans[index]]:
                    _deliver(item, data, planner, f"{name} at byte {spans[index][0]}")

            self.files.read_records(name, spans, each)
        if self._after_read is not None:
            self._after_read()
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _deliver(item: ReadItem, data: memoryview, planner: LoadPlanner, where: str) -> None:
    """Decode one record for ``item`` and hand it to the planner (copied out of ``data``)."""
    what = f"the checkpoint's value {item.dest_index.fqn!r} ({where})"
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(data))
        return
    tensor = tensor_record(data, what)  # a view of the record: no copy
    if tensor is None:  # anything unusual: read (or refused) like any value
        tensor = load_value(bytes(data), what, "cpu")
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"{what} is not a tensor record; the checkpoint is corrupt")
    try:
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            tensor = tensor.narrow(dim, start, length)
    except (RuntimeError, IndexError, ValueError) as error:
        raise CheckpointError(
            f"{what} is smaller than its index entry ({error}); the checkpoint is corrupt"
        ) from None
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise CheckpointError(
            f"{what} has shape {tuple(tensor.shape)} where the index gives "
            f"{tuple(target.shape)}; the checkpoint is corrupt"
        )
    target.copy_(tensor)
    planner.commit_tensor(item, target)
