"""A safetensors file's header, read as untrusted input.

safetensors runs no code, but its header is a length and a JSON table that anyone can craft.
Before a byte of data is read, each file's header is checked here: a bounded length, a JSON
object of ``name -> {dtype, shape, data_offsets}``, known dtypes, non-negative shapes, offsets
inside the file, every size equal to ``shape x dtype``, no two tensors overlapping. A bad one
is one ``ValueError`` naming the file; nothing large is allocated and nothing can block.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from dist_core import open_regular
from hf_io._format import DTYPES, MAX_HEADER_BYTES, METADATA_KEY


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor in a safetensors file.

    Attributes:
        file: The file holding it.
        code: Its safetensors dtype code (``F32``).
        dtype: The torch dtype of ``code``.
        shape: Its shape.
        begin: The first byte of its data, counted from the start of the data section.
        end: One past its last byte.
        identity: The file's device, inode, size and modification time when it was checked.
    """

    file: Path
    code: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int
    identity: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Header:
    """A checked safetensors header.

    Attributes:
        file: The file.
        entries: Tensor name -> :class:`Entry`, in the header's order.
        metadata: The ``__metadata__`` strings (``{"format": "pt"}``).
        data_start: The byte at which the data section starts.
    """

    file: Path
    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int


def read_header(file: Path) -> Header:
    """Read and check the header of the safetensors ``file``.

    Raises:
        ValueError: If ``file`` is not a regular file or its header is malformed (one line
            naming the file and the fault).
        FileNotFoundError: If it does not exist.
    """
    with open_regular(file, error=ValueError, holder="a pretrained model") as stream:
        status = os.fstat(stream.fileno())
        size = status.st_size
        prefix = stream.read(8)
        if len(prefix) < 8:
            raise _bad(file, f"it has {size} bytes, fewer than a safetensors header's 8")
        length = int.from_bytes(prefix, "little")
        if length > MAX_HEADER_BYTES or length > size - 8:
            raise _bad(
                file,
                f"its header claims {length} bytes (the file has {size}; safetensors allows "
                f"at most {MAX_HEADER_BYTES})",
            )
        raw = stream.read(length)
    try:
        table = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise _bad(file, f"its header is not JSON ({error})") from None
    if not isinstance(table, dict):
        raise _bad(file, f"its header is a JSON {type(table).__name__}, not an object")
    metadata = table.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _bad(file, f"its {METADATA_KEY} is not a mapping of strings")
    data_size = size - 8 - length
    entries = {
        name: _entry(file, name, value, data_size, identity(status))
        for name, value in table.items()
    }
    _check_layout(file, entries)
    return Header(file=file, entries=entries, metadata=metadata, data_start=8 + length)


def identity(status: os.stat_result) -> tuple[int, ...]:
    """What tells one file from its replacement: device, inode, size, modification time."""
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def _entry(file: Path, name: str, value: Any, data_size: int, ident: tuple[int, ...]) -> Entry:
    shown = repr(name)[:80]
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data_offsets"}:
        raise _bad(file, f"the entry {shown} is not {{dtype, shape, data_offsets}}")
    code, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(code, str) or code not in DTYPES:
        raise _bad(file, f"the entry {shown} has the unknown dtype {str(code)[:20]!r}")
    if not isinstance(shape, list) or not all(_natural(d) for d in shape):
        raise _bad(
            file, f"the entry {shown} has the shape {str(shape)[:40]}, not a list of ints >= 0"
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_natural, offsets)):
        raise _bad(
            file, f"the entry {shown} has the offsets {str(offsets)[:40]}, not two ints >= 0"
        )
    begin, end = offsets
    if not begin <= end <= data_size:
        raise _bad(
            file,
            f"the entry {shown} spans bytes [{begin}, {end}) of a {data_size}-byte data section",
        )
    dtype = DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise _bad(
            file,
            f"the entry {shown} holds {end - begin} bytes, but {code} x {tuple(shape)} is "
            f"{expected}",
        )
    return Entry(file, code, dtype, tuple(shape), begin, end, ident)


def _check_layout(file: Path, entries: dict[str, Entry]) -> None:
    spans = sorted((e.begin, e.end, name) for name, e in entries.items() if e.end > e.begin)
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise _bad(file, f"the entries {first[:80]!r} and {second[:80]!r} overlap")


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bad(file: Path, fault: str) -> ValueError:
    return ValueError(f"{file} is not a valid safetensors file: {fault}")
