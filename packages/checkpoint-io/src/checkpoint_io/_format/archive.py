"""torch.save's zip container, read where its own records say (as torch's reader reads it).

Python's :mod:`zipfile` shifts every offset by any bytes found in front of the archive;
torch's reader (miniz) does not. Where both read one payload (a value is scanned with
:mod:`zipfile`, then loaded by ``torch.load``), they must read the same members:
:func:`directory_offset` says where the end record puts the directory, for the scan to check.
"""

from __future__ import annotations

import struct

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory: 22 bytes
_ENTRY = struct.Struct("<4s6H3L5H2L")  # central directory entry: 46 bytes, then the name
_LOCAL = struct.Struct("<4s5H3L2H")  # local header: 30 bytes, then name and extra
_ZIP64 = 0xFFFFFFFF  # a field saturated: its value is in a zip64 record (count: 0xFFFF)


def stored_members(data: memoryview) -> dict[str, tuple[int, int]] | None:
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


def member_bytes(data: bytes, header_offset: int, size: int) -> bytes | None:
    """The ``size`` stored bytes of the member whose local header is at ``header_offset``.

    ``None`` when they do not lie inside ``data``. No CRC32 is checked: a tensor record may
    have none (:func:`checkpoint_io._format.records.zip_crc32`).
    """
    if header_offset < 0 or header_offset + _LOCAL.size > len(data):
        return None
    header = _LOCAL.unpack_from(data, header_offset)
    begin = header_offset + _LOCAL.size + header[9] + header[10]
    if header[0] != b"PK\x03\x04" or begin + size > len(data):
        return None
    return data[begin : begin + size]


_LOCATOR = struct.Struct("<4sLQL")  # zip64 end of central directory locator: 20 bytes
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory record: 56 bytes


def directory_offset(data: bytes) -> int | None:
    """Where the end record (zip64's where it defers to it) puts the central directory.

    ``None`` unless the end record closes ``data`` (torch.save writes no comment).
    """
    end = len(data) - _EOCD.size
    if end < 0:
        return None
    sig, _, _, _, _, _, directory, _ = _EOCD.unpack_from(data, end)
    if sig != b"PK\x05\x06":
        return None
    if directory != _ZIP64:
        return int(directory)
    locator = end - _LOCATOR.size
    if locator < 0:
        return None
    sig, _, record, _ = _LOCATOR.unpack_from(data, locator)
    if sig != b"PK\x06\x07" or record + _EOCD64.size > locator:
        return None
    found = _EOCD64.unpack_from(data, record)
    return int(found[9]) if found[0] == b"PK\x06\x06" else None
