"""``export_tensors``: tensors read one at a time, out in transformers' layout, offline."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from dist_core import read_regular
from hf_io._format import CONFIG_FILES
from hf_io._names import KeyMap, rename
from hf_io._save import Part, write_pretrained


def export_tensors(
    tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    read: Callable[[str], torch.Tensor],
    out_dir: str | os.PathLike[str],
    *,
    tied: Sequence[Sequence[str]] = (),
    key_map: KeyMap | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    config_from: str | os.PathLike[str] | None = None,
) -> Path:
    """Write ``tensors`` as ``save_pretrained`` writes a model's, reading one at a time.

    In one process; host memory holds one tensor at a time. The same bytes as
    ``save_pretrained`` from the live model with the same names, order and ties.

    Args:
        tensors: Name -> ``(dtype, shape)``, in the model's state-dict order.
        read: The whole tensor of a name (called once per tensor written).
        out_dir: The directory to create.
        tied: Groups of names that are one tensor: each written once, under its first name.
        key_map: As for :func:`save_pretrained`.
        max_shard_size: As for :func:`save_pretrained`.
        overwrite: As for :func:`save_pretrained`.
        config_from: A directory whose ``config.json`` and ``generation_config.json`` (those
            present) are copied into the output, e.g. the pretrained model the run started
            from, so that transformers' ``from_pretrained`` reads the output as it is.

    Returns:
        ``out_dir`` as a ``pathlib.Path``.

    Raises:
        FileExistsError: If ``out_dir`` exists and ``overwrite`` is false.
        FileNotFoundError: If ``config_from`` holds no config.
    """
    later = {name for group in tied for name in list(group)[1:]}
    first = [name for name in tensors if name not in later]
    templates = {
        name: torch.empty(shape, dtype=dtype, device="meta")
        for name, (dtype, shape) in tensors.items()
    }
    sources: dict[int, str] = {}

    def describe() -> list[tuple[str, torch.Tensor]]:
        described = []
        for file_name, name in rename(first, key_map, "key_map").items():
            sources[id(templates[name])] = name
            described.append((file_name, templates[name]))
        return described

    def parts(template: torch.Tensor, index: int) -> Iterator[Part]:
        yield read(sources[id(template)]), (0,) * template.dim()

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
