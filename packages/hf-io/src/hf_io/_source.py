"""A pretrained model on disk: its files, their checked headers, and where each tensor lies."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from dist_core import read_regular
from hf_io._format import INDEX_FILE, SINGLE_FILE
from safe_store import Entry, Header, read_header


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """Every tensor of a pretrained model, found through checked headers.

    Attributes:
        path: What was given (a directory or one file).
        headers: Each file's checked header, in file order.
        tensors: Tensor name -> its :class:`Entry`.
    """

    path: Path
    headers: tuple[Header, ...]
    tensors: dict[str, Entry]


def open_pretrained(path: str | os.PathLike[str]) -> Pretrained:
    """Find and check the safetensors files of ``path``.

    ``path`` is a directory as ``save_pretrained`` writes it (``model.safetensors``, or shards
    with ``model.safetensors.index.json``) or one ``.safetensors`` file.

    Raises:
        FileNotFoundError: If ``path`` does not exist or holds neither layout.
        ValueError: If the index or a header is malformed, a file named by the index is not a
            plain file inside the directory, or a tensor is in two files.
    """
    root = Path(os.fspath(path))
    if not root.exists():
        raise FileNotFoundError(f"no pretrained model at {str(root)!r}: the path does not exist")
    if root.is_dir():
        if (root / INDEX_FILE).exists() or (root / INDEX_FILE).is_symlink():
            files: dict[Path, set[str] | None] = dict(_indexed_files(root))
        elif (root / SINGLE_FILE).exists() or (root / SINGLE_FILE).is_symlink():
            files = {root / SINGLE_FILE: None}
        else:
            raise FileNotFoundError(
                f"{str(root)!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}; pass the directory "
                "save_pretrained wrote or one .safetensors file"
            )
    else:
        files = {root: None}
    headers = tuple(read_header(file, hub_cache=True) for file in files)
    tensors: dict[str, Entry] = {}
    for header, expected in zip(headers, files.values(), strict=True):
        for name, entry in header.entries.items():
            if name in tensors:
                raise ValueError(
                    f"{name!r} is in both {tensors[name].file.name} and {header.file.name}; a "
                    "pretrained model holds each tensor once"
                )
            tensors[name] = entry
        if expected is not None and set(expected) != set(header.entries):
            odd = sorted(set(expected) ^ set(header.entries))[:5]
            raise ValueError(
                f"{root / INDEX_FILE}'s weight_map and {header.file.name}'s header disagree on "
                f"{odd}: the index is stale or the shard was replaced"
            )
    return Pretrained(path=root, headers=headers, tensors=tensors)


def _indexed_files(root: Path) -> dict[Path, set[str]]:
    """Each file the index names (a plain name inside ``root``) and the tensors it maps there."""
    index_file = root / INDEX_FILE
    try:
        index = json.loads(
            read_regular(index_file, holder="a pretrained model", hub_cache=True).decode("utf-8")
        )
    except (UnicodeDecodeError, RecursionError, json.JSONDecodeError) as error:
        raise ValueError(f"{index_file} is not a JSON index ({error})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f"{index_file} has no weight_map of tensor names to file names")
    files: dict[Path, set[str]] = {}
    for name, file in weight_map.items():
        if file in ("", ".", "..") or "/" in file or "\\" in file or "\x00" in file:
            raise ValueError(
                f"{index_file} maps {name!r} to {file!r}, which is not a file name inside "
                f"{str(root)!r} (refused as unsafe)"
            )
        files.setdefault(root / file, set()).add(name)
    return dict(sorted(files.items()))
