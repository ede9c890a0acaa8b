"""Values read ``weights_only`` and bounded by their own bytes; values written so."""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from typing import Any

import torch

from checkpoint_io._errors import CheckpointError, first_line
from checkpoint_io._format.archive import read_archive
from checkpoint_io._format.pickles import class_called, pickle_globals


def load_value(data: io.BytesIO | bytes, what: str, map_location: Any = None) -> Any:
    """A non-tensor value read ``weights_only`` (tensors, containers and primitives only).

    A byte buffer inside it (the optimizer's parameter groups are one) is read in turn, one
    level deep: a buffer inside a buffer is refused (K buffers nested D deep made K^D loads,
    minutes for a 7.9 KB file).

    Raises:
        CheckpointError: Naming ``what`` when the value holds anything else (refused as
            unsafe) or cannot be read.
    """
    try:
        return _read(data, map_location, depth=0)
    except _Refused as refused:
        raise CheckpointError(
            f"{what} was refused as unsafe: it holds {refused}. Nothing was loaded"
        ) from None
    except Exception as error:
        raise CheckpointError(f"{what} cannot be read ({type(error).__name__}: {error})") from None


class _Refused(Exception):
    """What a value holds that a checkpoint refuses (the caller names the value)."""


def _read(data: io.BytesIO | bytes, map_location: Any, depth: int) -> Any:
    """A value read ``weights_only`` once its bytes are known to be bounded.

    Raises:
        _Refused: What it holds that is refused.
        Exception: Whatever ``torch.load`` raises for data it cannot read.
    """
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    problem = _unbounded(stream.getvalue())
    if problem is not None:
        raise _Refused(f"{problem}, which can make a few bytes read as gigabytes")
    try:
        # io.BytesIO is admitted: the optimizer's parameter groups are stored as one (its
        # bytes are read weights_only in turn, below); rebuilding one runs nothing.
        with torch.serialization.safe_globals([io.BytesIO]):
            value = torch.load(stream, weights_only=True, map_location=map_location)
    except pickle.UnpicklingError as error:
        raise _Refused(
            "something other than tensors, containers and plain values, which reading could "
            f"run ({first_line(error)})"
        ) from None
    _check_buffers(value, depth)
    return value


_REFUSED_GLOBALS = {("builtins", "bytearray"), ("__builtin__", "bytearray")}
"""Admitted by torch's ``weights_only`` unpickler, refused here: ``bytearray(n)`` makes ``n``
bytes out of a few (a 656-byte stateful file loaded at 1.8 GB). So are torch's legacy tensor
constructors (:func:`_refused`): ``torch.ByteTensor(n)`` made a 2 GB tensor of a 266-byte
value; ``torch.save`` names none of them (a tensor is rebuilt from its storage).
``torch.Tensor`` itself, which ``torch.save`` does name, is refused where it is called
(:func:`~checkpoint_io._format.pickles.class_called`)."""


def _refused(found: tuple[str, str]) -> bool:
    module, name = found
    legacy = module in ("torch", "torch.cuda", "torch.sparse") and name.endswith("Tensor")
    return (legacy and found != ("torch", "Tensor")) or found in _REFUSED_GLOBALS


def _unbounded(data: bytes) -> str | None:
    """What in a ``torch.save`` payload could expand beyond its own size, or ``None``.

    torch writes an uncompressed zip: a compressed member (about 1,000:1 with deflate) or a
    pickle that builds a ``bytearray`` is refused, as is anything that is not such a zip. The
    archive is read as torch reads it (:mod:`checkpoint_io._format.archive`), and every
    member torch could take for the pickle is scanned (torch finds ``data.pkl`` ignoring case).
    """
    archive = read_archive(data)
    if archive is None:
        return "data that is not torch.save's format (an uncompressed zip, as torch writes it)"
    for name, member in archive.members.items():
        if not member.stored:
            return f"a compressed record ({name})"
    for name, member in archive.members.items():
        if name.lower().endswith("data.pkl"):
            found = _refused_global(data[member.begin : member.begin + member.size])
            if found is not None:
                return found
    return None


def _refused_global(pickled: bytes) -> str | None:
    """The first refused global a pickle names (``GLOBAL`` or ``STACK_GLOBAL``), or ``None``.

    So is a class that makes uninitialized memory of any size when called (a storage class,
    ``torch.Tensor``) where it is used other than as ``torch.save`` uses it (see
    :func:`~checkpoint_io._format.pickles.class_called`).
    """
    try:
        for found in pickle_globals(pickled):
            if found is not None and _refused(found):
                return f"a {found[1]}"
        called = class_called(pickled)
        if called is not None:
            return f"the class {called}, used other than as torch.save uses it"
    except Exception:  # malformed: torch's unpickler refuses it with its own reason
        return None
    return None


def _check_buffers(value: Any, depth: int) -> None:
    """Every ``BytesIO`` inside ``value`` is a plain one whose bytes read ``weights_only``.

    A pickled ``BytesIO`` may carry an attribute dict (its methods replaced by other values);
    one that does is refused, and the bytes of the others are read as values in turn. Each
    object is visited once, however often the pickle refers to it (ten references per level
    made 10^depth visits: 3 s for a 1.4 KB value at depth 7), through a stack of its own;
    dict keys and sets are looked into as well.

    Raises:
        _Refused: A buffer with attributes, a buffer inside a buffer, a buffer whose bytes
            are refused (what they hold).
    """
    for item in _leaves(value, exact=False):
        if isinstance(item, io.BytesIO):
            _check_buffer(item, depth)


def _leaves(value: Any, *, exact: bool) -> Iterator[Any]:
    """Each object inside ``value`` that is not plain nor a container, once.

    Dicts (keys too), lists, tuples and sets are looked into; with ``exact``, only these very
    types (a subclass, an ``OrderedDict`` say, is a leaf: it is pickled by its own name).
    Each object is visited once, however often the value refers to it, through a stack of its
    own (no recursion).
    """
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind in _PLAIN or id(item) in seen:
            continue
        seen.add(id(item))
        if kind is dict or (not exact and isinstance(item, dict)):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif kind in _CONTAINERS or (not exact and isinstance(item, _CONTAINERS)):
            stack.extend(item)
        else:
            yield item


def _check_buffer(value: io.BytesIO, depth: int) -> None:
    """One ``BytesIO``: plain, one level deep, its bytes read ``weights_only``."""
    if type(value) is not io.BytesIO or vars(value):
        raise _Refused("a byte buffer with attributes of its own")
    if depth >= 1:
        raise _Refused(
            "a byte buffer inside a byte buffer (a checkpoint nests them one level deep at most)"
        )
    position = value.tell()
    try:
        _read(value.getvalue(), "cpu", depth + 1)  # never onto a device
    except _Refused as refused:
        raise _Refused(f"a byte buffer that holds {refused}") from None
    value.seek(position)


def safe_bytes(value: Any, what: str, fix: str) -> bytes:
    """``value`` serialized by ``torch.save``, once it is known to read back as a load reads it.

    What a load refuses is refused here, before anything is written (a byte buffer of raw
    bytes in a ``state_dict()`` was saved, and every load of the checkpoint then refused it).

    Args:
        value: What to serialize.
        what: Its name in the error.
        fix: What to do instead, in the error.

    Raises:
        TypeError: Naming ``what``, what it holds that a load refuses, and ``fix``.
    """
    buffer = io.BytesIO()
    torch.save(value, buffer)
    try:
        _read(buffer.getvalue(), "cpu", depth=0)
    except _Refused as refused:
        raise TypeError(
            f"{what} holds a value that a checkpoint cannot read back safely (it holds "
            f"{refused}); save tensors, numbers, strings, lists and dicts of them ({fix})"
        ) from None
    return buffer.getvalue()


_PLAIN = frozenset({int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device})
"""Types whose values ``weights_only`` reads back whatever they are (exactly these: a subclass,
an ``IntEnum`` say, is pickled by its own name)."""

_CONTAINERS = (list, tuple, set, frozenset)


def check_values(value: Any, what: str, fix: str, *, records: bool) -> None:
    """Refuse, before anything is written, what in ``value`` a load would refuse.

    Only what is not plain is read back, with the reader's own check (:func:`safe_bytes`):
    numbers, strings, bytes, ``None``, dtypes and devices, and the lists, tuples, sets and
    dicts of them, read back by construction. So do tensors, when ``records`` (DCP writes
    each as a record of its own), or else a plain tensor without attributes. Reading back a
    whole optimizer's parameter groups took 0.9 s for 10,000 groups; the tensors of a state
    doubled its memory.

    Args:
        value: What DCP will write.
        what: Its name in the error.
        fix: What to do instead, in the error.
        records: Whether its tensors are written as tensor records, not pickled with it.

    Raises:
        TypeError: As :func:`safe_bytes`.
    """
    odd = [item for item in _leaves(value, exact=True) if not _tensor_apart(item, records)]
    if odd:
        safe_bytes(odd, what, fix)


def _tensor_apart(value: object, records: bool) -> bool:
    """A tensor that reads back: any, written as a record; else plain, without attributes."""
    if not isinstance(value, torch.Tensor):
        return False
    return records or (type(value) in (torch.Tensor, torch.nn.Parameter) and not vars(value))
