"""``load_checkpoint``: into any strategy and world size, or one process; all or nothing."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpoint_io._arguments import check_model_optimizer, check_stateful
from checkpoint_io._collective import agree
from checkpoint_io._errors import CheckpointError
from checkpoint_io._model import (
    check_model_keys,
    load_model,
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
from checkpoint_io._storage.planners import SafeLoadPlanner
from checkpoint_io._storage.reader import read_into
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

    Works under any strategy and world size (DCP reshards), or in one process. All or
    nothing: the state is read into staging (one extra copy of this rank's share), every
    check runs, and only then are the stateful objects, the model, the optimizer and the RNG
    changed, in that order (a stateful object whose ``load_state_dict`` raises puts back the
    ones loaded before it). On any error every rank raises and nothing has changed. No file
    is unpickled.

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
    check_model_optimizer(model, optimizer)
    check_stateful(stateful)
    root = Path(str(path))
    failure: BaseException | None = None
    plan: dict[str, Any] = {}
    try:  # into staging, on this rank alone: each file read once, checked from the bytes decoded
        require_model_device(model, "load_checkpoint")
        plan = _read(root, model, optimizer, stateful, strict=strict, rng=rng, verify=verify)
    except Exception as error:
        failure = error
    agree(failure, f"reading {str(root)!r}")
    staged = plan["target"]
    # Everything read and checked on every rank: now change the state. The stateful objects
    # first: their load_state_dict is user code, the one step that may still raise (it then
    # puts back the objects it loaded), and nothing else has changed yet.
    if plan["stateful"] is not None:
        plan["stateful"].apply(stateful or {}, staged.get(STATEFUL, {}))
    load_model(model, staged[MODEL], strict=strict)
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


def _read(
    root: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stateful: Mapping[str, Any] | None,
    *,
    strict: bool,
    rng: bool,
    verify: bool,
) -> dict[str, Any]:
    """Check everything that can be checked before the data, then read it into staging."""
    manifest, metadata, files = read_checked(root, verify=verify)
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
    restore_rng = rng_restore(files, manifest, compute_device(model)) if rng else None
    read_into(target, files, metadata, SafeLoadPlanner(), repr(str(root)))
    if optimizer is not None:  # the one check that needs the values read
        groups = saved_param_groups(target[OPTIM]["param_groups"])
        check_optimizer_groups(model, optimizer, groups)
    return {
        "target": target,
        "rng": restore_rng,
        "stateful": stateful_plan,
        "info": info_from(manifest, root),
    }
