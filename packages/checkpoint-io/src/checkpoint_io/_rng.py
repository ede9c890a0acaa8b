"""The RNG streams: saved per rank, restored at the same world size, derived at another."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from checkpoint_io._errors import CheckpointError
from checkpoint_io._storage.files import CheckpointFiles
from checkpoint_io._storage.manifest import rng_file
from dist_core import log_rank0, rank, world_size
from rng_fork import RngState, check_rng_state, derive_seed, restore_rng_state, seed_rng
from safe_store import dumps, header_of, loads, tensor_of

logger = logging.getLogger(__name__)


def rng_restore(
    files: CheckpointFiles, manifest: Mapping[str, Any], device: torch.device
) -> Callable[[], None] | None:
    """What sets this rank's RNG after the load (read and checked now, applied last).

    At the world size that saved: rank r's saved state. At another: streams derived from the
    checkpoint (:func:`derived_rng_seed`), the same however the process was seeded.
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

    ``derive_seed(step, "checkpoint_io.rng", digests, new_rank)``: the checkpoint's step (0
    when none) and its RNG files' digests in rank order, so the streams depend on the
    checkpoint and the rank alone. The CPU and this rank's device generator are seeded with it.
    """
    files = manifest["files"]
    parts = [str(files[rng_file(saved)].get("xxh3_128")) for saved in range(manifest["world_size"])]
    step = manifest.get("step")
    return derive_seed(
        step if isinstance(step, int) and step >= 0 else 0,
        "checkpoint_io.rng",
        "/".join(parts),
        new_rank,
    )


def read_rng_state(files: CheckpointFiles, saved_rank: int) -> RngState:
    """Rank ``saved_rank``'s RNG state from its file (tensors, and JSON for the rest).

    Raises:
        CheckpointError: A file that is not an RNG state, or a state rng-fork would not
            restore (a 3-byte CPU state), before anything changes.
    """
    name = rng_file(saved_rank)
    file = files.root / name
    data = files.read(name)
    try:
        header = header_of(data, file)
        described = loads(header.metadata.get("rng", "null"), what=str(file))
        if not isinstance(described, dict) or set(header.entries) - {"cpu", "device"}:
            raise ValueError(f"{file} is not an RNG state")
        device = described.get("device")
        tensors = {key: tensor_of(data, entry) for key, entry in header.entries.items()}
        state: Any = {
            "format": described.get("format"),
            "cpu": tensors.get("cpu"),
            "device": None if device is None else {**device, "state": tensors.get("device")},
            "python": described.get("python"),
            "numpy": described.get("numpy"),
        }
        check_rng_state({**state, "device": None})  # the device's own: once it is placed
    except (ValueError, TypeError) as error:
        raise CheckpointError(
            f"{file}: {error}; the checkpoint is corrupt. Nothing was loaded"
        ) from None
    return state  # type: ignore[no-any-return]


def _saved_rng_state(files: CheckpointFiles) -> RngState:
    file = files.root / rng_file(rank())
    state = read_rng_state(files, rank())
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
    try:
        check_rng_state(state)
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{file}: {error}; nothing was loaded") from None
    return state


def _current_index(kind: str) -> int | None:
    """This process's current device index of accelerator type ``kind``, or ``None``."""
    module = getattr(torch, kind, None)
    if module is None or not module.is_available() or module.device_count() < 1:
        return None
    return int(module.current_device())


def rng_tensors(state: RngState) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """An RNG state as a safetensors file's tensors (uint8) and ``__metadata__`` (JSON)."""
    device = state["device"]
    tensors = [("cpu", state["cpu"])]
    if device is not None:
        tensors.append(("device", device["state"]))
    described = {
        "format": state["format"],
        "device": None if device is None else {"type": device["type"], "index": device["index"]},
        "python": state["python"],
        "numpy": state["numpy"],
    }
    return tensors, {"rng": dumps(described, what="the RNG state")}
