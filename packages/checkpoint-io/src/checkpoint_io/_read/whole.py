"""The full model state as plain tensors, and consolidation into Hugging Face's layout."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from checkpoint_io import _compat
from checkpoint_io._errors import CheckpointError
from checkpoint_io._format.manifest import MODEL
from checkpoint_io._read.files import read_checked
from checkpoint_io._read.planner import SafeWholePlanner, refusal
from checkpoint_io._read.saved import saved_model
from checkpoint_io._read.storage import SafeReader
from checkpoint_io._state.model import local_fingerprint
from hf_io import KeyMap, export_tensors


def model_fingerprint(path: str | os.PathLike[str]) -> str:
    """The full model state's ``replica_init.state_fingerprint``, read offline (one process).

    Strategy-independent: the same for a checkpoint saved under DDP, FSDP or one process
    when the weights are the same. Reads the whole model into host memory.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        CheckpointError: If it is not a readable checkpoint.
    """
    root = Path(os.fspath(path))
    return local_fingerprint(_read_whole(root)[1].get(MODEL, {}))


def _read_whole(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest, and every entry of the checkpoint as plain tensors and values.

    The index is read without running code and every value ``weights_only``
    (:mod:`checkpoint_io._format.values`); an unsafe one raises :class:`CheckpointError`.
    """
    manifest, metadata, files = read_checked(root, verify=True)  # each file's digest as it is read
    whole: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            _compat.load_in_process(whole, SafeReader(files, metadata), SafeWholePlanner())  # type: ignore[no-untyped-call]
    except CheckpointError:
        raise
    except (Exception, _compat.CheckpointException) as error:  # the latter: a BaseException
        unsafe = refusal(error)
        if unsafe is not None:
            raise unsafe from None
        raise CheckpointError(f"reading {str(root)!r} failed ({error})") from None
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

    Whatever strategy and world size saved it: ``model.safetensors`` (or shards and their
    index), the same bytes ``hf_io.save_pretrained`` writes from the live model (ties once,
    under their first name, in the model's state-dict order), read one tensor at a time and
    verified. transformers' ``from_pretrained`` reads the output (with ``config_from``'s
    ``config.json``).

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
    saved = saved_model(path)
    return export_tensors(
        saved.tensors,
        saved.read,
        out_dir,
        tied=saved.tied,
        key_map=key_map,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        config_from=config_from,
    )
