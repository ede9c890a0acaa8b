"""The one read path: every file of a checkpoint opened once and checked from the bytes decoded.

A file is opened once, as a regular file inside the checkpoint (no link, no FIFO), recorded
in the manifest at its size; with ``verify`` the digest is computed from the very bytes then
decoded (no window between a check and a second read). A data file's header is checked by
safetensors' rules (safe-store), and every record read must be exactly one of its tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from torch.distributed.checkpoint.metadata import Metadata

from checkpoint_io._errors import CheckpointError, escaped, inside, open_regular
from checkpoint_io._storage.index import decode_index
from checkpoint_io._storage.manifest import INDEX_FILE, MANIFEST, read_manifest
from checkpoint_io._storage.tiling import check_index
from safe_store import ALGORITHM, MAX_HEADER_BYTES, RECORDS, parse_header, record_digest

Span = tuple[int, int]  # (offset, length) of a record in its file


class CheckpointFiles:
    """The files of one checkpoint, as one reader reads them.

    Args:
        root: The checkpoint directory.
        manifest: Its manifest: each file's size and digests.
        verify: Check each file's (or record's) digest from the bytes read.

    Raises:
        CheckpointError: If the manifest's file table is malformed.
    """

    def __init__(self, root: Path, manifest: Mapping[str, Any], *, verify: bool) -> None:
        table = manifest["files"]
        if not all(
            isinstance(entry, Mapping)
            and type(entry.get("bytes")) is int
            and entry["bytes"] >= 0
            and isinstance(entry.get("xxh3_128"), str)
            and _records_well_formed(entry.get(RECORDS, []))
            for entry in table.values()
        ):
            raise CheckpointError(
                f"{root / MANIFEST}'s file table is malformed (each entry maps a file name to "
                "its size in bytes and digest); refused"
            )
        self.root = root
        self.table: Mapping[str, Mapping[str, Any]] = table
        self.verify = verify

    def read(self, name: str) -> bytes:
        """The whole file ``name`` (relative to the checkpoint), checked as :meth:`_open` does."""
        stream, size = self._open(name)
        with stream:
            data = stream.read(size)
        if len(data) != size:
            _short(self.root / name, len(data), size)
        if self.verify:
            _check(self.root, name, record_digest(data), str(self.table[name][ALGORITHM]))
        return data

    def read_records(
        self,
        name: str,
        spans: list[Span],
        each: Callable[[int, memoryview], None],
        into: Callable[[int], Any] | None = None,
    ) -> None:
        """Hand the bytes of each record of data file ``name`` to ``each``, in file order.

        Args:
            name: The data file, relative to the checkpoint.
            spans: The records (no two alike).
            each: Called with ``(index into spans, the record's bytes)``, valid until it returns.
            into: The buffer to read record ``index`` into (``None``: a reused one).

        Raises:
            CheckpointError: As :meth:`read`; a header safetensors would refuse, a record that
                is not one of its tensors, or (``verify``) whose digest differs.
        """
        stream, size = self._open(name)
        file = self.root / name
        known = {(int(o), int(n)): str(d) for o, n, d in self.table[name].get(RECORDS, [])}
        buffer = _Buffer()
        with stream:
            head = _take(stream, buffer, 8, file)
            length = int.from_bytes(head, "little")
            if length > MAX_HEADER_BYTES or length > size - 8:
                raise CheckpointError(f"{escaped(file)}: its header claims {length} bytes")
            raw = bytes(head) + bytes(_take(stream, buffer, length, file))
            self._verify(name, (0, len(raw)), raw, known)
            try:
                header = parse_header(file, raw[8:], size, ())
            except ValueError as error:
                raise CheckpointError(f"{error}; the checkpoint is corrupt or crafted") from None
            tensors = {(e.data_start + e.begin, e.end - e.begin) for e in header.entries.values()}
            for index in sorted(range(len(spans)), key=lambda i: spans[i]):
                span = spans[index]
                if span not in tensors:
                    raise CheckpointError(
                        f"{escaped(file)}: the index's record at bytes {span[0]}..{sum(span)} is "
                        "not one of the file's tensors (by its header); corrupt or crafted"
                    )
                stream.seek(span[0])
                data = _take(stream, buffer, span[1], file, None if into is None else into(index))
                self._verify(name, span, data, known)
                each(index, data)

    def _open(self, name: str) -> tuple[BinaryIO, int]:
        """``name`` opened (regular, inside, recorded, at its recorded size), and its size."""
        file = inside(self.root, name, source=str(self.root / MANIFEST))
        entry = self.table.get(name)
        if entry is None:
            raise CheckpointError(
                f"{self.root}: {escaped(name)} is read but the manifest did not record it (a "
                "planted file is never read); refused as unsafe"
            )
        try:
            stream = open_regular(file)
        except OSError as error:
            raise _damaged(name, f"missing or unreadable ({error})") from None
        size = os.fstat(stream.fileno()).st_size
        if size != entry["bytes"]:
            stream.close()
            raise _damaged(name, f"{size} bytes, {entry['bytes']} were written")
        return stream, size

    def _verify(
        self, name: str, span: Span, data: bytes | memoryview, known: dict[Span, str]
    ) -> None:
        if not self.verify:
            return
        if span not in known:
            raise CheckpointError(
                f"{self.root}: the manifest records no digest of {escaped(name)} at bytes "
                f"{span[0]}..{sum(span)}; the checkpoint is corrupt or crafted"
            )
        _check(
            self.root, f"{name} (bytes {span[0]}..{sum(span)})", record_digest(data), known[span]
        )


def _records_well_formed(records: object) -> bool:
    return isinstance(records, list) and all(
        isinstance(r, list)
        and len(r) == 3
        and all(type(n) is int and n >= 0 for n in r[:2])
        and isinstance(r[2], str)
        for r in records
    )


def _damaged(name: str, found: str) -> CheckpointError:
    """The one refusal of a file that is not there as the manifest recorded it."""
    return CheckpointError(
        f"the checkpoint is truncated or corrupt: {escaped(name)} is {found}; save it again "
        "(or restore it from a copy)"
    )


def _check(root: Path, what: str, found: str, expected: str) -> None:
    if found != expected:
        raise CheckpointError(
            f"verification failed for {str(root)!r}: {escaped(what)} has checksum {found}, the "
            f"checkpoint recorded {expected}; the file was changed or damaged after saving. "
            "Nothing was loaded"
        )


class _Buffer:
    """The buffer a file's records are read into; replaced, never resized (views live on)."""

    def __init__(self, size: int = 0) -> None:
        self.data = bytearray(size)


def _take(
    stream: BinaryIO, buffer: _Buffer, length: int, file: Path, into: Any = None
) -> memoryview:
    """The next ``length`` bytes of ``stream``, in ``into`` or ``buffer`` (until the next)."""
    if into is not None:
        view = memoryview(into).cast("B")
    else:
        if len(buffer.data) < length:
            buffer.data = bytearray(length)
        view = memoryview(buffer.data)[:length]
    done = 0
    while done < length:
        got = stream.readinto(view[done:])  # type: ignore[attr-defined]
        if not got:
            _short(file, done, length)
        done += got
    return view


def _short(file: Path, got: int, length: int) -> NoReturn:
    raise CheckpointError(
        f"the checkpoint is truncated or corrupt: {escaped(file)} ended after {got} of the "
        f"{length} bytes expected (it changed while it was read); read it again"
    )


def read_checked(root: Path, *, verify: bool) -> tuple[dict[str, Any], Metadata, CheckpointFiles]:
    """The manifest, DCP's index and the files of ``root``, checked before any data is read.

    The index is checked against itself and the manifest; every recorded file is present at
    its size.

    Raises:
        FileNotFoundError: If ``root`` does not exist.
        CheckpointError: Not a checkpoint; a malformed manifest or index; a file missing,
            truncated or (``verify``) changed; anything refused as unsafe.
    """
    manifest = read_manifest(root)
    files = CheckpointFiles(root, manifest, verify=verify)
    metadata = decode_index(files.read(INDEX_FILE), root / INDEX_FILE)
    check_index(root, metadata, manifest)
    for name, entry in sorted(files.table.items()):  # every file present at its size, unread
        file = inside(root, name, source=str(root / MANIFEST))
        size = file.stat().st_size if file.is_file() else -1
        if size != int(entry["bytes"]):
            raise _damaged(
                name, "missing" if size < 0 else f"{size} bytes, {entry['bytes']} were written"
            )
    return manifest, metadata, files
