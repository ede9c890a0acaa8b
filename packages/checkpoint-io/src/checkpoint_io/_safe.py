"""Reading a checkpoint runs none of its code and reads nothing outside its directory.

torch's DCP reads its ``.metadata`` index with ``pickle.load`` and every non-tensor value with
``torch.load(weights_only=False)``: a checkpoint handed over by someone else (another team, a
hub) could run anything on load. Here ``.metadata`` goes through an unpickler that admits
only DCP's metadata types and the torch types they hold, every non-tensor value is read
``weights_only``, and every file name (the manifest's, DCP's index's) must stay inside the
checkpoint. Anything else is a :class:`CheckpointError` that says it was refused as unsafe,
before anything is changed.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import pickletools
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from checkpoint_io._compat import EmptyStateDictLoadPlanner, set_element
from checkpoint_io._errors import CheckpointError, open_regular

# What DCP's .metadata may hold (module -> names): its own index types and the torch values
# inside them. Nothing here runs code when rebuilt beyond constructing these values.
_ADMITTED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "pathlib._local": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice"}),
}


_DTYPES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))
"""torch's dtypes by name (read from the module's namespace: ``getattr`` would import)."""


class _MetadataUnpickler(pickle._Unpickler):
    """An unpickler that builds DCP's metadata types and torch dtypes, and nothing else.

    The pure-Python unpickler, so that ``BUILD`` can be refused on a class (which would change
    the admitted class for the whole process) and persistent ids refused.
    """

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source
        self._built: dict[int, Any] = {}  # the dataclass instances this unpickling created

    def _load_build(self) -> None:
        # BUILD sets attributes on its target. Only on an instance this unpickling created of
        # an admitted dataclass: on a class, an enum member (_MEM_FORMAT_ENCODING(0)'s
        # _value_ set to 7 broke every later save) or a function (_get_layout's cache), it
        # would change the process.
        target = self.stack[-2] if len(self.stack) > 1 else None
        if isinstance(target, type):
            raise self._refuse(f"a change to the class {target.__module__}.{target.__qualname__}")
        if self._built.get(id(target)) is not target:
            kind = type(target)
            raise self._refuse(
                f"a change to an object it did not create ({kind.__module__}.{kind.__qualname__})"
            )
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _load_build

    def _created(self, handler: Any) -> None:
        handler(self)
        made = self.stack[-1]
        if dataclasses.is_dataclass(made) and not isinstance(made, type | enum.Enum):
            self._built[id(made)] = made

    def _load_newobj(self) -> None:
        self._created(pickle._Unpickler.load_newobj)  # type: ignore[attr-defined]

    def _load_newobj_ex(self) -> None:
        self._created(pickle._Unpickler.load_newobj_ex)  # type: ignore[attr-defined]

    def _load_reduce(self) -> None:
        self._created(pickle._Unpickler.load_reduce)  # type: ignore[attr-defined]

    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.REDUCE[0]] = _load_reduce

    def persistent_load(self, pid: Any) -> Any:
        raise self._refuse("a persistent id")

    def find_class(self, module: str, name: str) -> Any:
        if name in _ADMITTED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and name in _DTYPES:
            return vars(torch)[name]  # a tensor's dtype (torch.float32, ...)
        raise self._refuse(f"{module}.{name}")

    def _refuse(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"{self.source} was refused as unsafe: it would load {what}, which is not part of "
            "a checkpoint's index (DCP's metadata types and torch dtypes); it may run code. "
            "Nothing was loaded; do not use a checkpoint from a source you do not trust"
        )


def read_metadata(path: Path, data: bytes | None = None) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint at ``path``, read without running its code.

    Args:
        path: The checkpoint directory.
        data: The file's bytes, when the caller read (and verified) them; else it is opened
            here.

    Raises:
        CheckpointError: If it holds anything but DCP's metadata types (refused as unsafe),
            or cannot be read.
    """
    file = path / ".metadata"
    try:
        if data is not None:
            metadata = _MetadataUnpickler(io.BytesIO(data), str(file)).load()
        else:
            with open_regular(file) as stream:
                metadata = _MetadataUnpickler(stream, str(file)).load()
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(
            f"{str(path)!r} is damaged: its DCP metadata cannot be read ({type(error).__name__}: "
            f"{error})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{file} was refused as unsafe: it holds a {type(metadata).__name__}, not DCP's "
            "Metadata"
        )
    names = set()
    for info in (metadata.storage_data or {}).values():
        relative, offset, length = (
            getattr(info, k, None) for k in ("relative_path", "offset", "length")
        )
        if type(relative) is not str or not all(
            type(n) is int and n >= 0 for n in (offset, length)
        ):
            raise CheckpointError(
                f"{file} was refused as unsafe: a storage entry is not a file name with a "
                f"non-negative offset and length ({relative!r}, {offset!r}, {length!r})"
            )
        names.add(relative)
    for name in sorted(names):  # a few files, however many tensors they hold
        inside(path, name, source=str(file))
    return metadata


def inside(root: Path, name: str, *, source: str) -> Path:
    """``root / name``, refused unless it stays inside ``root``.

    No absolute path, no ``..``, no symbolic link that leads out.

    Raises:
        CheckpointError: Naming the file name and where it was found.
    """
    pure = PurePosixPath(name)
    if pure.is_absolute() or Path(name).is_absolute() or ".." in pure.parts or not pure.parts:
        raise CheckpointError(
            f"{source} names the file {name!r}, which is outside the checkpoint directory; "
            "refused as unsafe (a checkpoint's files are relative paths inside it)"
        )
    path = root / name
    base = os.path.realpath(root)
    try:
        real = os.path.realpath(path)
    except (ValueError, OSError) as error:  # a NUL byte, a loop of links
        raise CheckpointError(
            f"{source} names the file {name!r}, which cannot be resolved ({error})"
        ) from None
    if os.path.commonpath([base, real]) != base:
        raise CheckpointError(
            f"{source} names the file {name!r}, which leads outside the checkpoint directory "
            f"(to {real!r}, through a symbolic link); refused as unsafe"
        )
    return path


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
            f"and plain values, which reading could run ({_first_line(error)}). Nothing was "
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
            f"({_first_line(error)}); save tensors, numbers, strings, lists and dicts of them "
            "(convert other objects in state_dict(), or leave it out of stateful=)"
        ) from None
    return buffer.getvalue()


class _SafeBytes:
    """A load planner's ``load_bytes`` reading every non-tensor value ``weights_only``."""

    flatten_state_dict: bool
    original_state_dict: Any
    mappings: Any
    state_dict: Any

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Read one non-tensor value; refuse anything but tensors, containers and primitives."""
        loaded = load_value(value, f"the checkpoint's value {read_item.dest_index.fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's load planner, every non-tensor value read ``weights_only``."""


class SafeWholePlanner(_SafeBytes, EmptyStateDictLoadPlanner):
    """DCP's planner that rebuilds the whole state from the index, values ``weights_only``."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__


def unsafe_cause(error: BaseException) -> CheckpointError | None:
    """The refusal inside a DCP failure (DCP wraps what a rank raised), or ``None``."""
    if isinstance(error, CheckpointError):
        return error
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            found = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(found, CheckpointError):
                return found
    cause = error.__cause__ or error.__context__
    return unsafe_cause(cause) if cause is not None else None
