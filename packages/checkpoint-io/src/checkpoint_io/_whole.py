"""The full model state as plain tensors, and consolidation into Hugging Face's layout."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint_io._errors import CheckpointError
from checkpoint_io._model import local_fingerprint
from checkpoint_io._storage.files import read_checked
from checkpoint_io._storage.manifest import MODEL
from checkpoint_io._storage.planners import SafeLoadPlanner, SafeWholePlanner
from checkpoint_io._storage.reader import read_into
from checkpoint_io._storage.tiling import saved_entries
from hf_io import KeyMap, export_tensors


def model_fingerprint(path: str | os.PathLike[str]) -> str:
    """The full model state's ``replica_init.state_fingerprint``, read offline (one process).

    The same whatever strategy saved the same weights; reads the whole model into host memory.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        CheckpointError: If it is not a readable checkpoint.
    """
    root = Path(os.fspath(path))
    return local_fingerprint(_read_whole(root)[1].get(MODEL, {}))


def _read_whole(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest, and every entry of the checkpoint as plain tensors and values."""
    manifest, metadata, files = read_checked(root, verify=True)
    whole: dict[str, Any] = {}
    read_into(whole, files, metadata, SafeWholePlanner(), repr(str(root)))  # type: ignore[no-untyped-call]
    return manifest, whole


def consolidate_checkpoint(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    key_map: KeyMap | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    config_from: str | os.PathLike[str] | None = None,
) -> Path:
    """Write a checkpoint's model in Hugging Face's layout (offline, one process), via hf-io.

    Whatever strategy and world size saved it, the bytes ``hf_io.save_pretrained`` writes from
    the live model, read one tensor at a time and verified; transformers reads the output.

    Args:
        path: The checkpoint directory.
        out_dir: The directory to create.
        key_map: The model's names -> the names to write (hf-io's ``KeyMap``).
        max_shard_size: The largest file (``"5GB"``); above it, shards and an index.
        overwrite: Write into an existing ``out_dir`` (hf-io's rule: only its own files).
        config_from: A directory whose ``config.json`` / ``generation_config.json`` are
            copied (the pretrained model the run started from).

    Returns:
        ``out_dir`` as a ``pathlib.Path``.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        CheckpointError: If it is not a readable checkpoint.
        FileExistsError: If ``out_dir`` exists and ``overwrite`` is false.
    """
    root = Path(os.fspath(path))
    manifest, metadata, files = read_checked(root, verify=True)
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for key, storage in saved_entries(metadata, MODEL).items():
        if len(key) == 1 and isinstance(storage, TensorStorageMetadata):
            tensors[str(key[0])] = (storage.properties.dtype, tuple(storage.size))
    order = manifest["model_keys"]  # the model's state-dict order (the index has its own)
    if sorted(order) == sorted(tensors):
        tensors = {name: tensors[name] for name in order}
    tied = manifest["tied"]
    if not all(n in tensors for group in tied for n in group):
        raise CheckpointError(f"{root}'s manifest ties names the model does not have")

    def read(name: str) -> torch.Tensor:  # only its chunks, each verified
        state = {MODEL: {name: torch.empty(tensors[name][1], dtype=tensors[name][0])}}
        read_into(state, files, metadata, SafeLoadPlanner(), f"{name!r} from {str(root)!r}")
        return state[MODEL][name]

    return export_tensors(
        tensors,
        read,
        out_dir,
        tied=tuple(tuple(g) for g in tied),
        key_map=key_map,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        config_from=config_from,
    )
