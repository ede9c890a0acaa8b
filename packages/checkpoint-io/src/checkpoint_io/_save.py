"""``save_checkpoint``: atomic, collective, portable."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from checkpoint_io import _state
from checkpoint_io._collective import agree, from_rank0, single_process_quiet
from checkpoint_io._compat import CheckpointException
from checkpoint_io._errors import CheckpointError
from checkpoint_io._manifest import FORMAT, FORMAT_VERSION, RNG_DIR, write_manifest
from dist_core import log_rank0, rank, strategy_of, unwrap_model, world_size
from rng_fork import capture_rng_state

logger = logging.getLogger(__name__)

# One worker thread computes the fingerprint of a local (unsharded) state while DCP writes.
_HASHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash")

PathLike = str | os.PathLike[str]


def save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    stateful: Mapping[str, Any] | None = None,
    rng: bool = True,
    overwrite: bool = False,
) -> Path:
    """Save ``model`` (and the optimizer, other state, every rank's RNG) to a directory.

    Collective: every rank of the default group calls it; without a process group it runs in
    one process. The directory holds the ``torch.distributed.checkpoint`` files (each rank
    writes its shards; replicated tensors are written once), ``checkpoint.json`` and, with
    ``rng``, each rank's RNG state. Keys are the plain model's ``state_dict()`` keys whatever
    the wrapping (DDP, FSDP2, ``torch.compile``), and the optimizer state is keyed by
    parameter name, so the checkpoint loads under any strategy and world size.

    Atomic: everything is written to a temporary sibling directory, which is renamed to
    ``path`` once every rank has finished. If any rank fails, every rank raises, an existing
    checkpoint at ``path`` is left intact and no partial directory is left behind.

    Args:
        path: The checkpoint directory to create.
        model: A plain module, a DDP wrapper (ours or torch's), an FSDP2 model, or any of
            them under ``torch.compile``.
        optimizer: Its optimizer, if it is to be resumed too.
        step: The training step, returned by ``load_checkpoint`` in ``CheckpointInfo.step``.
        extra: A JSON-serialisable mapping stored in ``checkpoint.json``.
        stateful: Other objects with ``state_dict()`` / ``load_state_dict()`` (LR scheduler,
            EMA module, sampler), by name.
        rng: Save every rank's RNG state (CPU and this rank's device).
        overwrite: Replace an existing checkpoint at ``path`` (only once the new one is
            complete).

    Returns:
        ``path`` as a ``pathlib.Path``.

    Raises:
        TypeError: If an argument has the wrong type (named in the message).
        FileExistsError: If ``path`` exists and ``overwrite`` is false.
        CheckpointError: If writing failed on any rank (the rank and its error are named).
    """
    target = _check_arguments(path, model, optimizer, step, extra, stateful)
    exists = from_rank0(target.exists())
    if exists and not overwrite:
        raise FileExistsError(
            f"{str(target)!r} already exists; pass overwrite=True to replace it (the old "
            "checkpoint is removed only once the new one is complete), or choose a new path"
        )
    token = from_rank0(uuid.uuid4().hex[:12])
    partial = target.parent / f".{target.name}.partial-{token}"
    started = time.perf_counter()
    try:
        _write(partial, target, model, optimizer, step, extra, stateful, rng)
    except BaseException:
        if rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    log_rank0(
        logger,
        logging.INFO,
        "saved %s (%s, %d rank(s), step %s) in %.2f s",
        target,
        strategy_of(model),
        world_size(),
        step,
        time.perf_counter() - started,
    )
    return target


def _write(
    partial: Path,
    target: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
    extra: Mapping[str, Any] | None,
    stateful: Mapping[str, Any] | None,
    rng: bool,
) -> None:
    state: dict[str, Any] = {}
    failure: BaseException | None = None
    try:
        _state.require_model_device(model, "save_checkpoint")
        state[_state.MODEL] = _state.model_state(model)
        if optimizer is not None:
            state[_state.OPTIM] = _state.optimizer_state(model, optimizer)
        if stateful:
            state[_state.STATEFUL] = {name: obj.state_dict() for name, obj in stateful.items()}
    except Exception as error:
        failure = error
    agree(failure, "collecting the state to save")
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size(),
        "strategy": strategy_of(model),
        "torch_version": torch.__version__,
        "model_class": _state.model_class(model),
        "parameters": sum(p.numel() for p in unwrap_model(model).parameters()),
        "fingerprint": "",
        "optimizer": optimizer is not None,
        "stateful": sorted(stateful or {}),
        "rng": rng,
        "extra": dict(extra or {}),
    }
    model_state = state[_state.MODEL]
    digest: concurrent.futures.Future[str] | None = None
    if _state.is_sharded(model_state):  # gathers shards: collectives, before DCP's own
        manifest["fingerprint"] = _state.fingerprint(model_state)
    elif rank() == 0:  # hashing releases the GIL: overlap it with the write
        digest = _HASHER.submit(_state.local_fingerprint, model_state)
    try:
        with single_process_quiet():
            dcp_save(state, checkpoint_id=str(partial))
    except CheckpointException as error:  # a BaseException: make it an Exception
        raise CheckpointError(f"writing {str(target)!r} failed: {error}") from None
    finally:
        if digest is not None:
            manifest["fingerprint"] = digest.result()
    failure = None
    try:
        if rng:
            (partial / RNG_DIR).mkdir(parents=True, exist_ok=True)
            device = _state.model_device(model)
            torch.save(capture_rng_state(device), partial / RNG_DIR / f"rank{rank()}.pt")
    except Exception as error:
        failure = error
    agree(failure, "saving the RNG states")
    failure = None
    if rank() == 0:
        try:
            write_manifest(partial, manifest)
            _publish(partial, target)
        except Exception as error:
            failure = error
    agree(failure, f"publishing {str(target)!r}")


def _publish(partial: Path, target: Path) -> None:
    """Rename the complete checkpoint into place; an old one goes only after that."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{partial.name.rsplit('-', 1)[1]}"
        target.rename(old)
    try:
        partial.rename(target)
    except BaseException:
        if old is not None:
            old.rename(target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _check_arguments(
    path: object,
    model: object,
    optimizer: object,
    step: object,
    extra: object,
    stateful: object,
) -> Path:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} ({path!r})")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"step must be an int or None, got {type(step).__name__} ({step!r})")
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise TypeError(f"extra must be a mapping or None, got {type(extra).__name__}")
        try:
            json.dumps(dict(extra))
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"extra must be JSON-serialisable (it goes into checkpoint.json): {error}; "
                "store tensors and other objects through stateful= instead"
            ) from None
    check_stateful(stateful)
    return Path(os.fspath(path))


def check_stateful(stateful: object) -> None:
    """``stateful`` is ``None`` or a mapping of names to objects with both state methods."""
    if stateful is None:
        return
    if not isinstance(stateful, Mapping):
        raise TypeError(
            f"stateful must be a mapping of names to objects, got {type(stateful).__name__}"
        )
    for name, obj in stateful.items():
        if not isinstance(name, str):
            raise TypeError(f"stateful keys must be strings, got {name!r}")
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"stateful[{name!r}] is a {type(obj).__name__}, which lacks state_dict() and "
                "load_state_dict(); pass an object with both (LR scheduler, module, sampler)"
            )
