"""DCP's index (``.metadata``) read without running code; file names kept inside."""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

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
        if module == "torch" and name in DTYPE_NAMES:
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
