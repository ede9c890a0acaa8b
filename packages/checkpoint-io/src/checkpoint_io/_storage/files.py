"""The one read path: every file of a checkpoint opened once and checked from the bytes decoded.

Every reader (``load_checkpoint``, ``consolidate_checkpoint``, ``inspect --fingerprint``,
:func:`saved_model`, the RNG and stateful files of a load) reads a checkpoint's files through
:class:`CheckpointFiles`. A file is opened once, as a regular file inside the checkpoint (no
link, no FIFO); its size is the one the manifest recorded, every file read is one the manifest
recorded, and with ``verify`` its digest is computed from the very bytes that are then decoded
(no window between a check and a second read). Data files are safetensors: each one's header
is read first and checked by safe-store's rules, and every record the index asks for must be
exactly one of its tensors' bytes. Records are then read in file order, one at a time
(:meth:`CheckpointFiles.read_records`): a rank holds one record in memory, not the file.

A verified read that finds a changed file raises after the file's last record was decoded:
the values were read into staging (see :mod:`checkpoint_io._load`), so nothing was changed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from torch.distributed.checkpoint.metadata import Metadata

from checkpoint_io._errors import CheckpointError, escaped, inside, open_regular, shown
from checkpoint_io._storage.digest import RECORDS, Digest, check_sizes, record_digest
from checkpoint_io._storage.index import check_files, check_index, decode_index
from checkpoint_io._storage.manifest import INDEX_FILE, MANIFEST, read_manifest
from safe_store import MAX_HEADER_BYTES, parse_header

_WINDOW = 64 << 20  # bytes read at a time between the records a rank needs (hashed, dropped)


class CheckpointFiles:
    """The files of one checkpoint, as one reader reads them.

    Args:
        root: The checkpoint directory.
        manifest: Its manifest (read by :func:`read_manifest`); its file table, when it has
            one (formats 2 and 3), says which files exist, their sizes and digests.
        verify: Check each file's digest from the bytes read.

    Raises:
        CheckpointError: If the manifest's file table is malformed.
    """

    def __init__(self, root: Path, manifest: Mapping[str, Any], *, verify: bool) -> None:
        table = manifest["files"]
        if not isinstance(table, Mapping) or not all(
            isinstance(name, str)
            and isinstance(entry, Mapping)
            and type(entry.get("bytes")) is int
            and entry["bytes"] >= 0
            and _records_well_formed(entry.get(RECORDS, []))
            for name, entry in table.items()
        ):
            raise CheckpointError(
                f"{root / MANIFEST}'s file table is malformed (each entry maps a file name to "
                "its size in bytes and digest); refused"
            )
        self.root = root
        self.table: Mapping[str, Mapping[str, Any]] = table
        self.verify = verify

    def read(self, name: str) -> bytes:
        """The whole file ``name`` (relative to the checkpoint), checked.

        Raises:
            CheckpointError: Outside the checkpoint, not a regular file, not recorded, missing,
                of another size, or (``verify``) another digest.
        """
        stream, size, digest = _open(self, name)
        with stream:
            data = _read_exactly(stream, size, self.root / name)
        if digest is not None:
            digest.update(data)
            _check(self.root, name, digest)
        return data

    def read_records(
        self,
        name: str,
        spans: list[tuple[int, int]],
        each: Callable[[int, memoryview], None],
        *,
        whole_file: bool = False,
    ) -> None:
        """Hand the bytes of each ``(offset, length)`` record of data file ``name`` to ``each``.

        In file order, one record in memory at a time. With ``verify``, when the manifest
        holds each record's digest (checkpoints written since they were added), each record is
        checked before it is decoded and nothing else is read; otherwise every byte of the file
        is hashed on the way (the gaps too) and the file's digest is checked after the last
        record (``each`` decodes into staging); when ``each`` fails, the rest of the file is
        hashed first, so a changed file is reported as changed, not as whatever broke.

        Args:
            name: The data file, relative to the checkpoint.
            spans: The records; identical ones are the caller's to merge.
            each: Called with ``(index into spans, the record's bytes)``.
            whole_file: Check the whole file's digest (every byte read), not the records'.

        Raises:
            CheckpointError: As :meth:`read`; records that overlap or end past the file.
        """
        stream, size, digest = _open(self, name)
        file = self.root / name
        buffer = _Buffer()  # one allocation, reused: a record at a time
        known = _record_digests(self.table[name]) if digest is not None and not whole_file else None
        if known is not None and not all(span in known for span in spans):
            known = None  # a record not in the table: the whole file's digest instead
        if known is not None:
            digest = None
        with stream:
            position = _check_header(stream, file, size, spans, digest, buffer, known)
            for index in sorted(range(len(spans)), key=lambda i: spans[i]):
                offset, length = spans[index]
                if offset < position or offset + length > size:
                    raise CheckpointError(
                        f"{escaped(file)}: the index's record at bytes {offset}..{offset + length} "
                        f"overlaps another or ends past the file ({size} bytes); DCP writes "
                        "neither. Refused as damaged or crafted"
                    )
                _skip(stream, position, offset, digest, file, buffer)
                data = buffer.take(stream, length, file)
                position = offset + length
                if digest is not None:
                    digest.update(data)
                elif known is not None:
                    _check_record(self.root, name, (offset, length), data, known)
                try:
                    each(index, data)
                except Exception:
                    if digest is not None:  # a changed file says so, whatever broke
                        _skip(stream, position, size, digest, file, buffer)
                        _check(self.root, name, digest)
                    raise
            if digest is not None:
                _skip(stream, position, size, digest, file, buffer)
                _check(self.root, name, digest)

    def check_all(self) -> None:
        """Check every recorded file's digest (for readers that then read piecemeal).

        Raises:
            CheckpointError: As :meth:`read`.
        """
        for name in sorted(self.table):
            if name.endswith(".safetensors"):
                self.read_records(name, [], lambda index, data: None, whole_file=True)
            else:
                self.read(name)


def _check_header(
    stream: BinaryIO,
    file: Path,
    size: int,
    spans: list[tuple[int, int]],
    digest: Digest | None,
    buffer: _Buffer,
    known: dict[tuple[int, int], str] | None,
) -> int:
    """Read and check a data file's safetensors header; every span one tensor's bytes.

    Returns:
        The position after the header.

    Raises:
        CheckpointError: A header safetensors would refuse, or a span that is not exactly
            one of its tensors' bytes.
    """
    prefix = bytes(buffer.take(stream, 8, file))
    length = int.from_bytes(prefix, "little")
    if length > MAX_HEADER_BYTES or length > size - 8:
        raise CheckpointError(
            f"{escaped(file)} is not a safetensors file: its header claims {length} bytes"
        )
    raw = bytes(buffer.take(stream, length, file))
    if digest is not None:
        digest.update(prefix)
        digest.update(raw)
    if known is not None:
        span = (0, 8 + length)
        if span not in known:
            raise CheckpointError(
                f"{escaped(file)}: the manifest records no digest of its header; the checkpoint is "
                "corrupt or crafted"
            )
        found = record_digest(prefix + raw)
        if found != known[span]:
            raise CheckpointError(
                f"verification failed: {escaped(file)}'s header has checksum {found}, the "
                f"checkpoint recorded {known[span]}; the file was changed or damaged after saving. "
                "Nothing was loaded"
            )
    try:
        header = parse_header(file, raw, size, ())
    except ValueError as error:
        raise CheckpointError(f"{error}; the checkpoint is corrupt or crafted") from None
    tensors = {(e.data_start + e.begin, e.end - e.begin) for e in header.entries.values()}
    odd = [span for span in spans if span not in tensors]
    if odd:
        raise CheckpointError(
            f"{escaped(file)}: the index's record at bytes {odd[0][0]}..{sum(odd[0])} is not one "
            "of the file's tensors (by its header); the checkpoint is corrupt or crafted"
        )
    return 8 + length


def _open(files: CheckpointFiles, name: str) -> tuple[BinaryIO, int, Digest | None]:
    """``name`` opened (regular, inside, recorded, at its size), its size, its digest."""
    source = str(files.root / MANIFEST)
    file = inside(files.root, name, source=source)
    entry = files.table.get(name)
    if entry is None:
        raise CheckpointError(
            f"{files.root}: {shown(name)} is read but the manifest did not record it (a "
            "planted file is never read); refused as unsafe"
        )
    try:
        stream = open_regular(file)
    except OSError as error:
        raise CheckpointError(
            f"the checkpoint is truncated or corrupt: {escaped(name)} is missing or unreadable "
            f"({error}); save it again (or restore it from a copy)"
        ) from None
    size = os.fstat(stream.fileno()).st_size
    if entry is not None and size != entry["bytes"]:
        stream.close()
        raise CheckpointError(
            f"the checkpoint is truncated or corrupt: {escaped(name)} is {size} bytes, "
            f"{entry['bytes']} were written; save it again (or restore it from a copy)"
        )
    digest = Digest(entry) if files.verify else None
    return stream, size, digest


def _skip(
    stream: BinaryIO, start: int, end: int, digest: Digest | None, file: Path, buffer: _Buffer
) -> None:
    """Move from ``start`` to ``end``: hashed when verifying, else a seek."""
    if digest is None:
        stream.seek(end)
        return
    for at in range(start, end, _WINDOW):
        digest.update(buffer.take(stream, min(_WINDOW, end - at), file))


class _Buffer:
    """A growing byte buffer that the records of one file are read into, one at a time."""

    def __init__(self) -> None:
        self._data = bytearray()

    def take(self, stream: BinaryIO, length: int, file: Path) -> memoryview:
        """The next ``length`` bytes of ``stream``, in the buffer (valid until the next take).

        Raises:
            CheckpointError: If the file ends first (it changed while it was read).
        """
        if len(self._data) < length:
            self._data = bytearray(length)
        view = memoryview(self._data)[:length]
        done = 0
        while done < length:
            got = stream.readinto(view[done:])  # type: ignore[attr-defined]
            if not got:
                _short(file, done, length)
            done += got
        return view


def _records_well_formed(records: object) -> bool:
    return isinstance(records, list) and all(
        isinstance(r, list)
        and len(r) == 3
        and all(type(n) is int and n >= 0 for n in r[:2])
        and isinstance(r[2], str)
        for r in records
    )


def _record_digests(entry: Mapping[str, Any]) -> dict[tuple[int, int], str] | None:
    """``(offset, length) -> digest`` of a data file's records, or ``None`` if not recorded."""
    records = entry.get(RECORDS)
    if not isinstance(records, list):
        return None
    return {(int(offset), int(length)): str(found) for offset, length, found in records}


def _check_record(
    root: Path,
    name: str,
    span: tuple[int, int],
    data: memoryview,
    known: dict[tuple[int, int], str],
) -> None:
    found = record_digest(data)
    if found != known[span]:
        raise CheckpointError(
            f"verification failed for {str(root)!r}: {escaped(name)} (bytes "
            f"{span[0]}..{sum(span)}) has checksum {found}, the checkpoint recorded "
            f"{known[span]}; the file was changed or "
            "damaged after saving. Nothing was loaded"
        )


def _check(root: Path, name: str, digest: Digest) -> None:
    found = digest.found()
    if found != digest.expected:
        raise CheckpointError(
            f"verification failed for {str(root)!r}: {escaped(name)} has checksum {found}, the "
            f"checkpoint recorded {digest.expected}; the file was changed or damaged after "
            "saving. Nothing was loaded"
        )


def _read_exactly(stream: BinaryIO, length: int, file: Path) -> bytes:
    data = stream.read(length)
    if len(data) != length:
        _short(file, len(data), length)
    return data


def _short(file: Path, got: int, length: int) -> NoReturn:
    raise CheckpointError(
        f"the checkpoint is truncated or corrupt: {escaped(file)} ended after {got} of the "
        f"{length} bytes expected (it changed while it was read); read it again"
    )


def read_checked(root: Path, *, verify: bool) -> tuple[dict[str, Any], Metadata, CheckpointFiles]:
    """The manifest, DCP's index and the files of ``root``, checked before any data is read.

    The manifest and the index are read once each (the index verified from its bytes); the
    index is checked against itself and the manifest (:func:`check_index`); every recorded
    file is present at its size.

    Raises:
        FileNotFoundError: If ``root`` does not exist.
        CheckpointError: Not a checkpoint; a malformed manifest or index; a file missing,
            truncated or (``verify``) changed; anything refused as unsafe.
    """
    manifest = read_manifest(root)
    files = CheckpointFiles(root, manifest, verify=verify)
    metadata = decode_index(files.read(INDEX_FILE), root / INDEX_FILE)
    check_index(root, metadata, manifest)
    check_files(root, metadata)
    check_sizes(root, files.table)
    return manifest, metadata, files
