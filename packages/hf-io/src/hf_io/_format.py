"""Hugging Face's safetensors layout: file names, dtype codes, shard sizes.

The one owner of what ``save_pretrained`` writes and ``from_pretrained`` reads: a single
``model.safetensors``, or ``model-00001-of-0000N.safetensors`` shards with
``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map": {name:
file}}``), each file headed by ``{"__metadata__": {"format": "pt"}}``.
"""

from __future__ import annotations

import re

import torch

from safe_store import CODES

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json")
FILE_METADATA = {"format": "pt"}
HEADER_ALIGNMENT = 8
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def earlier_output(name: str) -> bool:
    """Whether a file in an output directory is one ``save_pretrained`` writes and replaces.

    The weights, their shards and index, the configs.
    transformers removes stale ``model-XXXXX-of-YYYYY`` shards the same way and touches
    nothing else in the directory.
    """
    return name in (SINGLE_FILE, INDEX_FILE, *CONFIG_FILES) or _SHARD.fullmatch(name) is not None


def shard_file_name(index: int, count: int) -> str:
    """``model-00001-of-00003.safetensors`` (``index`` from 1), as transformers names shards."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def code_of(dtype: torch.dtype, name: str) -> str:
    """The safetensors dtype code of ``dtype`` (``F32``, ``BF16``, ``I64``, ...).

    Raises:
        ValueError: If safetensors has no code for it (complex, unsigned beyond uint8).
    """
    try:
        return CODES[dtype]
    except KeyError:
        raise ValueError(
            f"{name!r} has dtype {dtype}, which safetensors cannot store; cast it to one of "
            f"{sorted(str(d) for d in CODES)} or leave it out with key_map"
        ) from None


def parse_size(max_shard_size: int | str) -> int:
    """Bytes from ``5GB``, ``500MiB`` or an int, as transformers reads ``max_shard_size``.

    Raises:
        ValueError: If it is not a positive size (the value is named).
    """
    if isinstance(max_shard_size, bool):
        raise ValueError(
            f"max_shard_size must be a size like '5GB' or bytes, got {max_shard_size!r}"
        )
    if isinstance(max_shard_size, int):
        size = max_shard_size
    else:
        match = _SIZE.match(str(max_shard_size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"max_shard_size must be a size like '5GB', '500MB', '2GiB' or a number of "
                f"bytes, got {max_shard_size!r}"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    return size
