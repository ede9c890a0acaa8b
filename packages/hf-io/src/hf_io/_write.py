"""Bytes into place: a tensor's slice written where the layout puts it, no gather needed.

A safetensors file is a header and each tensor's bytes in row-major order, so a rank that holds
rows ``[a, b)`` of a tensor (FSDP2's dim-0 shard) owns one contiguous byte range of the file and
writes it with ``pwrite``; another slicing writes one run per outer index.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from hf_io._layout import Layout, Placed


def create_files(folder: Path, layout: Layout) -> None:
    """Create each file of ``layout`` in ``folder`` at its full size, its header written."""
    for name, header, size in zip(layout.files, layout.headers, layout.sizes, strict=True):
        with open(folder / name, "wb") as stream:
            stream.write(header)
            stream.truncate(size)


def write_part(
    folder: Path,
    layout: Layout,
    name: str,
    part: torch.Tensor,
    offsets: Sequence[int],
) -> int:
    """Write ``part`` (the slice of tensor ``name`` starting at ``offsets``); the bytes written."""
    placed = layout.placed[name]
    data = part.detach().to("cpu", placed.dtype).contiguous().reshape(-1)
    nbytes = data.numel() * data.element_size()
    if nbytes == 0:
        return 0
    view = (ctypes.c_char * nbytes).from_address(data.data_ptr())
    fd = os.open(folder / layout.files[placed.file], os.O_WRONLY)
    try:
        for position, (start, length) in _runs(placed, tuple(part.shape), tuple(offsets)):
            _write_all(fd, memoryview(view)[position : position + length], start)
        os.fsync(fd)
    finally:
        os.close(fd)
    return nbytes


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` all of ``data``: one call writes at most about 2 GiB on Linux."""
    while len(data):
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _runs(
    placed: Placed, sizes: tuple[int, ...], offsets: tuple[int, ...]
) -> list[tuple[int, tuple[int, int]]]:
    """``(position in the part's bytes, (file offset, length))`` for each contiguous run."""
    item = placed.dtype.itemsize
    shape = placed.shape
    if not shape:
        return [(0, (placed.start, item))]
    # The innermost dims the part spans entirely are contiguous in the file, with the first
    # dim before them that it spans partly.
    inner = len(shape) - 1
    while inner > 0 and sizes[inner] == shape[inner]:
        inner -= 1
    run = math.prod(sizes[inner:]) * item
    strides = [math.prod(shape[d + 1 :]) * item for d in range(len(shape))]
    runs = []
    for position, outer in enumerate(itertools.product(*(range(s) for s in sizes[:inner]))):
        start = (
            placed.start
            + sum((offsets[d] + i) * strides[d] for d, i in enumerate(outer))
            + offsets[inner] * strides[inner]
        )
        runs.append((position * run, (start, run)))
    return runs
