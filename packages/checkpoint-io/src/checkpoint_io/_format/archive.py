"""torch.save's zip container, read as torch's own reader (miniz) reads it.

One parser for every reader here: the tensor records' fast path
(:func:`checkpoint_io._format.records.tensor_record`) and the scan of a value before
``torch.load`` reads it (:func:`checkpoint_io._format.values.load_value`). Python's
:mod:`zipfile` reads some archives otherwise than torch: it shifts every offset by the bytes it
finds before the archive, and takes the zip64 end record just before the locator where torch
follows the locator. A scan through it was shown a benign pickle while torch loaded a
``bytearray`` (two directories; two zip64 end records: found by reviews).

This parser is stricter than torch's, never looser: the data starts with a local header (else
``torch.load`` reads it as its legacy format, a series of pickles from the first byte, which
no scan of a zip would see: an old-format pickle before an end record passed it), the end
record closes the data (torch.save writes no comment), a zip64 end record sits right before
its locator and agrees with the end record wherever that is not saturated, names are unique
ignoring case (torch finds ``data.pkl`` ignoring case), and every entry, local header and
member lies inside the data. Anything else is not an archive torch.save wrote.
"""

from __future__ import annotations

import dataclasses
import struct

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory: 22 bytes
_ENTRY = struct.Struct("<4s6H3L5H2L")  # central directory entry: 46 bytes, then the name
_LOCAL = struct.Struct("<4s5H3L2H")  # local header: 30 bytes, then name and extra
_LOCATOR = struct.Struct("<4sLQL")  # zip64 end of central directory locator: 20 bytes
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory record: 56 bytes
_FIELD = struct.Struct("<2H")  # an extra field's id and size
_ZIP64 = 0xFFFFFFFF  # a field saturated: its value is in a zip64 record (count: 0xFFFF)


@dataclasses.dataclass(frozen=True)
class Member:
    """One member of an archive.

    Attributes:
        begin: Where its data starts (after its local header).
        size: Its data's length as stored.
        stored: Stored as is (not compressed).
    """

    begin: int
    size: int
    stored: bool


@dataclasses.dataclass(frozen=True)
class Archive:
    """An archive's members, by name, and whether a value needed zip64 records.

    ``zip64``: a field was saturated (4 GiB or more); torch writes the zip64 end records
    whatever the size.
    """

    members: dict[str, Member]
    zip64: bool


def read_archive(data: bytes | memoryview) -> Archive | None:
    """The members of ``data``, as torch's reader finds them.

    ``None`` where torch.save did not write it so (see the module's docstring).
    """
    end = len(data) - _EOCD.size
    if end < 0 or bytes(data[:4]) != b"PK\x03\x04":  # torch.load's own test for a zip
        return None
    sig, _, _, _, count, size, directory, comment = _EOCD.unpack_from(data, end)
    if sig != b"PK\x05\x06" or comment:
        return None
    limit, wide = end, count == 0xFFFF or _ZIP64 in (size, directory)
    located = end >= _LOCATOR.size and bytes(data[end - _LOCATOR.size : end - 16]) == b"PK\x06\x07"
    if located or wide:
        found = _zip64_end(data, end, (count, size, directory))
        if found is None:
            return None
        count, size, directory, limit = found
    if directory + size > limit:
        return None
    members: dict[str, Member] = {}
    names: set[str] = set()
    at = directory
    for _ in range(count):
        if at + _ENTRY.size > directory + size:
            return None
        entry = _ENTRY.unpack_from(data, at)
        method, packed, unpacked, name_len, extra_len, comment_len = (
            entry[4],
            *entry[8:13],
        )
        local = entry[16]
        name_at = at + _ENTRY.size
        at = name_at + name_len + extra_len + comment_len
        if entry[0] != b"PK\x01\x02" or at > directory + size:
            return None
        name = bytes(data[name_at : name_at + name_len]).decode("utf-8", "replace")
        extra = bytes(data[name_at + name_len : name_at + name_len + extra_len])
        sizes = _zip64_sizes(extra, (unpacked, packed, local))
        if sizes is None or name.lower() in names:
            return None
        wide = wide or _ZIP64 in (unpacked, packed, local)
        unpacked, packed, local = sizes
        begin = _data_start(data, local)
        if begin is None or begin + packed > directory:
            return None
        names.add(name.lower())
        members[name] = Member(begin, packed, method == 0 and packed == unpacked)
    return Archive(members, wide)


def _zip64_end(
    data: bytes | memoryview, end: int, narrow: tuple[int, int, int]
) -> tuple[int, int, int, int] | None:
    """Count, size and offset of the directory from the zip64 end record, and where it is."""
    locator = end - _LOCATOR.size
    if locator < 0:
        return None
    sig, _, record, _ = _LOCATOR.unpack_from(data, locator)
    if sig != b"PK\x06\x07" or record + _EOCD64.size != locator:  # right before the locator
        return None
    found = _EOCD64.unpack_from(data, record)
    wide = (found[7], found[8], found[9])
    if found[0] != b"PK\x06\x06" or any(
        n not in (0xFFFF, _ZIP64) and n != w for n, w in zip(narrow, wide, strict=True)
    ):
        return None
    return wide[0], wide[1], wide[2], record


def _zip64_sizes(extra: bytes, narrow: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """An entry's sizes and offset, the saturated ones from its zip64 extra field."""
    if _ZIP64 not in narrow:
        return narrow
    at = 0
    while at + _FIELD.size <= len(extra):
        kind, length = _FIELD.unpack_from(extra, at)
        if kind == 1 and at + _FIELD.size + length <= len(extra):
            values = list(struct.unpack_from(f"<{length // 8}Q", extra, at + _FIELD.size))
            wide = [values.pop(0) if n == _ZIP64 and values else n for n in narrow]
            return None if _ZIP64 in wide else (wide[0], wide[1], wide[2])
        at += _FIELD.size + length
    return None


def _data_start(data: bytes | memoryview, local: int) -> int | None:
    """Where a member's data starts, after its local header (as torch reads it)."""
    if local + _LOCAL.size > len(data):
        return None
    header = _LOCAL.unpack_from(data, local)
    if header[0] != b"PK\x03\x04":
        return None
    return int(local + _LOCAL.size + header[9] + header[10])


def stored_members(data: memoryview) -> dict[str, tuple[int, int]] | None:
    """Name -> (offset, size) of each member of an archive that stores them all, or ``None``.

    ``None`` too where a value needed zip64 records (a record of 4 GiB or more): the slow path.
    """
    archive = read_archive(data)
    if archive is None or archive.zip64:
        return None
    if not all(member.stored for member in archive.members.values()):
        return None
    return {name: (member.begin, member.size) for name, member in archive.members.items()}
