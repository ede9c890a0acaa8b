"""The read half of ``stateful=``: each object's saved state for this rank, checked, then given.

See :mod:`checkpoint_io._state.stateful` for what is saved where.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from checkpoint_io._errors import CheckpointError, shown
from checkpoint_io._format.manifest import stateful_file
from checkpoint_io._read.files import CheckpointFiles
from checkpoint_io._state.stateful import class_name, join_sharded, split_sharded
from safe_store import header_of, loads, tensor_of

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StatefulLoad:
    """What a load of ``stateful=`` objects reads before anything changes.

    Attributes:
        local: Per object, its per-rank state as saved (markers where DTensors go).
        targets: Per object, the DCP targets of its ``DTensor`` leaves (fresh tensors).
    """

    local: dict[str, Any]
    targets: dict[str, dict[str, torch.Tensor]]

    def apply(self, stateful: Mapping[str, Any], loaded: Mapping[str, Any]) -> None:
        """Give every object its state as saved (``loaded``: what DCP filled in).

        All or nothing: if an object's ``load_state_dict`` raises, the objects already given
        their state get back the state they had, and the error is raised.
        """
        before: list[tuple[Any, Any]] = []
        try:
            for name, obj in stateful.items():
                before.append((obj, copy.deepcopy(obj.state_dict())))
                obj.load_state_dict(join_sharded(self.local[name], loaded.get(name, {})))
        except BaseException:
            for obj, state in reversed(before):  # the failing one too: it may be half-loaded
                try:
                    obj.load_state_dict(state)
                except Exception:
                    logger.warning("could not put back the state of %s", type(obj).__name__)
            raise


def plan_load(
    files: CheckpointFiles,
    manifest: Mapping[str, Any],
    stateful: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
) -> StatefulLoad:
    """Check and read every object's saved state for this rank (format 3).

    Raises:
        CheckpointError: An object saved as another class; a state that differed between
            the ranks that saved it, loaded at another world size; a sharded leaf that the
            fresh object lacks; an unsafe or unreadable file.
    """
    saved: Mapping[str, Any] = manifest["stateful_state"]
    saved_world = int(manifest["world_size"])
    file_of: dict[str, int] = {}
    for name, obj in stateful.items():
        entry = saved[name]
        if entry["class"] != class_name(obj):
            raise CheckpointError(
                f"stateful[{name!r}] was saved from a {entry['class']} and is now a "
                f"{class_name(obj)}: a different object, not a different state; pass the "
                "kind of object that was saved under this name, or leave it out of stateful="
            )
        digests = entry["digests"]
        if saved_world == world_size:
            source = rank
        elif len(set(digests)) == 1:
            source = 0
        else:
            differing = [r for r, d in enumerate(digests) if d != digests[0]]
            raise CheckpointError(
                f"stateful[{name!r}] ({type(obj).__name__}) held a different state on each "
                f"of the {saved_world} ranks that saved it (ranks {differing} differ from rank "
                f"0), and is loaded on {world_size}: there is no right way to split it. Leave "
                "it out of stateful= to start it fresh, or keep the data position in "
                "sample-order, where it is the step. Nothing was loaded"
            )
        file_of[name] = source if digests[source] != digests[0] else 0
    local: dict[str, Any] = {}
    for source in sorted(set(file_of.values())):
        names = [name for name, where in file_of.items() if where == source]
        everything = read_states(files, source)
        for name in names:
            if name not in everything:
                raise CheckpointError(
                    f"{files.root / stateful_file(source)} lacks the state of stateful[{name!r}]"
                )
            local[name] = everything[name]
    targets: dict[str, dict[str, torch.Tensor]] = {}
    for name, obj in stateful.items():
        keys = saved[name]["sharded"]
        if not keys:
            continue
        fresh: dict[str, DTensor] = {}
        split_sharded(obj.state_dict(), (), fresh)
        missing = [key for key in keys if key not in fresh]
        if missing:
            raise CheckpointError(
                f"stateful[{name!r}] was saved with sharded tensors at {missing} and its "
                "state now has none there: build it sharded as it was saved (e.g. the EMA "
                "model wrapped like the model) before loading"
            )
        targets[name] = {key: torch.empty_like(fresh[key]) for key in keys}
    return StatefulLoad(local, targets)


def read_states(files: CheckpointFiles, source: int) -> dict[str, Any]:
    """Every object's state in rank ``source``'s stateful file (checked, no code run).

    Raises:
        CheckpointError: A file that is not safetensors, or whose JSON is malformed.
    """
    name = stateful_file(source)
    file = files.root / name
    data = files.read(name)
    try:
        header = header_of(data, Path(file))
        text = header.metadata.get("state")
        if text is None:
            raise ValueError(f"{file} holds no state")
        pairs = loads(text, what=str(file), tensors=lambda key: _tensor(header, data, key))
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in pairs
        ):
            raise ValueError(f"{file}: its state is not a list of [name, state] pairs")
    except ValueError as error:
        raise CheckpointError(f"{error}; the checkpoint is corrupt. Nothing was loaded") from None
    return dict(pairs)


def _tensor(header: Any, data: bytes, key: str) -> torch.Tensor:
    entry = header.entries.get(key)
    if entry is None:
        raise ValueError(f"{header.file}: the state refers to a tensor {shown(key)} it lacks")
    return tensor_of(data, entry)
