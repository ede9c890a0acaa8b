"""DCP's index (``.metadata``) read without running code; file names kept inside."""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

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


DTYPE_NAMES = frozenset(
    name for name, value in vars(torch).items() if isinstance(value, torch.dtype)
)
"""torch's dtypes by name (read from the module's namespace: ``getattr`` would import)."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds DCP's metadata types and torch dtypes, and nothing else.

    The C unpickler (a large index reads ten times faster than with pickle's Python one), made
    safe by what :meth:`find_class` hands it. ``BUILD`` sets attributes on whatever is on the
    stack, and on an admitted class, an enum member (``_MEM_FORMAT_ENCODING(0)``'s ``_value_``
    set to 7 broke every later save) or a function (``_get_layout``'s cache) it would change
    the process. So an admitted Python class, enum or function is never handed out: a
    stand-in is (:func:`_stand_in`), made for this unpickling, that refuses ``BUILD`` and,
    when called (``REDUCE``, ``NEWOBJ``), makes a fresh instance of the real class, calls the
    real function, or wraps the enum member. What is handed out as itself is immutable:
    torch's dtypes, ``torch.Size``, and builtin types. Only the fresh objects this unpickling
    created can be built.
    """

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source
        self._stand_ins: dict[tuple[str, str], Any] = {}

    def persistent_load(self, pid: Any) -> Any:
        raise refusal(self.source, "a persistent id")

    def find_class(self, module: str, name: str) -> Any:
        if name in _ADMITTED.get(module, ()):
            real = getattr(importlib.import_module(module), name)
            if (isinstance(real, type) and real.__module__ == "builtins") or real is torch.Size:
                return real  # immutable: BUILD cannot change it
            made = self._stand_ins.get((module, name))
            if made is None:
                made = self._stand_ins[(module, name)] = _stand_in(real, f"{module}.{name}", self)
            return made
        if module == "torch" and name in DTYPE_NAMES:
            return vars(torch)[name]  # a tensor's dtype (torch.float32, ...): immutable
        raise refusal(self.source, f"{module}.{name}")


def refusal(source: str, what: str) -> CheckpointError:
    """The error for a ``.metadata`` that would load ``what``."""
    return CheckpointError(
        f"{source} was refused as unsafe: it would load {what}, which is not part of "
        "a checkpoint's index (DCP's metadata types and torch dtypes); it may run code. "
        "Nothing was loaded; do not use a checkpoint from a source you do not trust"
    )


class _NoBuild:
    """A data descriptor on the stand-ins' type: reading ``__setstate__`` refuses.

    The unpickler looks ``__setstate__`` up on ``BUILD``'s target before anything else; on
    a stand-in (a class object) this descriptor of its type wins over the real class's own.
    """

    def __get__(self, stand_in: Any, kind: Any = None) -> Any:
        raise refusal(stand_in._source, stand_in._what)

    def __set__(self, stand_in: Any, value: Any) -> None:
        raise refusal(stand_in._source, stand_in._what)


class _Guarded(type):
    """The stand-ins' type: ``BUILD`` on a stand-in is refused."""

    _what: str
    _source: str
    __setstate__ = _NoBuild()


def _stand_in(real: Any, name: str, unpickler: _MetadataUnpickler) -> Any:
    """What ``find_class`` hands out for ``real`` (a Python class, enum or function)."""
    make: Callable[..., Any]
    if isinstance(real, enum.EnumMeta):
        make = functools.partial(_member, real, name, unpickler.source)
        what = f"a change to an object it did not create ({name})"
    elif isinstance(real, type):
        make = functools.partial(_instance, real)
        what = f"a change to the class {real.__module__}.{real.__qualname__}"
    else:
        make = real
        what = f"a change to an object it did not create ({name})"

    def new(cls: Any, *args: Any, **kwargs: Any) -> Any:
        return make(*args, **kwargs)

    return _Guarded(
        f"StandIn[{name}]",
        (),
        {"__new__": new, "_what": what, "_source": unpickler.source, "__slots__": ()},
    )


def _instance(real: type, *args: Any, **kwargs: Any) -> Any:
    """A fresh ``real``: a dataclass's fields from ``BUILD`` (``NEWOBJ``) or from ``args``."""
    if not dataclasses.is_dataclass(real):
        return real(*args, **kwargs)
    made = real.__new__(real)
    if args or kwargs:
        real.__init__(made, *args, **kwargs)
    return made


def _member(real: enum.EnumMeta, name: str, source: str, value: Any) -> _Member:
    return _Member(real(value), name, source)  # one value: a member, never a new enum


class _Member:
    """An enum member as the unpickling made it: equal to it, and refusing ``BUILD``.

    DCP's ``TensorProperties.__setstate__`` compares its memory-format code with
    ``_MEM_FORMAT_ENCODING``'s members; this wrapper compares equal to its member only.
    """

    __slots__ = ("_member", "_name", "_source")

    def __init__(self, member: Any, name: str, source: str) -> None:
        self._member, self._name, self._source = member, name, source

    def __eq__(self, other: object) -> bool:
        return other is self._member or (
            isinstance(other, _Member) and other._member is self._member
        )

    def __hash__(self) -> int:
        return hash(self._member)

    def __setstate__(self, state: Any) -> None:
        raise refusal(self._source, f"a change to an object it did not create ({self._name})")


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
