"""``stateful=`` objects: each rank's own state back to its own rank, whatever its shape.

DCP keeps one copy of a value that is not a ``DTensor``: a per-rank state saved under one key
(a streaming dataset's offset, a loader over a per-rank shard, a sampler's generator) came
back as one rank's on every rank, silently. And DCP loads into the structure of the fresh
object's ``state_dict()``: a fresh state of another shape (``None`` for a dict, ``{}``, a
shorter list, a data loader before its first batch) failed to load.

Here each object's state is split: its ``DTensor`` leaves (an EMA model under FSDP) go
through DCP, sharded and resharded as the model's; everything else (plain tensors included)
is this rank's own value, saved ``torch.save``-style in ``stateful/rank<r>.pt`` (one file per
rank, written only by ranks whose state differs from rank 0's) and read back ``weights_only``
as saved, into whatever the fresh object holds. The manifest records each object's class and
a digest of every rank's state, so a load at another world size knows whether the state was
the same on every rank (it then loads everywhere) or not (refused, naming the object).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from checkpoint_io._errors import CheckpointError
from checkpoint_io._safe import load_value, safe_bytes

if TYPE_CHECKING:
    from checkpoint_io._files import CheckpointFiles

STATEFUL_DIR = "stateful"
_MARK = "__checkpoint_io_sharded__"  # a DTensor leaf's place in the per-rank state


@dataclasses.dataclass
class StatefulParts:
    """What one rank saves of its ``stateful=`` objects.

    Attributes:
        sharded: Per object, its ``DTensor`` leaves by their key (what DCP writes).
        blob: This rank's per-rank states (``{name: state with markers}``), serialized.
        digests: Per object, the digest of this rank's per-rank state.
        classes: Per object, its class.
        everyone: Every rank's ``digests``, by rank (set once the ranks agreed).
    """

    sharded: dict[str, dict[str, DTensor]]
    blob: bytes
    digests: dict[str, str]
    classes: dict[str, str]
    everyone: list[dict[str, str]] = dataclasses.field(default_factory=list)

    def writes_file(self, rank: int) -> bool:
        """Whether ``rank`` writes its file: rank 0 always, another when its state differs."""
        return rank == 0 or self.everyone[rank] != self.everyone[0]

    def manifest(self) -> dict[str, Any]:
        """``checkpoint.json``'s ``stateful_state``: class, sharded keys, per-rank digests."""
        return {
            name: {
                "class": self.classes[name],
                "sharded": sorted(self.sharded.get(name, {})),
                "digests": [each[name] for each in self.everyone],
            }
            for name in sorted(self.classes)
        }


def file_name(rank: int) -> str:
    """The per-rank state file of ``rank``, relative to the checkpoint."""
    return f"{STATEFUL_DIR}/rank{rank}.pt"


def collect(stateful: Mapping[str, Any]) -> StatefulParts:
    """Split every object's state into DCP's part and this rank's own part.

    Raises:
        TypeError: If a value could not be read back safely (``weights_only``), naming the
            object; before anything is written.
    """
    sharded: dict[str, dict[str, DTensor]] = {}
    local: dict[str, Any] = {}
    digests: dict[str, str] = {}
    classes: dict[str, str] = {}
    for name, obj in stateful.items():
        found: dict[str, DTensor] = {}
        local[name] = _split(obj.state_dict(), (), found)
        if found:
            sharded[name] = found
        # Checked and hashed from one serialization of a host copy: equal states on
        # different GPUs give one digest.
        data = safe_bytes(_on_host(local[name]), f"stateful[{name!r}] ({type(obj).__name__})")
        digests[name] = hashlib.sha256(data).hexdigest()[:32]
        classes[name] = _class_name(obj)
    buffer = io.BytesIO()
    torch.save(local, buffer)
    return StatefulParts(sharded, buffer.getvalue(), digests, classes)


def _split(value: Any, path: tuple[str, ...], found: dict[str, DTensor]) -> Any:
    """``value`` with each ``DTensor`` leaf replaced by a marker; the leaves into ``found``.

    Raises:
        TypeError: A state that uses the marker's key itself, or two sharded leaves whose
            paths read the same (``{1: ..., "1": ...}``).
    """
    if isinstance(value, DTensor):
        key = "/".join(path) or "."
        if key in found:
            raise TypeError(
                f"two sharded tensors of the state sit at paths that read the same ({key!r}); "
                "give their keys distinct names"
            )
        found[key] = value
        return {_MARK: key}
    if isinstance(value, Mapping):
        if _MARK in value:
            raise TypeError(f"a state may not use the key {_MARK!r} (checkpoint-io's own)")
        items = [(k, _split(v, (*path, str(k)), found)) for k, v in value.items()]
        return (
            collections.OrderedDict(items)
            if type(value) is collections.OrderedDict
            else dict(items)
        )
    if isinstance(value, list | tuple) and not _is_namedtuple(value):
        items = [_split(v, (*path, str(i)), found) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value  # serialized in collect(), before the object can change it


def _join(value: Any, sharded: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_MARK}:
            return sharded[value[_MARK]]
        return type(value)((k, _join(v, sharded)) for k, v in value.items())
    if isinstance(value, list | tuple) and not _is_namedtuple(value):
        items = [_join(v, sharded) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _on_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _on_host(v) for k, v in value.items()}
    if isinstance(value, list | tuple) and not _is_namedtuple(value):
        return [_on_host(v) for v in value]
    return value


def _class_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


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
        """Give every object its state as saved (``loaded``: what DCP filled in)."""
        for name, obj in stateful.items():
            obj.load_state_dict(_join(self.local[name], loaded.get(name, {})))


def plan_load(
    files: CheckpointFiles,
    manifest: Mapping[str, Any],
    stateful: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    map_location: Callable[[Any, str], Any] | None = None,
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
        if entry["class"] != _class_name(obj):
            raise CheckpointError(
                f"stateful[{name!r}] was saved from a {entry['class']} and is now a "
                f"{_class_name(obj)}: a different object, not a different state; pass the "
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
        file = files.root / file_name(source)
        data = files.read(file_name(source))
        everything = load_value(
            io.BytesIO(data), f"the stateful state of rank {source} ({file})", map_location
        )
        for name in names:
            if name not in everything:
                raise CheckpointError(f"{file} lacks the state of stateful[{name!r}]")
            local[name] = everything[name]
    targets: dict[str, dict[str, torch.Tensor]] = {}
    for name, obj in stateful.items():
        keys = saved[name]["sharded"]
        if not keys:
            continue
        fresh: dict[str, DTensor] = {}
        _split(obj.state_dict(), (), fresh)
        missing = [key for key in keys if key not in fresh]
        if missing:
            raise CheckpointError(
                f"stateful[{name!r}] was saved with sharded tensors at {missing} and its "
                "state now has none there: build it sharded as it was saved (e.g. the EMA "
                "model wrapped like the model) before loading"
            )
        targets[name] = {key: torch.empty_like(fresh[key]) for key in keys}
    return StatefulLoad(local, targets)
