"""``load_checkpoint``: into any strategy and world size, or one process; all or nothing."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from checkpoint_io._arguments import check_stateful
from checkpoint_io._collective import agree, single_process_quiet
from checkpoint_io._compat import CheckpointException
from checkpoint_io._errors import CheckpointError
from checkpoint_io._model import (
    check_model_keys,
    model_state,
    require_model_device,
    template,
)
from checkpoint_io._optimizer import (
    check_optimizer_groups,
    load_optimizer,
    optimizer_template,
    saved_param_groups,
)
from checkpoint_io._rng import rng_restore
from checkpoint_io._stateful import StatefulLoad
from checkpoint_io._stateful import plan_load as plan_stateful
from checkpoint_io._storage.files import read_checked
from checkpoint_io._storage.manifest import (
    MODEL,
    OPTIM,
    STATEFUL,
    CheckpointInfo,
    PathLike,
    info_from,
)
from checkpoint_io._storage.planners import SafeLoadPlanner, refusal
from checkpoint_io._storage.reader import SafeReader
from dist_core import compute_device, log_rank0, rank, strategy_of, world_size

logger = logging.getLogger(__name__)


def load_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    stateful: Mapping[str, Any] | None = None,
    strict: bool = True,
    rng: bool = True,
    verify: bool = True,
) -> CheckpointInfo:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (collective).

    Works under any strategy and world size (DCP reshards), or in one process without a
    process group. All or nothing: the state is read into staging (fresh tensors on the
    model's devices, one extra copy of this rank's share until the end), every check runs
    (the manifest, keys, shapes, dtypes, sizes, the index, every header, the RNG state and,
    with ``verify``, every file's checksum from the bytes read), and only then are the
    stateful objects, the model, the optimizer and the RNG changed, in that order (a stateful
    object whose ``load_state_dict`` raises is the one step that can still fail: the objects
    loaded before it are put back and nothing else has changed). On any error, I/O failures
    in the middle of the read included, they are unchanged on every rank, and every rank
    raises. Nothing in the checkpoint is code: no file is unpickled.

    Args:
        path: The checkpoint directory.
        model: The model to load into, wrapped for this run's strategy (or plain).
        optimizer: Its optimizer, built over the (wrapped) model's parameters; its state and
            hyperparameters are restored. Parameters without saved state keep none.
        stateful: Objects saved through ``save_checkpoint(stateful=...)``, by the same names.
        strict: Refuse missing or unexpected model keys; ``False`` loads the shared keys.
        rng: Set the RNG streams from the checkpoint. At the world size that saved, rank r
            gets rank r's saved state. At another world size, each rank's CPU and device
            streams are seeded from the saved states, the step and the new rank
            (:func:`derived_rng_seed`), with a warning: two resumes at the same world size
            continue identically, however the processes were seeded before the load.
        verify: Check what each rank reads against the digests recorded when it was
            written, computed from the very bytes it decodes: each record's digest (a rank
            reads only the records it needs, as DCP does) and each whole small file's (the
            index, RNG and stateful files). ``verify=False`` skips the digests; every other
            check runs.

    Returns:
        What the checkpoint says about itself.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        CheckpointError: Not a checkpoint; a newer format; missing or unexpected keys (each
            with the closest name); a shape or dtype mismatch; an optimizer or stateful object
            requested but not saved; a truncated or corrupt file; a failed verification.
        TypeError: If an argument has the wrong type.
    """
    started = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    check_stateful(stateful)
    root = Path(str(path))
    failure: BaseException | None = None
    plan: dict[str, Any] = {}
    try:
        require_model_device(model, "load_checkpoint")
        plan = _prepare(root, model, optimizer, stateful, strict=strict, rng=rng, verify=verify)
    except Exception as error:
        failure = error
    agree(failure, f"reading {str(root)!r}")
    staged = plan["target"]

    def check_staged() -> None:  # what needs the values: before the first change, every rank
        _check_staged(root, model, optimizer, plan)

    try:  # into staging: each file read once, checked from the bytes decoded
        with single_process_quiet():
            reader = SafeReader(plan["files"], plan["metadata"], check_staged)
            dcp_load(staged, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointException as error:
        refused = refusal(error)
        if refused is not None:
            raise refused from None
        raise CheckpointError(
            f"reading {str(root)!r} failed: the checkpoint is truncated or corrupt "
            f"({_last_line(error)}); nothing was loaded"
        ) from None
    # Everything read and checked on every rank: now change the state. The stateful objects
    # first: their load_state_dict is user code, the one step that may still raise (it then
    # puts back the objects it loaded), and nothing else has changed yet.
    if plan["stateful"] is not None:
        plan["stateful"].apply(stateful or {}, staged.get(STATEFUL, {}))
    set_model_state_dict(model, staged[MODEL], options=StateDictOptions(strict=strict))
    if optimizer is not None:
        load_optimizer(model, optimizer, staged[OPTIM])
    if plan["rng"] is not None:
        plan["rng"]()
    info: CheckpointInfo = plan["info"]
    log_rank0(
        logger,
        logging.INFO,
        "loaded %s (saved under %s on %d rank(s), step %s) into %s on %d rank(s) in %.2f s",
        root,
        info.strategy,
        info.world_size,
        info.step,
        strategy_of(model),
        world_size(),
        time.perf_counter() - started,
    )
    return info


def _prepare(
    root: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stateful: Mapping[str, Any] | None,
    *,
    strict: bool,
    rng: bool,
    verify: bool,
) -> dict[str, Any]:
    """Read and check everything that can be checked before the data; build the staging.

    The staging holds fresh tensors shaped like the model's and the optimizer's (on their
    devices): the load reads into it, and the model is untouched until everything was read
    and checked.
    """
    manifest, metadata, files = read_checked(root, verify=verify)
    info = _checked_info(manifest, root)  # a malformed manifest fails here, not at the end
    current = model_state(model)
    keys = check_model_keys(current, metadata, strict=strict)
    target: dict[str, Any] = {MODEL: {k: template(current[k]) for k in keys}}
    if optimizer is not None:
        if not manifest.get("optimizer"):
            raise CheckpointError(
                f"an optimizer was passed, but {str(root)!r} was saved without one; call "
                "load_checkpoint without optimizer=, or save with save_checkpoint(..., optimizer)"
            )
        target[OPTIM] = optimizer_template(model, optimizer, metadata, strict=strict)
    stateful_plan: StatefulLoad | None = None
    if stateful:
        saved = set(manifest.get("stateful") or ())
        missing = sorted(set(stateful) - saved)
        if missing:
            raise CheckpointError(
                f"stateful object(s) {missing} were not saved in {str(root)!r} (it holds "
                f"{sorted(saved)}); pass the names it was saved with"
            )
        stateful_plan = plan_stateful(
            files, manifest, stateful, rank=rank(), world_size=world_size()
        )
        if stateful_plan.targets:
            target[STATEFUL] = stateful_plan.targets
    return {
        "manifest": manifest,
        "target": target,
        "rng": rng_restore(files, manifest, compute_device(model)) if rng else None,
        "stateful": stateful_plan,
        "metadata": metadata,
        "files": files,
        "info": info,
    }


def _check_staged(
    root: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, plan: dict[str, Any]
) -> None:
    """The checks that need the values read: the optimizer's groups.

    Raises:
        CheckpointError: Other parameter groups.
    """
    staged = plan["target"]
    if optimizer is not None:
        groups = saved_param_groups(staged[OPTIM]["param_groups"])
        check_optimizer_groups(model, optimizer, groups)


def _checked_info(manifest: dict[str, Any], root: Path) -> CheckpointInfo:
    try:
        return info_from(manifest, root)
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(
            f"{root}'s manifest is malformed ({type(error).__name__}: {error}); nothing was loaded"
        ) from None


def _last_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__
