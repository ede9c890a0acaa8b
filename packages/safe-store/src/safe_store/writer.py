"""One safetensors file written as a stream: a header from the plan, then each tensor in turn.

The header is known before any tensor is (names, dtypes and shapes), so the file is written
front to back, one tensor at a time: host memory holds one tensor's bytes, never the file.
Each tensor's bytes are hashed as they are written (xxh3-128, the record's digest and the
file's), so the file's table entry needs no second read. The entries tile the data section
in the order given, as safetensors requires; the header is padded with spaces to 8 bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash

from safe_store.header import CODES, METADATA_KEY

__all__ = ["ALGORITHM", "RECORDS", "StreamWriter", "record_digest"]

ALGORITHM = "xxh3_128"
"""The digest a file table records (per file, and per record under :data:`RECORDS`)."""
RECORDS = "records"
"""A data file's entry: ``[offset, length, digest]`` of its header, then of each tensor's
bytes, by offset."""


def record_digest(data: bytes | memoryview) -> str:
    """The xxh3-128 hex digest of one record's bytes."""
    return str(xxhash.xxh3_128_hexdigest(data))


class StreamWriter:
    """Writes the safetensors file ``path`` from its plan, one tensor at a time.

    Args:
        path: The file to create (it must not exist).
        entries: ``(name, dtype, shape)`` of every tensor, in the order they are written.
        metadata: The header's ``__metadata__`` strings.

    Raises:
        ValueError: A dtype safetensors has no code for, or a name given twice.
    """

    def __init__(
        self,
        path: Path,
        entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: Mapping[str, str],
    ) -> None:
        table: dict[str, Any] = {METADATA_KEY: dict(metadata)}
        self._spans: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        at = 0
        for name, dtype, shape in entries:
            if name in table or dtype not in CODES:
                why = "given twice" if name in table else f"of {dtype}, which has no code"
                raise ValueError(f"{path}: the tensor {name!r} is {why}")
            size = dtype.itemsize
            for dim in shape:
                size *= int(dim)
            table[name] = {
                "dtype": CODES[dtype],
                "shape": list(shape),
                "data_offsets": [at, at + size],
            }
            self._spans[name] = (at, size, dtype, tuple(shape))
            at += size
        self._total = at
        text = json.dumps(table, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._start = 8 + len(text)
        self._file = path.open("xb")
        self._digest = xxhash.xxh3_128()
        head = len(text).to_bytes(8, "little") + text
        # NOTE: the header is a record too (the first): a reader that checks only the records
        # it reads still checks the header it parsed them from.
        self._records: list[list[Any]] = [[0, len(head), record_digest(head)]]
        self._next = 0
        self._write(head)

    def write(self, name: str, tensor: torch.Tensor) -> tuple[int, int]:
        """Write ``name``'s tensor (the next one in the plan); its ``(offset, length)``.

        Raises:
            ValueError: A tensor out of the plan's order, or of another dtype or shape.
        """
        begin, size, dtype, shape = self._spans[name]
        if begin != self._next or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{self._file.name}: {name!r} written out of order or as {tensor.dtype} "
                f"{tuple(tensor.shape)} (planned: {dtype} {shape})"
            )
        host = tensor.detach().to("cpu").contiguous().reshape(-1)
        data = memoryview(host.view(torch.uint8).numpy().data) if size else memoryview(b"")
        self._write(data)
        self._records.append([self._start + begin, size, record_digest(data)])
        self._next = begin + size
        return self._start + begin, size

    def close(self) -> dict[str, Any]:
        """Flush the file to the disk; its table entry (bytes, digest, records).

        Raises:
            ValueError: If a planned tensor was not written.
        """
        try:
            if self._next != self._total:
                raise ValueError(
                    f"{self._file.name}: {self._total - self._next} planned bytes were not written"
                )
            self._file.flush()
            os.fsync(self._file.fileno())
            size = self._file.tell()
        finally:
            self._file.close()
        return {"bytes": size, ALGORITHM: self._digest.hexdigest(), RECORDS: self._records}

    def abort(self) -> None:
        """Close the file without flushing it (a failed write: the caller removes it)."""
        self._file.close()

    def _write(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._digest.update(data)
