"""DCP's tensor records decoded as views of the bytes read: a load's fast path, no copy.

A record is one ``torch.save`` zip. Its central directory is read here (every member stored
and inside the record); its pickle must name only a dense tensor's globals; torch's own
``weights_only`` unpickler rebuilds the tensor over a view of the member's bytes. Anything
else goes to :func:`checkpoint_io._format.values.load_value` (``torch.load``'s path).
"""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
from collections.abc import Iterator
from typing import Any

import torch

from checkpoint_io._errors import CheckpointError, first_line
from checkpoint_io._format.archive import stored_members
from checkpoint_io._format.metadata import DTYPE_NAMES
from checkpoint_io._format.pickles import class_called, pickle_globals


@contextlib.contextmanager
def zip_crc32(enabled: bool) -> Iterator[None]:
    """Whether ``torch.save`` computes each zip member's CRC32, inside; as found after.

    A tensor record is written without it where a rank waits on the write: it costs about
    16 ms per 75 MB here (4.7 GB/s), four times the record's digest that checkpoint-io
    records, and nothing checks it (``torch.load``, with ``mmap`` or not, and DCP's reader
    ignore it: a flipped byte loads silently; a verified load checks the digest). Values,
    RNG and stateful files keep it, so that a reader that checks it (:mod:`zipfile`,
    checkpoint-io before 2026-12) reads them. No reader here needs it (:func:`tensor_record`,
    :func:`checkpoint_io._format.values.load_value`).

    Nothing is done when the option already is ``enabled``. torch's option is the process's
    up to torch 2.12 (a ``torch.save`` in another thread meanwhile follows it too) and the
    thread's from torch 2.13 (DCP's writer threads, were ``thread_count`` above 1, would
    compute it). It is set back as found, unless it no longer reads as set here (another
    thread set it back meanwhile: that thread's choice stands).
    """
    before = torch.serialization.get_crc32_options()
    if before == enabled:
        yield
        return
    torch.serialization.set_crc32_options(enabled)
    try:
        yield
    finally:
        if torch.serialization.get_crc32_options() == enabled:
            torch.serialization.set_crc32_options(before)


def tensor_record(data: memoryview, what: str) -> torch.Tensor | None:
    """The tensor of one DCP tensor record, a view of ``data`` (no copy), or ``None``.

    The fast path of a load: the record's zip directory is read from its central directory
    (every member stored, inside the record), its pickle must name only the globals of a
    dense tensor record (:data:`_TENSOR_GLOBALS`, storage classes, dtypes) and is unpickled
    by torch's own ``weights_only`` unpickler, and the storage it names is a view
    of the member's bytes in ``data``, checked to be exactly the size the pickle declares.
    The caller copies out of the view before ``data`` is reused. ``None`` sends anything
    unusual (zip64, another byte order, a sparse, quantized or device-bound rebuild) to
    :func:`load_value` (``torch.load``'s own path and its checks), which reads it or refuses
    it with the reason.

    Raises:
        CheckpointError: Naming ``what`` when the pickle is refused by torch's unpickler or
            a storage does not match its member.
    """
    members = stored_members(data)
    if members is None or any(name != name.lower() for name in members):
        return None  # torch finds members ignoring case: its own path reads such a record
    prefix = next(iter(members), "").partition("/")[0] + "/"  # torch's: the first member's
    pickles = [name for name in members if name.endswith("/data.pkl")]
    if pickles != [f"{prefix}data.pkl"]:
        return None
    order = members.get(f"{prefix}byteorder")
    if order is not None and bytes(data[order[0] : order[0] + order[1]]) != b"little":
        return None
    start, size = members[pickles[0]]
    pickled = bytes(data[start : start + size])
    if not _plain_tensor_pickle(pickled):
        return None
    storages: dict[str, Any] = {}
    sizes: dict[str, tuple[Any, int]] = {}  # each storage's bytes, and how many it had

    def storage(saved_id: Any) -> Any:
        _, kind, key, _location, numel = saved_id  # the location is ignored: read to the CPU
        dtype = torch.uint8 if kind is torch.UntypedStorage else kind.dtype
        if key not in storages:
            found = members.get(f"{prefix}data/{key}")
            nbytes = int(numel) * dtype.itemsize
            if found is None or found[1] != nbytes:
                raise pickle.UnpicklingError(
                    f"storage {key!r} needs {nbytes} bytes, its member has "
                    f"{None if found is None else found[1]}"
                )
            raw = (  # frombuffer refuses an empty buffer (an empty FSDP shard)
                torch.frombuffer(data[found[0] : found[0] + nbytes], dtype=torch.uint8)
                if nbytes
                else torch.empty(0, dtype=torch.uint8)
            )
            if raw.data_ptr() % dtype.itemsize:  # a writer without torch's 64-byte alignment
                raw = raw.clone()
            sizes[key] = (raw.untyped_storage(), nbytes)
            storages[key] = torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
                wrap_storage=raw.untyped_storage(), dtype=dtype, _internal=True
            )
        return storages[key]

    try:
        # torch.load's own weights_only unpickler (what DCP decodes records with), given a
        # storage loader that views the record instead of copying it.
        unpickler = torch._weights_only_unpickler.Unpickler(io.BytesIO(pickled), encoding="utf-8")
        unpickler.persistent_load = storage  # type: ignore[method-assign]
        value = unpickler.load()  # type: ignore[no-untyped-call]
    except Exception as error:
        raise CheckpointError(
            f"{what} was refused or is corrupt ({first_line(error)}). Nothing was loaded"
        ) from None
    if type(value) is not torch.Tensor or value.layout != torch.strided or value.is_sparse:
        raise CheckpointError(f"{what} is not a dense tensor record; the checkpoint is corrupt")
    grown = [key for key, (kept, nbytes) in sizes.items() if kept.nbytes() != nbytes]
    if grown:  # torch's own storages cannot grow: it refuses such a record
        raise CheckpointError(
            f"{what} asks for more than its storage {grown[0]!r} holds ({sizes[grown[0]][1]} "
            "bytes); the checkpoint is corrupt or crafted. Nothing was loaded"
        )
    return value


_TENSOR_GLOBALS = frozenset(
    {
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_tensor_v3"),
        ("collections", "OrderedDict"),
        ("torch.storage", "UntypedStorage"),
    }
)
"""The globals of a dense tensor record as DCP writes it (besides torch's storage classes and
dtypes): anything else (a sparse, quantized or device-bound rebuild) takes the slow path,
``torch.load``'s own, with its checks."""


_PLAIN_PICKLE_BYTES = 4096
"""The most a dense tensor record's pickle holds (about 250 bytes, 8 more per dimension);
a longer one takes the slow path."""


def _plain_tensor_pickle(pickled: bytes) -> bool:
    """Whether a record's pickle names only the globals of a dense CPU tensor record.

    Kept per pickle: DCP writes each tensor as a record of its own, storage ``'0'``, so the
    records of tensors alike in shape and dtype (a weight, its Adam moments) have one pickle,
    and a model has few; scanning each record's pickle took a fifth of a 2-rank DDP load.
    """
    return len(pickled) <= _PLAIN_PICKLE_BYTES and _scanned_plain(pickled)


@functools.lru_cache(maxsize=512)
def _scanned_plain(pickled: bytes) -> bool:
    try:
        named = all(g is not None and _tensor_global(*g) for g in pickle_globals(pickled))
        return named and class_called(pickled) is None
    except Exception:  # malformed: the slow path refuses it with torch's reason
        return False


def _tensor_global(module: str, name: str) -> bool:
    if (module, name) in _TENSOR_GLOBALS:
        return True
    return module == "torch" and (name.endswith("Storage") or name in DTYPE_NAMES)
