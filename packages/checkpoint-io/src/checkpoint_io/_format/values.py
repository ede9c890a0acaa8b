"""Values read ``weights_only`` and bounded by their own bytes; values written so."""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import zipfile
from typing import Any

import torch

from checkpoint_io._errors import CheckpointError, first_line
from checkpoint_io._format.metadata import DTYPE_NAMES


def load_value(
    data: io.BytesIO | bytes, what: str, map_location: Any = None, *, _depth: int = 0
) -> Any:
    """A non-tensor value read ``weights_only`` (tensors, containers and primitives only).

    A byte buffer inside it (the optimizer's parameter groups are one) is read in turn, one
    level deep: a buffer inside a buffer is refused (K buffers nested D deep made K^D loads,
    minutes for a 7.9 KB file).

    Raises:
        CheckpointError: Naming ``what`` when the value holds anything else (refused as
            unsafe) or cannot be read.
    """
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        problem = _unbounded(stream.getvalue())
        if problem is not None:
            raise CheckpointError(
                f"{what} was refused as unsafe: it holds {problem}, which can make a few bytes "
                "read as gigabytes. Nothing was loaded"
            )
        # io.BytesIO is admitted: the optimizer's parameter groups are stored as one (its
        # bytes are read weights_only in turn, below); rebuilding one runs nothing.
        with torch.serialization.safe_globals([io.BytesIO]):
            value = torch.load(stream, weights_only=True, map_location=map_location)
        _check_buffers(value, what, _depth)
        return value
    except CheckpointError:
        raise
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{what} was refused as unsafe: it holds something other than tensors, containers "
            f"and plain values, which reading could run ({first_line(error)}). Nothing was "
            "loaded"
        ) from None
    except Exception as error:
        raise CheckpointError(f"{what} cannot be read ({type(error).__name__}: {error})") from None


_REFUSED_GLOBALS = {("builtins", "bytearray"), ("__builtin__", "bytearray")}
"""Admitted by torch's ``weights_only`` unpickler, refused here: ``bytearray(n)`` makes ``n``
bytes out of a few (a 656-byte stateful file loaded at 1.8 GB)."""


def _unbounded(data: bytes) -> str | None:
    """What in a ``torch.save`` payload could expand beyond its own size, or ``None``.

    torch writes an uncompressed zip: a compressed member (about 1,000:1 with deflate) or a
    pickle that builds a ``bytearray`` is refused, as is anything that is not such a zip.
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError):
        return "data that is not torch.save's format (an uncompressed zip)"
    for member in members:
        if member.compress_type != zipfile.ZIP_STORED:
            return f"a compressed record ({member.filename})"
    for member in members:
        if member.filename.endswith("data.pkl"):
            found = _refused_global(archive.read(member))
            if found is not None:
                return found
    return None


def _refused_global(pickled: bytes) -> str | None:
    """The first refused global a pickle names (``GLOBAL`` or ``STACK_GLOBAL``), or ``None``."""
    strings: list[str] = []
    try:
        for opcode, arg, _ in pickletools.genops(pickled):
            if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                strings.append(str(arg))
            elif opcode.name == "GLOBAL":
                module, _, name = str(arg).partition(" ")
                if (module, name) in _REFUSED_GLOBALS:
                    return f"a {name}"
            elif opcode.name == "STACK_GLOBAL" and tuple(strings[-2:]) in _REFUSED_GLOBALS:
                return f"a {strings[-1]}"
    except Exception:  # malformed: torch's unpickler refuses it with its own reason
        return None
    return None


def _check_buffers(value: Any, what: str, depth: int = 0) -> None:
    """Every ``BytesIO`` inside ``value`` is a plain one whose bytes read ``weights_only``.

    A pickled ``BytesIO`` may carry an attribute dict (its methods replaced by other values);
    one that does is refused, and the bytes of the others are read as values in turn.
    """
    if isinstance(value, io.BytesIO):
        if type(value) is not io.BytesIO or vars(value):
            raise CheckpointError(
                f"{what} was refused as unsafe: it holds a byte buffer with attributes of its "
                "own. Nothing was loaded"
            )
        if depth >= 1:
            raise CheckpointError(
                f"{what} was refused as unsafe: it holds a byte buffer inside a byte buffer "
                "(a checkpoint nests them one level deep at most). Nothing was loaded"
            )
        position = value.tell()
        load_value(value.getvalue(), what, "cpu", _depth=depth + 1)  # never onto a device
        value.seek(position)
    elif isinstance(value, dict):
        for item in value.values():
            _check_buffers(item, what, depth)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_buffers(item, what, depth)


def safe_bytes(value: Any, what: str) -> bytes:
    """``value`` serialized by ``torch.save``, once it is known to read back ``weights_only``.

    Raises:
        TypeError: Naming ``what`` and the first type that ``weights_only`` refuses.
    """
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        problem = _unbounded(buffer.getvalue())
        if problem is not None:
            raise pickle.UnpicklingError(f"it holds {problem}, which a checkpoint refuses")
        with torch.serialization.safe_globals([io.BytesIO]):
            torch.load(buffer, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        raise TypeError(
            f"{what} holds a value that a checkpoint cannot read back safely "
            f"({first_line(error)}); save tensors, numbers, strings, lists and dicts of them "
            "(convert other objects in state_dict(), or leave it out of stateful=)"
        ) from None
    return buffer.getvalue()


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
    members = _stored_members(data)
    if members is None:
        return None
    pickles = [name for name in members if name.endswith("/data.pkl")]
    if len(pickles) != 1:
        return None
    prefix = pickles[0][: -len("data.pkl")]
    order = members.get(f"{prefix}byteorder")
    if order is not None and bytes(data[order[0] : order[0] + order[1]]) != b"little":
        return None
    start, size = members[pickles[0]]
    pickled = bytes(data[start : start + size])
    if not _plain_tensor_pickle(pickled):
        return None
    storages: dict[str, Any] = {}

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


def _plain_tensor_pickle(pickled: bytes) -> bool:
    """Whether a record's pickle names only the globals of a dense CPU tensor record."""
    strings: list[str] = []
    try:
        for opcode, arg, _ in pickletools.genops(pickled):
            if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                strings.append(str(arg))
            elif opcode.name in ("GLOBAL", "STACK_GLOBAL", "INST", "OBJ"):
                if opcode.name == "GLOBAL":
                    module, _, name = str(arg).partition(" ")
                elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                    module, name = strings[-2], strings[-1]
                else:
                    return False
                if not _tensor_global(module, name):
                    return False
    except Exception:  # malformed: the slow path refuses it with torch's reason
        return False
    return True


def _tensor_global(module: str, name: str) -> bool:
    if (module, name) in _TENSOR_GLOBALS:
        return True
    return module == "torch" and (name.endswith("Storage") or name in DTYPE_NAMES)


_EOCD = struct.Struct("<4s4H2LH")  # end of central directory: 22 bytes
_ENTRY = struct.Struct("<4s6H3L5H2L")  # central directory entry: 46 bytes, then the name
_LOCAL = struct.Struct("<4s5H3L2H")  # local header: 30 bytes, then name and extra
_ZIP64 = 0xFFFFFFFF  # a field saturated: its value is in a zip64 record (count: 0xFFFF)


def _stored_members(data: memoryview) -> dict[str, tuple[int, int]] | None:
    """Name -> (offset, size) of each member of a zip that stores them all, or ``None``.

    Read from the central directory (torch.save writes no comment); every size and offset
    must lie inside ``data``. ``None`` for anything else (zip64, a compressed member).
    """
    if len(data) < _EOCD.size:
        return None
    end = len(data) - _EOCD.size
    sig, _, _, _, count, directory_size, directory, _ = _EOCD.unpack(data[end:])
    if sig != b"PK\x05\x06" or count == 0xFFFF or _ZIP64 in (directory_size, directory):
        return None  # zip64 (a record of 4 GiB or more) and anything else: the slow path
    if directory + directory_size > end:
        return None
    members: dict[str, tuple[int, int]] = {}
    at = directory
    for _ in range(count):
        if at + _ENTRY.size > end:
            return None
        entry = _ENTRY.unpack(data[at : at + _ENTRY.size])
        method, packed, size, name_len, extra_len, comment_len = (
            entry[4],
            entry[8],
            entry[9],
            entry[10],
            entry[11],
            entry[12],
        )
        local = entry[16]
        if entry[0] != b"PK\x01\x02" or _ZIP64 in (packed, size, local):
            return None
        name = bytes(data[at + _ENTRY.size : at + _ENTRY.size + name_len]).decode(
            "utf-8", "replace"
        )
        at += _ENTRY.size + name_len + extra_len + comment_len
        if method != 0 or packed != size or local + _LOCAL.size > directory:
            return None
        header = _LOCAL.unpack(data[local : local + _LOCAL.size])
        begin = local + _LOCAL.size + header[9] + header[10]
        if header[0] != b"PK\x03\x04" or begin + size > directory:
            return None
        members[name] = (begin, size)
    return members
