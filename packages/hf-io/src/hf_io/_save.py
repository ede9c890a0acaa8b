"""``save_pretrained``: a live model (plain, DDP, FSDP, HSDP) out in transformers' layout."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from dist_core import agree, is_distributed, log_rank0, unwrap_model
from hf_io._format import CONFIG_FILES, INDEX_FILE, earlier_output, parse_size
from hf_io._layout import Layout, plan_layout
from hf_io._names import KeyMap, model_targets, rename
from hf_io._write import create_files, write_part
from safe_store import abandon, begin, check_target, output_dir, publish, staging_dir

logger = logging.getLogger(__name__)

Part = tuple[torch.Tensor, tuple[int, ...]]
"""A slice of a tensor this process writes, and its offsets in the whole tensor."""

_KINDS = {"FileExistsError": FileExistsError, "ValueError": ValueError, "TypeError": TypeError}


def save_pretrained(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    key_map: KeyMap | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write ``model``'s weights as transformers' ``save_pretrained`` does, without a gather.

    Collective when a process group is initialized: every rank calls it, and every rank writes
    only what it holds (an FSDP2 rank its shards' rows, straight into their place in the
    file; one replica of HSDP; DDP's replicated tensors spread over the ranks), so no rank
    gathers the model. The output directory needs a filesystem every rank sees. A tie is
    written once, under its first name in the model's order; integer and bool buffers are
    kept; non-persistent buffers are not written. Files are fsynced and the directory
    appears by one rename, so a failure leaves no partial output.

    Args:
        model: Plain, DDP, FSDP2 or HSDP, possibly compiled.
        out_dir: The directory to create.
        key_map: The model's names -> the names to write: a mapping (names it lacks are
            kept) or a callable (``None`` leaves a tensor out).
        max_shard_size: The largest file (``"5GB"``, ``"500MB"``, ``"2GiB"`` or bytes); above
            it the output is sharded, with ``model.safetensors.index.json``.
        overwrite: Write into an existing ``out_dir``: the files ``save_pretrained`` writes
            (weights, shards, index, configs) are replaced and stale shards removed, as
            transformers does; nothing else there is touched.

    Returns:
        ``out_dir`` as a ``pathlib.Path``.

    Raises:
        FileExistsError: If ``out_dir`` exists and ``overwrite`` is false.
        ValueError, TypeError: Bad arguments (named), or a dtype safetensors cannot store.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)
    targets = model_targets(model)

    def describe() -> list[tuple[str, torch.Tensor]]:
        names = rename([t.name for t in targets], key_map, "key_map")
        by_name = {t.name: t.tensor for t in targets}
        return [(file_name, by_name[model_name]) for file_name, model_name in names.items()]

    def parts(tensor: torch.Tensor, index: int) -> Iterator[Part]:
        if isinstance(tensor, DTensor):
            if _first_replica(tensor):
                (chunk,) = tensor.__create_chunk_list__()  # type: ignore[no-untyped-call]
                yield tensor.to_local(), tuple(chunk.offsets)
        elif index % world == rank:
            yield tensor, (0,) * tensor.dim()

    return write_pretrained(
        out_dir,
        describe,
        parts,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        collective=is_distributed(),
        extra_files=config_files(unwrap_model(model)),
    )


def config_files(model: object) -> dict[str, bytes]:
    """``config.json`` and ``generation_config.json`` of a transformers model, as it saves them.

    Empty for other models: the output then holds the weights only.
    """
    files = {}
    for attribute, file in (("config", CONFIG_FILES[0]), ("generation_config", CONFIG_FILES[1])):
        config = getattr(model, attribute, None)
        if callable(getattr(config, "to_json_string", None)):
            files[file] = config.to_json_string(use_diff=True).encode()  # type: ignore[union-attr]
    return files


def write_pretrained(
    out_dir: str | os.PathLike[str],
    describe: Callable[[], list[tuple[str, torch.Tensor]]],
    parts: Callable[[torch.Tensor, int], Iterable[Part]],
    *,
    max_shard_size: int | str,
    overwrite: bool,
    collective: bool,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Plan, create, fill and publish the output; every rank raises if any rank failed.

    Args:
        out_dir: The directory to create.
        describe: The tensors to write, ``(name in the file, tensor or template)``, in order
            (the same on every rank).
        parts: What this process writes of the ``index``-th tensor.
        max_shard_size: As for :func:`save_pretrained`.
        overwrite: As for :func:`save_pretrained`.
        collective: Whether every rank of the default group takes part.
        extra_files: Other files to publish with the weights (``config.json``).
    """
    lead = not collective or dist.get_rank() == 0
    start = time.perf_counter()
    error: Exception | None = None
    layout: Layout | None = None
    out: Path | None = None
    written = 0
    try:
        out = output_dir(out_dir)
        if not isinstance(overwrite, bool):
            raise TypeError(f"overwrite must be a bool, got {type(overwrite).__name__}")
        size = parse_size(max_shard_size)
        tensors = describe()
        layout = plan_layout([(n, t.dtype, tuple(t.shape)) for n, t in tensors], size)
        if lead:
            check_target(out, overwrite)
            create_files(begin(out), layout)
    except Exception as failure:
        error = failure
    _agree(error, "preparing the output", collective, out, lead)
    assert layout is not None and out is not None
    folder = staging_dir(out)
    try:
        for index, (name, tensor) in enumerate(tensors):
            for part, offsets in parts(tensor, index):
                written += write_part(folder, layout, name, part, offsets)
    except Exception as failure:
        error = failure
    _agree(error, "writing the output", collective, out, lead)
    try:
        if lead:
            index_bytes = layout.index()
            if index_bytes is not None:
                (folder / INDEX_FILE).write_bytes(index_bytes)
            for file, content in (extra_files or {}).items():
                (folder / file).write_bytes(content)
            publish(folder, out, stale=earlier_output)
    except Exception as failure:
        error = failure
    _agree(error, "publishing the output", collective, out, lead)
    log_rank0(
        logger,
        logging.INFO,
        "wrote %s: %d tensors in %d file(s), %.1f MB, in %.2f s (this rank wrote %.1f MB)",
        out,
        len(layout.placed),
        len(layout.files),
        layout.total_size / 1e6,
        time.perf_counter() - start,
        written / 1e6,
    )
    return out


def _agree(
    error: Exception | None, what: str, collective: bool, out: Path | None, lead: bool
) -> None:
    try:
        if collective:
            agree(error, what, kinds=_KINDS)
        elif error is not None:
            raise error
    except BaseException:
        if lead and out is not None:
            abandon(out)
        raise


def _first_replica(tensor: DTensor) -> bool:
    """Whether this rank is replica 0 on every mesh dimension ``tensor`` is replicated over."""
    mesh = tensor.device_mesh
    return all(
        mesh.get_local_rank(dim) == 0
        for dim, placement in enumerate(tensor.placements)
        if isinstance(placement, Replicate)
    )
