"""Where each tensor goes in the files ``save_pretrained`` writes: shards, headers, offsets.

Computed from names, dtypes and shapes alone, the same on every rank and offline, so that a
live model and a checkpoint of it give the same bytes. Tensors fill shards in order; a shard
is closed when the next tensor would take it past ``max_shard_size`` (a larger tensor gets a
shard of its own), as transformers shards.
"""

from __future__ import annotations

import dataclasses
import json
import math

import torch

from hf_io._format import (
    FILE_METADATA,
    HEADER_ALIGNMENT,
    SINGLE_FILE,
    code_of,
    shard_file_name,
)
from safe_store import METADATA_KEY


@dataclasses.dataclass(frozen=True)
class Placed:
    """One tensor's place: its file (index into ``Layout.files``) and its absolute bytes."""

    file: int
    start: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
    """The files to write.

    Attributes:
        files: File names, in order.
        headers: Each file's first bytes (length prefix, JSON header, padding).
        sizes: Each file's total size.
        placed: Tensor name -> :class:`Placed`.
        total_size: The tensors' bytes (the index's ``total_size``).
    """

    files: tuple[str, ...]
    headers: tuple[bytes, ...]
    sizes: tuple[int, ...]
    placed: dict[str, Placed]
    total_size: int

    def index(self) -> bytes | None:
        """``model.safetensors.index.json``'s content, or ``None`` for a single file."""
        if len(self.files) == 1:
            return None
        index = {
            "metadata": {"total_size": self.total_size},
            "weight_map": {name: self.files[p.file] for name, p in self.placed.items()},
        }
        return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def plan_layout(
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_size: int
) -> Layout:
    """Shard ``(name, dtype, shape)`` in order into files of at most ``max_shard_size`` bytes."""
    shards: list[list[tuple[str, torch.dtype, tuple[int, ...], int]]] = [[]]
    filled = 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        code_of(dtype, name)  # refuses what safetensors cannot store, before any file exists
        if shards[-1] and filled + nbytes > max_shard_size:
            shards.append([])
            filled = 0
        shards[-1].append((name, dtype, shape, nbytes))
        filled += nbytes
    count = len(shards)
    files = tuple(
        SINGLE_FILE if count == 1 else shard_file_name(i + 1, count) for i in range(count)
    )
    headers, sizes, placed = [], [], {}
    for number, shard in enumerate(shards):
        table: dict[str, object] = {METADATA_KEY: FILE_METADATA}
        offset = 0
        for name, dtype, shape, nbytes in shard:
            table[name] = {
                "dtype": code_of(dtype, name),
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        text = json.dumps(table, separators=(",", ":")).encode()
        text += b" " * (-len(text) % HEADER_ALIGNMENT)
        header = len(text).to_bytes(8, "little") + text
        start = len(header)
        for name, dtype, shape, nbytes in shard:
            placed[name] = Placed(number, start, dtype, shape)
            start += nbytes
        headers.append(header)
        sizes.append(start)
    total = sum(size - len(header) for size, header in zip(sizes, headers, strict=True))
    return Layout(files, tuple(headers), tuple(sizes), placed, total)
