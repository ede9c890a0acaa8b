"""Per-file digests: each rank records the files it writes; a reader hashes the bytes it reads.

No tensor is gathered to check a checkpoint: the manifest records every file's size and
xxh3-128 digest (and each tensor record's, in a data file), each rank computes those of the
files it wrote as it writes them (safe-store's ``StreamWriter``), and a verified read
(:mod:`checkpoint_io._storage.files`) hashes the very bytes it decodes. XXH3-128 is built for
speed and for damage, not for tampering: a checkpoint from an untrusted source is safe to read
because its format carries no code.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from checkpoint_io._errors import CheckpointError, escaped, inside, open_regular
from safe_store import ALGORITHM, record_digest

# name (relative to the checkpoint directory, "/"-separated)
#   -> {"bytes": n, "xxh3_128": hex, "records": [[offset, length, hex], ...], "rank": writer}
FileTable = dict[str, dict[str, Any]]


def file_entry(file: Path) -> dict[str, Any]:
    """``{"bytes": size, "xxh3_128": digest}`` of one small file (the index, the manifest)."""
    with open_regular(file) as stream:
        data = stream.read()
    return {"bytes": len(data), ALGORITHM: record_digest(data)}


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
