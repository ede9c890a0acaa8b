"""The full model state as plain tensors, and consolidation into one ``torch.save`` file."""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from checkpoint_io import _compat, _state
from checkpoint_io._errors import CheckpointError
from checkpoint_io._files import VerifyingReader, read_checked
from checkpoint_io._safe import SafeWholePlanner, unsafe_cause
from dist_core import is_distributed, unwrap_model


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The canonical full state dict as plain CPU tensors, under any strategy (collective).

    Keys are the plain model's ``state_dict()`` keys; FSDP2 shards are gathered. Use it for
    ``save_pretrained``, evaluation and export.

    Args:
        model: Plain, DDP, FSDP2 or compiled.
        rank0_only: Only rank 0 receives the tensors (the others get ``{}``), so the other
            ranks need no host memory for them.

    Returns:
        ``name -> CPU tensor``, never sharing storage with the model (a later step does not
        change it, whatever the device).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not is_distributed():
        state = _state.model_state(model)
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
        state = get_model_state_dict(model, options=options)  # type: ignore[assignment]
    # Never an alias of the model's own storage (a DDP or plain model on the CPU): the
    # result is a snapshot, on the CPU as on CUDA, which training does not change.
    live = {_storage(t) for t in unwrap_model(model).state_dict().values()}
    return {k: _snapshot(v, live) for k, v in state.items()}


def _snapshot(tensor: torch.Tensor, live: set[int]) -> torch.Tensor:
    copy = tensor.detach().cpu()
    return copy.clone() if _storage(copy) in live else copy


def _storage(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return int(local.untyped_storage().data_ptr())


def model_fingerprint(path: str | os.PathLike[str]) -> str:
    """The full model state's ``replica_init.state_fingerprint``, read offline (one process).

    Strategy-independent: the same for a checkpoint saved under DDP, FSDP or one process
    when the weights are the same. Reads the whole model into host memory.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        CheckpointError: If it is not a readable checkpoint.
    """
    root = Path(os.fspath(path))
    return _state.local_fingerprint(_read_whole(root)[1].get(_state.MODEL, {}))


def _read_whole(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest, and every entry of the checkpoint as plain tensors and values.

    The index is read without running code and every value ``weights_only``
    (:mod:`checkpoint_io._safe`); an unsafe one raises :class:`CheckpointError`.
    """
    manifest, metadata, files = read_checked(root, verify=True)  # each file's digest as it is read
    whole: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            _compat.load_in_process(whole, VerifyingReader(files, metadata), SafeWholePlanner())  # type: ignore[no-untyped-call]
    except CheckpointError:
        raise
    except (Exception, _compat.CheckpointException) as error:  # the latter: a BaseException
        unsafe = unsafe_cause(error)
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
    optimizer = everything.get(_state.OPTIM)
    if optimizer is not None:
        groups = optimizer["param_groups"]
        if isinstance(groups, io.BytesIO):
            groups.seek(0)
            groups = torch.load(groups, weights_only=True, map_location="cpu")
        optimizer = {"state": optimizer.get("state", {}), "param_groups": groups}
    result: dict[str, Any] = {
        "model": everything.get(_state.MODEL, {}),
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
