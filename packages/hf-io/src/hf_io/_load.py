"""``load_pretrained``: safetensors into a plain, DDP, FSDP or HSDP model, each rank its slices."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from dist_core import agree, log_rank0, open_regular
from hf_io._names import KeyMap, Target, model_targets, rename
from hf_io._source import Pretrained, open_pretrained
from safe_store import Entry, identity

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PretrainedInfo:
    """What :func:`load_pretrained` loaded.

    Attributes:
        path: The directory or file read.
        files: The safetensors files read.
        loaded: The model's names that received values (a tie once, under its first name).
        missing: The model's names the file lacks, left at their initial values
            (``strict=False`` only).
        unexpected: The file's names the model lacks, ignored (``strict=False`` only).
        tied: The groups of names that share one tensor in the model.
        bytes_read: The bytes this rank read from the files (its slices only).
    """

    path: Path
    files: tuple[Path, ...]
    loaded: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    tied: tuple[tuple[str, ...], ...]
    bytes_read: int


def load_pretrained(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    key_map: KeyMap | None = None,
    strict: bool = True,
) -> PretrainedInfo:
    """Load Hugging Face safetensors weights into ``model``, each rank reading only its part.

    Collective when ``model`` is sharded or a process group is initialized: every rank calls
    it. Under FSDP2 and HSDP each rank reads only its shards' rows (safetensors'
    ``get_slice``), so no rank holds more than its shards plus one tensor's slice. A tie
    (tensors shared under two names) is read once and stays tied. Every name, shape and dtype
    is checked against the files' headers before the first byte lands; on any fault the model
    is unchanged on every rank and every rank raises. Values are cast to each tensor's dtype;
    integer and bool buffers must match the file's dtype exactly.

    Args:
        model: Plain, DDP (ddp-wrap's or torch's), FSDP2 or HSDP, possibly compiled; its
            tensors materialized (not on the meta device).
        path: A directory as ``save_pretrained`` writes it (``model.safetensors``, or shards
            and ``model.safetensors.index.json``) or one ``.safetensors`` file.
        key_map: Names in the file -> the model's names: a mapping (names it lacks are kept)
            or a callable (returning ``None`` drops a name).
        strict: Refuse names the file lacks or holds in excess; ``False`` leaves the model's
            missing tensors at their values and ignores the file's extra ones.

    Returns:
        A :class:`PretrainedInfo`.

    Raises:
        FileNotFoundError: If ``path`` holds no pretrained model.
        ValueError: If a header or the index is malformed, or names, shapes or dtypes do not
            match (one error naming every mismatch; the model unchanged).
        TypeError: If an argument has the wrong type.
    """
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__} ({strict!r})")
    start = time.perf_counter()
    plan: list[tuple[Target, str, Entry]] = []
    source: Pretrained | None = None
    missing: list[str] = []
    unexpected: list[str] = []
    error: Exception | None = None
    try:
        targets = model_targets(model)
        source = open_pretrained(path)
        plan, missing, unexpected = _match(targets, source, key_map, strict)
    except Exception as failure:
        error = failure
    # Checked on every rank; none writes a byte unless every rank's check passed.
    agree(error, "checking the pretrained files", kinds=_KINDS, default=ValueError)
    assert source is not None
    read = 0
    try:
        read = _copy(plan)
    except Exception as failure:
        error = failure
    agree(error, "loading the pretrained tensors", kinds=_KINDS)
    info = PretrainedInfo(
        path=source.path,
        files=tuple(h.file for h in source.headers),
        loaded=tuple(target.name for target, _, _ in plan),
        missing=tuple(missing),
        unexpected=tuple(unexpected),
        tied=tuple(t.names for t in model_targets(model) if len(t.names) > 1),
        bytes_read=read,
    )
    log_rank0(
        logger,
        logging.INFO,
        "loaded %d tensors from %s (%d file(s)) in %.2f s: %d missing, %d unexpected, %d tied",
        len(info.loaded),
        source.path,
        len(info.files),
        time.perf_counter() - start,
        len(info.missing),
        len(info.unexpected),
        len(info.tied),
    )
    return info


_KINDS = {"ValueError": ValueError, "TypeError": TypeError, "FileNotFoundError": FileNotFoundError}


def _match(
    targets: list[Target], source: Pretrained, key_map: KeyMap | None, strict: bool
) -> tuple[list[tuple[Target, str, Entry]], list[str], list[str]]:
    """Pair each target with its file entry; raise one error naming every mismatch."""
    by_model_name = rename(source.tensors, key_map, "key_map")
    plan: list[tuple[Target, str, Entry]] = []
    missing: list[str] = []
    faults: list[str] = []
    claimed: set[str] = set()
    for target in targets:
        found = [n for n in target.names if n in by_model_name]
        claimed.update(found)
        if not found:
            missing.extend(target.names)
            continue
        file_name = by_model_name[found[0]]
        entry = source.tensors[file_name]
        fault = _mismatch(target, entry) or _tie_differs(found, by_model_name, source)
        if fault:
            faults.append(f"{found[0]!r}: {fault}")
        plan.append((target, file_name, entry))
    unexpected = sorted(by_model_name[n] for n in by_model_name if n not in claimed)
    if strict and missing:
        faults.insert(0, f"missing from the file: {_listed(missing)}")
    if strict and unexpected:
        faults.insert(1 if missing else 0, f"not in the model: {_listed(unexpected)}")
    if faults:
        raise ValueError(
            f"load_pretrained refused {str(source.path)!r}; the model is unchanged. "
            + "; ".join(faults)
            + ". Pass key_map to rename the file's names, or strict=False to leave missing "
            "tensors at their values and ignore extra ones"
        )
    return plan, missing, unexpected


def _mismatch(target: Target, entry: Entry) -> str | None:
    want = target.tensor
    if tuple(want.shape) != entry.shape:
        return f"the file's shape {entry.shape} is not the model's {tuple(want.shape)}"
    if want.is_meta:
        return "the model's tensor is on the meta device; materialize the model first (to_empty)"
    exact = not (want.dtype.is_floating_point or want.dtype.is_complex)
    if exact and entry.dtype != want.dtype:
        return (
            f"the file holds {entry.code} for the model's {want.dtype}; integer and bool "
            "tensors load only from their own dtype"
        )
    if not exact and not entry.dtype.is_floating_point:
        return f"the file holds {entry.code} for the model's floating {want.dtype}"
    return None


def _tie_differs(found: list[str], by_model_name: dict[str, str], source: Pretrained) -> str | None:
    """Why the file's copies of one tie cannot all be loaded into it, or ``None``.

    A tie is one tensor; a file that stores it under two names with different values cannot
    be loaded without dropping one of them silently.
    """
    first = source.tensors[by_model_name[found[0]]]
    for other_name in found[1:]:
        other = source.tensors[by_model_name[other_name]]
        if (other.code, other.shape) != (first.code, first.shape) or not _same_bytes(first, other):
            return (
                f"the model ties it to {other_name!r}, but the file holds the two with "
                "different values; load one name (key_map) or untie the model"
            )
    return None


def _same_bytes(a: Entry, b: Entry, chunk: int = 1 << 24) -> bool:
    if (a.file, a.begin) == (b.file, b.begin):
        return True
    with (
        open_regular(a.file, holder="a pretrained model", hub_cache=True) as one,
        open_regular(b.file, holder="a pretrained model", hub_cache=True) as two,
    ):
        for offset in range(0, a.end - a.begin, chunk):
            size = min(chunk, a.end - a.begin - offset)
            left = os.pread(one.fileno(), size, a.data_start + a.begin + offset)
            if left != os.pread(two.fileno(), size, b.data_start + b.begin + offset):
                return False
    return True


def _listed(names: list[str], most: int = 20) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _copy(plan: list[tuple[Target, str, Entry]]) -> int:
    """Copy each target's part of its file entry into it; the bytes read.

    The file is opened (and mapped by safetensors) once per tensor, not once per file: the
    pages of a mapping that stays open count in the process's RSS until it is closed, so a
    rank reading its rows of every tensor through one mapping grew by half the model on top
    of its shards (611 MiB against a 469 MiB bound for a 495 MiB Llama on 2 ranks).
    """
    read = 0
    for count, (target, name, entry) in enumerate(plan, 1):
        local, index = _local_part(target.tensor)
        if local.numel() == 0:
            continue
        with _opened(entry) as reader, torch.no_grad():
            value = reader.get_slice(name)[index] if index else reader.get_tensor(name)
            if value.shape != local.shape:  # cannot happen for a checked, unchanged file
                raise ValueError(f"{entry.file}: {name!r} read as {tuple(value.shape)}")
            local.copy_(value.to(local.dtype))
        read += value.numel() * entry.dtype.itemsize
        del value
        if count % 100 == 0:
            logger.debug("loaded %d of %d tensors", count, len(plan))
    return read


def _local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's tensor to write into, and the slice of the global tensor it holds."""
    if not isinstance(tensor, DTensor):
        return tensor.detach(), ()
    (chunk,) = tensor.__create_chunk_list__()  # type: ignore[no-untyped-call]
    index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
    return tensor.to_local().detach(), index


@contextmanager
def _opened(entry: Entry) -> Iterator[Any]:
    """``safe_open`` on the very file whose header was checked (no swap in between)."""
    file = entry.file
    with open_regular(
        file, error=ValueError, holder="a pretrained model", hub_cache=True
    ) as stream:
        if identity(os.fstat(stream.fileno())) != entry.identity:
            raise ValueError(f"{file} changed after its header was checked; load it again")
        fd_path = f"/proc/self/fd/{stream.fileno()}"
        with safe_open(fd_path if os.path.exists(fd_path) else file, framework="pt") as reader:
            yield reader
