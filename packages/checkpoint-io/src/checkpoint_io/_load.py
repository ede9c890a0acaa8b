"""``load_checkpoint``: into any strategy and world size, or one process; all or nothing."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.serialization import default_restore_location

from checkpoint_io import _state
from checkpoint_io._collective import agree, single_process_quiet
from checkpoint_io._compat import CheckpointException
from checkpoint_io._digest import file_entry
from checkpoint_io._errors import CheckpointError
from checkpoint_io._files import CheckpointFiles, VerifyingReader, read_checked
from checkpoint_io._manifest import RNG_DIR, CheckpointInfo, info_from
from checkpoint_io._safe import SafeLoadPlanner, inside, load_value, unsafe_cause
from checkpoint_io._save import PathLike, check_stateful
from checkpoint_io._stateful import StatefulLoad
from checkpoint_io._stateful import plan_load as plan_stateful
from dist_core import log_rank0, rank, strategy_of, world_size
from rng_fork import RngState, derive_seed, restore_rng_state, seed_rng

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
    (the manifest, keys, shapes, dtypes, sizes, the index, each value's safety and, with
    ``verify``, every file's checksum from the bytes read), and only then are the model, the
    optimizer, the stateful objects and the RNG changed. On any error, I/O failures in the
    middle of the read included, they are unchanged on every rank, and every rank raises.

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
        verify: Check every file a rank reads against the checksum recorded when it was
            written, computed from the bytes it decodes (each file is read once; a rank that
            needs part of a file reads the rest to hash it). ``verify=False`` skips the
            checksums and reads only the records needed; every other check runs either way.

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
        _state.require_model_device(model, "load_checkpoint")
        plan = _prepare(root, model, optimizer, stateful, strict=strict, rng=rng, verify=verify)
    except Exception as error:
        failure = error
    agree(failure, f"reading {str(root)!r}")
    staged = plan["target"]
    try:  # into staging: each file read once, checked from the bytes decoded
        with single_process_quiet():
            reader = VerifyingReader(plan["files"], plan["metadata"])
            dcp_load(staged, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointException as error:
        unsafe = unsafe_cause(error)
        if unsafe is not None:
            raise unsafe from None
        raise CheckpointError(
            f"reading {str(root)!r} failed: the checkpoint is truncated or corrupt "
            f"({_first_line(error)}); nothing was loaded"
        ) from None
    failure = None
    try:  # what needs the values: checked before the first change, on every rank
        _check_staged(root, model, optimizer, plan)
    except Exception as error:
        failure = error
    agree(failure, f"verifying {str(root)!r}")
    # Everything read and checked on every rank: now change the model, optimizer, RNG.
    set_model_state_dict(model, staged[_state.MODEL], options=StateDictOptions(strict=strict))
    if optimizer is not None:
        _state.load_optimizer(model, optimizer, staged[_state.OPTIM])
    if plan["stateful"] is not None:
        plan["stateful"].apply(stateful or {}, staged.get(_state.STATEFUL, {}))
    else:
        for name, obj in (stateful or {}).items():
            obj.load_state_dict(staged[_state.STATEFUL][name])
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
    current = _state.model_state(model)
    keys = _state.check_model_keys(current, metadata, strict=strict)
    target: dict[str, Any] = {_state.MODEL: {k: _state.template(current[k]) for k in keys}}
    if optimizer is not None:
        if not manifest.get("optimizer"):
            raise CheckpointError(
                f"an optimizer was passed, but {str(root)!r} was saved without one; call "
                "load_checkpoint without optimizer=, or save with save_checkpoint(..., optimizer)"
            )
        target[_state.OPTIM] = _state.optimizer_template(model, optimizer, metadata, strict=strict)
    stateful_plan: StatefulLoad | None = None
    if stateful:
        saved = set(manifest.get("stateful") or ())
        missing = sorted(set(stateful) - saved)
        if missing:
            raise CheckpointError(
                f"stateful object(s) {missing} were not saved in {str(root)!r} (it holds "
                f"{sorted(saved)}); pass the names it was saved with"
            )
        if manifest.get("stateful_state") is not None:  # format 3: per rank, as saved
            stateful_plan = plan_stateful(
                files,
                manifest,
                stateful,
                rank=rank(),
                world_size=world_size(),
                map_location=_onto(_state.model_device(model)),
            )
            if stateful_plan.targets:
                target[_state.STATEFUL] = stateful_plan.targets
        else:  # formats 1 and 2: under one key, into the fresh state's structure
            target[_state.STATEFUL] = {
                name: _state.template(obj.state_dict()) for name, obj in stateful.items()
            }
    complete = len(keys) == len(current) == len(_state.saved_entries(metadata, _state.MODEL))
    return {
        "manifest": manifest,
        "target": target,
        "fingerprint": verify and not files.table and complete,  # format 1: the gathered one
        "rng": _rng_restore(files, manifest, _state.model_device(model)) if rng else None,
        "stateful": stateful_plan,
        "metadata": metadata,
        "files": files,
        "info": info,
    }


def _check_staged(
    root: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, plan: dict[str, Any]
) -> None:
    """The checks that need the values read: the optimizer's groups, format 1's fingerprint.

    Raises:
        CheckpointError: Other parameter groups; a fingerprint that differs.
    """
    staged = plan["target"]
    if plan["fingerprint"]:  # collective: first, on every rank alike
        found = _state.fingerprint(staged[_state.MODEL])
        recorded = plan["manifest"]["fingerprint"]
        if found != recorded:
            raise CheckpointError(
                f"verification failed for {str(root)!r}: the loaded model state has fingerprint "
                f"{found[:16]}, the checkpoint recorded {str(recorded)[:16]}; the files were "
                "changed or damaged after saving. Nothing was loaded"
            )
    if optimizer is not None:
        groups = _state.saved_param_groups(staged[_state.OPTIM]["param_groups"])
        _state.check_optimizer_groups(model, optimizer, groups)


def _checked_info(manifest: dict[str, Any], root: Path) -> CheckpointInfo:
    try:
        return info_from(manifest, root)
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(
            f"{root}'s manifest is malformed ({type(error).__name__}: {error}); nothing was loaded"
        ) from None


def _rng_restore(
    files: CheckpointFiles, manifest: Mapping[str, Any], device: torch.device
) -> Callable[[], None] | None:
    """What sets this rank's RNG after the load (read and checked now, applied last).

    At the world size that saved: rank r's saved state. At another: streams derived from
    the checkpoint (:func:`derived_rng_seed`), the same however the process was seeded.
    """
    if not manifest.get("rng"):
        return None
    root = files.root
    saved_world = int(manifest["world_size"])
    if saved_world != world_size():
        seed = derived_rng_seed(root, manifest, rank())
        log_rank0(
            logger,
            logging.WARNING,
            "%s was saved on %d rank(s) and is loaded on %d: each rank's RNG streams are "
            "derived from the checkpoint's (derive_seed(step, 'checkpoint_io.rng', the saved "
            "states' digests, rank)), not restored",
            root,
            saved_world,
            world_size(),
        )
        return lambda: seed_rng(seed, device=device)
    state = _saved_rng_state(files)
    return lambda: restore_rng_state(state)


def derived_rng_seed(root: Path, manifest: Mapping[str, Any], new_rank: int) -> int:
    """The seed of rank ``new_rank``'s streams after a load at another world size.

    ``derive_seed(step, "checkpoint_io.rng", digests, new_rank)`` (rng-fork's derivation):
    ``step`` is the checkpoint's (0 when none), ``digests`` the digests of every saved rank's
    RNG file in rank order (the manifest's; format 1: xxh3-128 of the files), so the streams
    depend on the checkpoint and the rank alone. The CPU generator and this rank's device
    generator are seeded with it (rng-fork's ``seed_rng``).
    """
    files = manifest.get("files") or {}
    parts = []
    for saved_rank in range(int(manifest["world_size"])):
        name = f"{RNG_DIR}/rank{saved_rank}.pt"
        entry = files.get(name)
        if entry is not None:
            parts.append(str(entry.get("xxh3_128") or entry.get("wsum64")))
        else:
            file = inside(root, name, source=str(root / "checkpoint.json"))
            parts.append(file_entry(file)["xxh3_128"])
    step = manifest.get("step")
    return derive_seed(
        step if isinstance(step, int) and step >= 0 else 0,
        "checkpoint_io.rng",
        "/".join(parts),
        new_rank,
    )


def _saved_rng_state(files: CheckpointFiles) -> RngState:
    name = f"{RNG_DIR}/rank{rank()}.pt"
    file = files.root / name
    state: RngState = load_value(files.read(name), f"the RNG state {file}", "cpu")
    if not isinstance(state, dict) or not isinstance(state.get("cpu"), torch.Tensor):
        raise CheckpointError(
            f"{file} holds a {type(state).__name__}, not an RNG state; the checkpoint is "
            "corrupt. Nothing was loaded"
        )
    device = state.get("device")
    if device is not None:
        current = _current_index(device["type"])
        if current is None:
            logger.warning(
                "%s holds the RNG state of %s:%d, and this process has no %s device; only the "
                "CPU stream is restored",
                file,
                device["type"],
                device["index"],
                device["type"],
            )
            state = {**state, "device": None}
        elif current != device["index"]:  # this rank's device now, whatever index saved it
            logger.debug(
                "%s: the %s RNG state saved from index %d goes to this rank's device %d",
                file,
                device["type"],
                device["index"],
                current,
            )
            state = {**state, "device": {**device, "index": current}}
    return state


def _onto(device: torch.device) -> Any:
    """``torch.load``'s ``map_location``: host tensors stay, device tensors go to ``device``.

    For a state saved on another rank's GPU, or from a GPU into a CPU process.
    """

    def remap(storage: Any, location: str) -> Any:
        if location == "cpu":
            return storage
        return default_restore_location(storage, str(device))  # type: ignore[no-untyped-call]

    return remap


def _current_index(kind: str) -> int | None:
    """This process's current device index of accelerator type ``kind``, or ``None``."""
    module = getattr(torch, kind, None)
    if module is None or not module.is_available() or module.device_count() < 1:
        return None
    return int(module.current_device())


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__
