"""A safetensors file's header, read as untrusted input by safetensors' own rules.

safetensors runs no code, but its header is a length and a JSON table that anyone can craft.
Each file's header is checked here before a byte of data is read, by the rules the safetensors
library applies when it opens the file, so that whatever passes here safetensors reads too:

- an 8-byte little-endian length, at most :data:`MAX_HEADER_BYTES`, inside the file;
- at most :data:`MAX_ENTRIES` entries, counted in the raw bytes before the JSON is parsed;
- UTF-8 JSON, one object; no key twice; no lone surrogate in a name; integers of at most
  :data:`MAX_DIGITS` digits; ``__metadata__`` absent, ``null`` or an object of strings;
- each entry ``{dtype, shape, data_offsets}``: a known dtype, at most :data:`MAX_DIMS` dims,
  each dim and every running product of them below 2**64 (a left fold, as safetensors'
  ``checked_mul``), ``end - begin == elements x itemsize``;
- the entries, sorted by offsets, tile the data section exactly: the first starts at 0, each
  starts where the previous ends (no gap, no overlap, zero-size ones included), the last ends
  at the end of the file.

A bad header is one ``ValueError`` naming the file and the rule; nothing large is allocated,
the cost is linear in the header's length, and nothing can block.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from dist_core import open_regular

__all__ = [
    "CODES",
    "DTYPES",
    "MAX_DIMS",
    "MAX_ENTRIES",
    "MAX_HEADER_BYTES",
    "METADATA_KEY",
    "Entry",
    "Header",
    "header_of",
    "identity",
    "parse_header",
    "read_header",
    "tensor_of",
]

METADATA_KEY = "__metadata__"
MAX_HEADER_BYTES = 100_000_000
"""safetensors' own cap on a header's length."""
MAX_DIMS = 64
"""The most dims an entry may have (no model's tensor has more; 100,000 dims are refused)."""
MAX_ENTRIES = 1 << 20
"""The most entries one header's table may hold (its tensors, and ``__metadata__``).

NOTE: safetensors caps only the header's length (:data:`MAX_HEADER_BYTES`), and 100 MB of
zero-size entries is 1.5 M of them: they were parsed (16 s and 1-2 GB) and accepted. A file of
a real checkpoint holds far fewer (100,000 tensors with two optimizer states each is 300,000),
and a larger model is split into shards. The entries are counted in the raw bytes before the
JSON is parsed, so a header past the cap is refused after a linear scan (about a second, a
few at most); one at the cap is still parsed (about 12 s)."""
MAX_DIGITS = 20
"""The most digits of an integer in a header (2**64 has 20)."""
_U64 = 2**64
_WINDOW = 1 << 22
"""The bytes of a header split at a time when its objects are counted (bounds the memory)."""

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
"""The safetensors dtype codes read and written (a code outside it is refused, never guessed)."""
CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}


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
        data_start: The file offset of the data section (``begin`` counts from it).
    """

    file: Path
    code: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int
    identity: tuple[int, ...]
    data_start: int


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


def read_header(file: Path, *, hub_cache: bool = False) -> Header:
    """Read and check the header of the safetensors ``file``.

    Args:
        file: The file.
        hub_cache: Follow a Hugging Face hub cache snapshot's link to its blob (any other
            link is refused).

    Raises:
        ValueError: If ``file`` is not a regular file or its header breaks a rule (one line
            naming the file and the rule).
        FileNotFoundError: If it does not exist.
    """
    with open_regular(
        file, error=ValueError, holder="a pretrained model", hub_cache=hub_cache
    ) as stream:
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
    return parse_header(file, raw, size, identity(status))


def header_of(data: bytes | memoryview, file: Path) -> Header:
    """The checked header of a whole safetensors file held in memory (``data``).

    Raises:
        ValueError: As :func:`read_header`.
    """
    if len(data) < 8:
        raise _bad(file, f"it has {len(data)} bytes, fewer than a safetensors header's 8")
    length = int.from_bytes(data[:8], "little")
    if length > MAX_HEADER_BYTES or length > len(data) - 8:
        raise _bad(file, f"its header claims {length} bytes (the file has {len(data)})")
    return parse_header(file, bytes(data[8 : 8 + length]), len(data), ())


def parse_header(file: Path, raw: bytes, size: int, ident: tuple[int, ...]) -> Header:
    """Check the header text ``raw`` of ``file`` (``size`` bytes in all).

    Raises:
        ValueError: As :func:`read_header`.
    """
    length = len(raw)
    if length > MAX_HEADER_BYTES:
        raise _bad(
            file, f"its header is {length} bytes (safetensors allows at most {MAX_HEADER_BYTES})"
        )
    _check_count(file, raw)
    table = _parse(file, raw)
    metadata = table.pop(METADATA_KEY, None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _bad(file, f"its {METADATA_KEY} is not a mapping of strings (a JSON object)")
    for text in (*table, *metadata, *metadata.values()):
        _utf8(file, text)
    entries = {name: _entry(file, name, value, ident, 8 + length) for name, value in table.items()}
    _check_tiling(file, entries, size - 8 - length)
    return Header(file=file, entries=entries, metadata=metadata, data_start=8 + length)


def tensor_of(data: bytes | memoryview, entry: Entry) -> torch.Tensor:
    """A copy of ``entry``'s tensor out of its whole file ``data`` (read by :func:`header_of`)."""
    start = entry.data_start + entry.begin
    raw = bytearray(data[start : entry.data_start + entry.end])
    if not raw:
        return torch.empty(entry.shape, dtype=entry.dtype)
    return torch.frombuffer(raw, dtype=entry.dtype).reshape(entry.shape)


def identity(status: os.stat_result) -> tuple[int, ...]:
    """What tells one file from its replacement: device, inode, size, modification time."""
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def _check_count(file: Path, raw: bytes) -> None:
    """Refuse a header of more than :data:`MAX_ENTRIES` entries before it is parsed.

    Each entry (``__metadata__`` too) is a JSON object inside the table, so it holds one
    ``{`` outside any string. The ``{`` bytes bound the objects from above (that byte is never
    part of a longer UTF-8 character); only past the cap are the ``{`` outside strings
    counted, so that names or metadata full of braces (a ``stateful=`` object's tagged JSON)
    are not taken for entries.
    """
    most = MAX_ENTRIES + 1  # the table itself is an object too
    if raw.count(b"{") <= most:
        return
    objects = _objects(raw, most)
    if objects > most:
        raise _bad(
            file,
            f"its header holds more than the cap MAX_ENTRIES = {MAX_ENTRIES} entries "
            f"({objects - 1} counted before it was parsed); no real checkpoint's file holds "
            "as many, so it is crafted or corrupt (a larger model is split into shards)",
        )


def _objects(raw: bytes, most: int) -> int:
    """The ``{`` bytes outside JSON strings in ``raw`` (the count stops once past ``most``).

    With the escaped backslashes and then the escaped quotes taken out, every quote left
    opens or closes a string, so the text between quotes alternates outside and inside. Split
    a window at a time, in C: linear, whatever the header holds.
    """
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    objects, inside = 0, 0
    for start in range(0, len(text), _WINDOW):
        window = text[start : start + _WINDOW]
        if b"{" not in window:
            inside ^= window.count(b'"') & 1
            continue
        pieces = window.split(b'"')
        objects += b"".join(pieces[inside::2]).count(b"{")
        inside ^= (len(pieces) - 1) & 1
        if objects > most:
            break
    return objects


def _parse(file: Path, raw: bytes) -> dict[str, Any]:
    def no_twice(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _bad(file, f"its header holds the key {_shown(key)} twice")
            seen.add(key)
        return dict(pairs)

    def integer(text: str) -> int:
        if len(text.lstrip("-")) > MAX_DIGITS:
            raise _bad(file, f"its header holds an integer of {len(text)} digits")
        return int(text)

    def constant(text: str) -> Any:
        raise _bad(file, f"its header holds {text}, which is not JSON")

    try:
        table = json.loads(
            raw.decode("utf-8"),
            object_pairs_hook=no_twice,
            parse_int=integer,
            parse_constant=constant,
        )
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise _bad(file, f"its header is not JSON ({str(error)[:120]})") from None
    if not isinstance(table, dict):
        raise _bad(file, f"its header is a JSON {type(table).__name__}, not an object")
    return table


def _entry(file: Path, name: str, value: Any, ident: tuple[int, ...], start: int) -> Entry:
    shown = _shown(name)
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data_offsets"}:
        raise _bad(file, f"the entry {shown} is not {{dtype, shape, data_offsets}}")
    code, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(code, str) or code not in DTYPES:
        raise _bad(file, f"the entry {shown} has the unknown dtype {str(code)[:20]!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        count = len(shape) if isinstance(shape, list) else type(shape).__name__
        raise _bad(file, f"the entry {shown} has a shape of {count} dims (at most {MAX_DIMS})")
    elements = 1
    for dim in shape:
        if not _u64(dim):
            raise _bad(file, f"the entry {shown} has the dim {str(dim)[:24]}, not an int >= 0")
        elements *= dim
        if elements >= _U64:
            raise _bad(file, f"the entry {shown} has a shape whose size overflows 64 bits")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_u64, offsets)):
        raise _bad(file, f"the entry {shown} has the offsets {str(offsets)[:40]}, not two u64")
    begin, end = offsets
    dtype = DTYPES[code]
    expected = elements * dtype.itemsize
    if expected >= _U64 or begin > end or end - begin != expected:
        raise _bad(
            file,
            f"the entry {shown} spans bytes [{begin}, {end}), but {code} x {tuple(shape)} is "
            f"{expected} bytes",
        )
    return Entry(file, code, dtype, tuple(shape), begin, end, ident, start)


def _check_tiling(file: Path, entries: dict[str, Entry], data_size: int) -> None:
    """The entries, in offset order, cover ``[0, data_size)`` exactly once."""
    position = 0
    for begin, end, name in sorted((e.begin, e.end, n) for n, e in entries.items()):
        if begin != position:
            what = "a gap before" if begin > position else "an overlap at"
            raise _bad(file, f"{what} the entry {_shown(name)} (byte {begin}, expected {position})")
        position = end
    if position != data_size:
        raise _bad(
            file,
            f"its tensors end at byte {position} of a {data_size}-byte data section "
            "(bytes past the last tensor)",
        )


def _u64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _U64


def _utf8(file: Path, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(file, f"its header holds a name that is not UTF-8 ({_shown(text)})") from None


def _shown(text: str) -> str:
    return ascii(text[:80])


def _bad(file: Path, fault: str) -> ValueError:
    return ValueError(f"{file} is not a valid safetensors file: {fault}")
