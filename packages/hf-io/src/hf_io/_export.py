"""``export_checkpoint``: a checkpoint-io checkpoint out in transformers' layout, offline."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch

from checkpoint_io import saved_model
from dist_core import read_regular
from hf_io._format import CONFIG_FILES
from hf_io._names import KeyMap, rename
from hf_io._save import Part, write_pretrained


def export_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    key_map: KeyMap | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    config_from: str | os.PathLike[str] | None = None,
) -> Path:
    """Write a checkpoint's model as ``save_pretrained`` would have, one tensor at a time.

    Offline and in one process, whatever strategy and world size saved the checkpoint: the
    files are the same bytes ``save_pretrained`` writes from the live model. Ties come from
    the checkpoint's manifest (each written once, under its first name); host memory holds
    one tensor at a time.

    Args:
        ckpt_dir: A checkpoint-io checkpoint directory.
        out_dir: The directory to create.
        key_map: As for :func:`save_pretrained`.
        max_shard_size: As for :func:`save_pretrained`.
        overwrite: As for :func:`save_pretrained`.
        config_from: A directory whose ``config.json`` and ``generation_config.json`` (those
            present) are copied into the output, e.g. the pretrained model the run started
            from, so that transformers' ``from_pretrained`` reads the output as it is.

    Returns:
        ``out_dir`` as a ``pathlib.Path``.

    Raises:
        FileNotFoundError: If ``ckpt_dir`` does not exist.
        checkpoint_io.CheckpointError: If it is not a readable checkpoint.
        FileExistsError: If ``out_dir`` exists and ``overwrite`` is false.
    """
    saved = saved_model(ckpt_dir)
    later = {name for group in saved.tied for name in group[1:]}
    first = [name for name in saved.tensors if name not in later]
    templates = {
        name: torch.empty(shape, dtype=dtype, device="meta")
        for name, (dtype, shape) in saved.tensors.items()
    }
    sources: dict[int, str] = {}

    def describe() -> list[tuple[str, torch.Tensor]]:
        described = []
        for file_name, name in rename(first, key_map, "key_map").items():
            sources[id(templates[name])] = name
            described.append((file_name, templates[name]))
        return described

    def parts(template: torch.Tensor, index: int) -> Iterator[Part]:
        yield saved.read(sources[id(template)]), (0,) * template.dim()

    return write_pretrained(
        out_dir,
        describe,
        parts,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        collective=False,
        extra_files=_configs_in(config_from),
    )


def _configs_in(folder: str | os.PathLike[str] | None) -> dict[str, bytes]:
    if folder is None:
        return {}
    root = Path(os.fspath(folder))
    if not root.is_dir():
        raise FileNotFoundError(f"config_from={str(root)!r} is not a directory")
    found = {
        name: read_regular(root / name, holder="a pretrained model", hub_cache=True)
        for name in CONFIG_FILES
        if (root / name).exists()
    }
    if not found:
        raise FileNotFoundError(
            f"config_from={str(root)!r} holds none of {list(CONFIG_FILES)}; pass the directory "
            "of the pretrained model the run started from"
        )
    return found
