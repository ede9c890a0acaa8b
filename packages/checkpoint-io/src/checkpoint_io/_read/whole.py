"""The full model state as plain tensors, and consolidation into one ``torch.save`` file."""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from checkpoint_io import _compat
from checkpoint_io._errors import CheckpointError
from checkpoint_io._format.manifest import MODEL, OPTIM
from checkpoint_io._read.files import read_checked
from checkpoint_io._read.planner import SafeWholePlanner, refusal
from checkpoint_io._read.storage import SafeReader
from checkpoint_io._state.model import local_fingerprint


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


def consolidate_checkpoint(path: str | os.PathLike[str], out_file: str | os.PathLike[str]) -> Path:
    """Write one ``torch.save`` file of plain tensors from a checkpoint (offline, one process).

    The file holds ``{"model": ..., "optimizer": ..., "step": ..., "extra": ...}`` and loads
    with ``torch.load(out_file, weights_only=True)``; ``model.load_state_dict(obj["model"])``
    restores a plain model. ``optimizer`` is keyed by parameter name (``None`` if none was
    saved). Written to a temporary file and renamed, so a failure leaves no partial file.

    Args:
        path: The checkpoint directory.
        out_file: The file to write.

    Returns:
        ``out_file`` as a ``pathlib.Path``.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        CheckpointError: If it is not a readable checkpoint.
    """
    root = Path(os.fspath(path))
    manifest, everything = _read_whole(root)
    optimizer = everything.get(OPTIM)
    if optimizer is not None:
        groups = optimizer["param_groups"]
        if isinstance(groups, io.BytesIO):
            groups.seek(0)
            groups = torch.load(groups, weights_only=True, map_location="cpu")
        optimizer = {"state": optimizer.get("state", {}), "param_groups": groups}
    result: dict[str, Any] = {
        "model": everything.get(MODEL, {}),
        "optimizer": optimizer,
        "step": manifest.get("step"),
        "extra": manifest.get("extra") or {},
    }
    out = Path(os.fspath(out_file))
    partial = out.with_name(f".{out.name}.partial")
    try:
        torch.save(result, partial)
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    return out
