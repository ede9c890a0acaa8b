"""DCP's storage reader of format 4: the only code of a load that knows bytes.

Each data file is read once, in file order, through :class:`CheckpointFiles`; a whole record
is read straight into its target, any other is viewed without a copy and narrowed into it.
A value that is not a tensor comes from the index, as JSON, to the planner's ``load_bytes``.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from checkpoint_io import _compat
from checkpoint_io._errors import CheckpointError, shown
from checkpoint_io._storage.files import CheckpointFiles
from checkpoint_io._storage.index import Record, Value


def read_into(
    state: dict[str, Any],
    files: CheckpointFiles,
    metadata: Metadata,
    planner: LoadPlanner,
    what: str,
) -> None:
    """DCP's load of ``state`` from the checkpoint, in this process (no collective).

    Raises:
        CheckpointError: A refusal as itself; any other failure of the read (a file cut
            short or changed under the load) as one naming ``what``.
    """
    try:
        _compat.load_in_process(state, SafeReader(files, metadata), planner)
    except (Exception, _compat.CheckpointException) as error:  # the latter: a BaseException
        refused = _refusal(error)
        if refused is not None:
            raise refused from None
        first = next(iter(_compat.rank_failures(error).values()), error)  # the lowest rank's
        if not isinstance(first, Exception):  # KeyboardInterrupt, SystemExit: as themselves
            raise first from None
        last = (str(first).strip().splitlines() or [""])[-1]
        raise CheckpointError(
            f"reading {what} failed: the checkpoint is truncated or corrupt "
            f"({type(first).__name__}: {last}); nothing was loaded"
        ) from None


def _refusal(error: BaseException) -> CheckpointError | None:
    """The :class:`CheckpointError` inside a DCP failure (DCP wraps what its steps raise)."""
    if isinstance(error, CheckpointError):
        return error
    for found in _compat.rank_failures(error).values():
        if isinstance(found, CheckpointError):
            return found
    cause = error.__cause__ or error.__context__
    return _refusal(cause) if cause is not None else None


class SafeReader(StorageReader):
    """DCP's storage reader over a checkpoint's checked files and index.

    Args:
        files: The checkpoint's files.
        metadata: Its index, read and checked by :func:`read_checked`.
    """

    def __init__(self, files: CheckpointFiles, metadata: Metadata) -> None:
        super().__init__()
        self.files = files
        self._metadata = metadata

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
            self._read_file(name, records, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(
        self, name: str, records: dict[tuple[int, int], list[ReadItem]], planner: LoadPlanner
    ) -> None:
        """Read data file ``name``'s records, each into its target (straight, or copied)."""
        spans = list(records)
        direct = [self._direct(records[span], span[1], planner) for span in spans]

        def each(index: int, data: memoryview) -> None:
            target, items = direct[index], records[spans[index]]
            if target is not None:  # read straight into its one target
                planner.commit_tensor(items[0], target)
                return
            for item in items:
                self._deliver(item, data, planner, f"{name} at byte {spans[index][0]}")

        def into(index: int) -> Any:
            target = direct[index]
            return None if target is None else target.reshape(-1).view(torch.uint8).numpy()

        self.files.read_records(name, spans, each, into)

    def _direct(
        self, items: list[ReadItem], length: int, planner: LoadPlanner
    ) -> torch.Tensor | None:
        """The target a record is read straight into, or ``None`` (read, then copied)."""
        # NOTE: only a whole chunk into a contiguous host tensor of its dtype and size: the
        # bytes hashed are then the target's own, and nothing is copied. A device target (a
        # CUDA staging) or a resharded slice takes the copy.
        if len(items) != 1 or items[0].type != LoadItemType.TENSOR:
            return None
        item = items[0]
        entry = self._metadata.state_dict_metadata[item.storage_index.fqn]
        if not isinstance(entry, TensorStorageMetadata) or any(item.storage_offsets):
            return None
        sizes = next(c.sizes for c in entry.chunks if c.offsets == item.storage_index.offset)
        target = planner.resolve_tensor(item).detach()
        whole = tuple(item.lengths) == tuple(sizes) == tuple(target.shape)
        if (
            whole
            and type(target) is torch.Tensor  # no wrapper subclass: its bytes are its own
            and target.device.type == "cpu"
            and target.dtype == entry.properties.dtype
            and target.is_contiguous()
            and target.numel() * target.element_size() == length
        ):
            return target
        return None

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
