"""Per-file digests: each rank records the files it writes; a reader hashes the bytes it reads.

No tensor is gathered to check a checkpoint: the manifest records every file's size and
xxh3-128 digest (and each tensor record's, in a data file), each rank computes those of the
files it wrote as it writes them (safe-store's ``StreamWriter``), and a verified read
(:mod:`checkpoint_io._storage.files`) hashes the very bytes it decodes (:class:`Digest`).
XXH3-128 is built for speed and for damage, not for tampering: a checkpoint from an untrusted
source is safe to read because its format carries no code.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from checkpoint_io._errors import CheckpointError, escaped, inside, open_regular
from safe_store import ALGORITHM, RECORDS, record_digest

__all__ = [
    "ALGORITHM",
    "RECORDS",
    "Digest",
    "FileTable",
    "check_sizes",
    "file_entry",
    "record_digest",
]

# name (relative to the checkpoint directory, "/"-separated)
#   -> {"bytes": n, "xxh3_128": hex, "records": [[offset, length, hex], ...], "rank": writer}
FileTable = dict[str, dict[str, Any]]

_PIECE = 16 << 20


def file_entry(file: Path) -> dict[str, Any]:
    """``{"bytes": size, "xxh3_128": digest}`` of one small file (the index, the manifest)."""
    digest = xxhash.xxh3_128()
    size = 0
    with open_regular(file) as stream:
        while piece := stream.read(_PIECE):
            digest.update(piece)
            size += len(piece)
    return {"bytes": size, ALGORITHM: digest.hexdigest()}


class Digest:
    """The digest a file table's entry records, computed from the bytes fed to it.

    Args:
        entry: The file's entry in the manifest.
    """

    def __init__(self, entry: Mapping[str, Any]) -> None:
        self.expected = str(entry.get(ALGORITHM))
        self._hasher = xxhash.xxh3_128()

    def update(self, data: bytes | memoryview) -> None:
        """Add the next bytes of the file."""
        self._hasher.update(data)

    def found(self) -> str:
        """The digest of the bytes fed so far."""
        return str(self._hasher.hexdigest())


def check_sizes(root: Path, files: Mapping[str, Mapping[str, Any]]) -> None:
    """Every recorded file is present at its recorded size (no read).

    Raises:
        CheckpointError: Naming the first file that is missing or has another size.
    """
    for name, entry in sorted(files.items()):
        file = inside(root, name, source=str(root / "checkpoint.json"))
        size = file.stat().st_size if file.is_file() else -1
        if size != int(entry["bytes"]):
            found = "missing" if size < 0 else f"{size} bytes, {entry['bytes']} were written"
            raise CheckpointError(
                f"the checkpoint is truncated or corrupt: {escaped(name)} is {found}; save it "
                "again (or restore it from a copy)"
            )
