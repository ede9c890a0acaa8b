"""``stateful=`` objects, saved and loaded: each rank's own state back to its own rank.

``DTensor`` leaves (an EMA model under FSDP) go through DCP, resharded. The rest is this
rank's own: ``stateful/rank<r>.safetensors`` (rank 0's, and each rank's that differs) holds
its tensors and, in ``__metadata__``, the rest as tagged JSON. At another world size a state
that differed between ranks is refused by name. Objects load first, all or nothing.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from checkpoint_io._errors import CheckpointError, shown
from checkpoint_io._storage.files import CheckpointFiles
from checkpoint_io._storage.manifest import stateful_file
from safe_store import dumps, header_of, loads, tensor_of

logger = logging.getLogger(__name__)

_MARK = "__checkpoint_io_sharded__"  # a DTensor leaf's place in the per-rank state


@dataclasses.dataclass
class StatefulParts:
    """What one rank saves of its ``stateful=`` objects.

    ``sharded``: each object's ``DTensor`` leaves; ``text`` and ``tensors``: the per-rank
    states; ``everyone``: every rank's digests once the ranks agreed.
    """

    sharded: dict[str, dict[str, DTensor]]
    text: str
    tensors: list[torch.Tensor]
    digests: dict[str, str]
    classes: dict[str, str]
    everyone: list[dict[str, str]] = dataclasses.field(default_factory=list)

    def writes_file(self, rank: int) -> bool:
        """Whether ``rank`` (this one) writes its file: rank 0 always, another if it differs."""
        return rank == 0 or self.digests != self.everyone[0]

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


def collect(stateful: Mapping[str, Any]) -> StatefulParts:
    """Split every object's state into DCP's part and this rank's own part.

    Raises:
        TypeError: A value the JSON codec cannot carry, named; before anything is written.
    """
    sharded: dict[str, dict[str, DTensor]] = {}
    local: dict[str, Any] = {}
    classes: dict[str, str] = {}
    for name, obj in stateful.items():
        found: dict[str, DTensor] = {}
        local[name] = split_sharded(obj.state_dict(), (), found)
        if found:
            sharded[name] = found
        classes[name] = class_name(obj)
    kinds = {name: type(obj).__name__ for name, obj in stateful.items()}
    text, tensors, digests = encode_states(local, kinds)
    return StatefulParts(sharded, text, tensors, digests, classes)


def encode_states(
    local: Mapping[str, Any], kinds: Mapping[str, str]
) -> tuple[str, list[torch.Tensor], dict[str, str]]:
    """Per-rank states as one JSON text, the host copies of their tensors, and each digest.

    Raises:
        TypeError: A value the codec cannot carry, naming the object and where it sits.
    """
    texts: dict[str, str] = {}
    tensors: list[torch.Tensor] = []
    digests: dict[str, str] = {}
    for name, state in local.items():
        own: list[torch.Tensor] = []

        def keep(
            tensor: torch.Tensor, own: list[torch.Tensor] = own, base: int = len(tensors)
        ) -> str:
            own.append(tensor.detach().to("cpu", copy=True).contiguous())
            return f"t{base + len(own) - 1}"

        texts[name] = dumps(state, what=f"stateful[{name!r}] ({kinds[name]})", tensors=keep)
        # Hashed from the JSON and host copies: equal states on different GPUs, one digest.
        digest = hashlib.sha256(texts[name].encode())
        for tensor in own:
            digest.update(str((tensor.dtype, tuple(tensor.shape))).encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
        digests[name] = digest.hexdigest()[:32]
        tensors += own
    # [[name, state], ...]: a list, so that no name is read as one of the codec's tags
    text = "[" + ",".join(f"[{dumps(n, what=n)},{t}]" for n, t in texts.items()) + "]"
    return text, tensors, digests


def split_sharded(value: Any, path: tuple[str, ...], found: dict[str, DTensor]) -> Any:
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
        items = [(k, split_sharded(v, (*path, str(k)), found)) for k, v in value.items()]
        return (
            collections.OrderedDict(items)
            if type(value) is collections.OrderedDict
            else dict(items)
        )
    if isinstance(value, list | tuple) and not _is_namedtuple(value):
        items = [split_sharded(v, (*path, str(i)), found) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value  # serialized in collect(), before the object can change it


def join_sharded(value: Any, sharded: Mapping[str, torch.Tensor]) -> Any:
    """``value`` with each marker replaced by its loaded ``DTensor`` leaf."""
    if isinstance(value, dict):
        if set(value) == {_MARK}:
            return sharded[value[_MARK]]
        return type(value)((k, join_sharded(v, sharded)) for k, v in value.items())
    if isinstance(value, list | tuple) and not _is_namedtuple(value):
        items = [join_sharded(v, sharded) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def class_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclasses.dataclass
class StatefulLoad:
    """What a load of ``stateful=`` objects read (as saved; DCP's targets) before any change."""

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
    """Check and read every object's saved state for this rank.

    Raises:
        CheckpointError: Another class; a state that differed between ranks, loaded at another
            world size; a sharded leaf the fresh object lacks; a malformed file.
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
    """Every object's state in rank ``source``'s stateful file (checked; no code is run)."""
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
