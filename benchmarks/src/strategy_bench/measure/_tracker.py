"""The live-tensor bytes of one rank over a training step: its peak, what made it, a timeline.

One tracker for both sides: ``run`` tracks a real step on CPU (where the resident set counts
the allocator and the interpreter too), ``estimate`` a step on fake tensors; on CUDA ``run``
reads the allocator's peak instead. The live bytes are the tensors held on entry
(parameters, buffers, optimizer state, inputs), what FSDP has gathered (its all-gather
outputs are resized in place, so their current size is read), and every storage an op
creates while the tracker is active, until it is freed. An op's result that shares storage
with one of its inputs (a view, an in-place op, ``out=``) creates nothing: so the tensors
of C++ owners (DDP's gradient buckets, allocated when DDP is built) are not counted as they
are touched, and are added by the caller instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dist_core import local_tensor
from strategy_bench._compat import storage_key

_NBYTES = torch.UntypedStorage.nbytes


PHASES = ("forward", "backward", "optimizer")
"""The phases of a tracked step, in order."""

TIMELINE_POINTS = 120
"""At most this many ``(phase, bytes)`` samples are kept of a step (each the maximum of its
stretch, so the peak survives the thinning)."""


class LiveTensors(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Track the live tensor bytes while active; set ``phase`` as the step moves on.

    Args:
        held: Tensors alive on entry that count for the whole step (parameters, buffers,
            optimizer state); each storage once, a ``DTensor`` by its local shard.
        resizable: Tensors whose storage may grow and shrink in place during the step
            (FSDP's all-gather outputs): their current size is read at every sample.
        ignored: Tensors alive on entry that do not count (stand-ins for counted ones).

    Attributes:
        phase: The phase the next ops belong to (one of :data:`PHASES`).
        peak: The most live bytes seen.
        peak_phase: The phase the peak was reached in.
        peak_parts: At the peak: ``held``, ``gathered`` (FSDP's resizable storages) and
            ``step`` (what ops allocated: activations, gradients, temporaries).
    """

    def __init__(
        self,
        held: Iterable[object],
        resizable: Iterable[torch.Tensor] = (),
        *,
        ignored: Iterable[object] = (),
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._seen: set[int] = set()
        self._new_storages(ignored)
        self._held = sum(storage.nbytes() for storage in self._new_storages(held))
        self._resizable = self._new_storages(resizable)
        self._allocated = 0
        self.phase = PHASES[0]
        self.peak = 0
        self.peak_phase = self.phase
        self.peak_parts: dict[str, int] = {}
        self._timeline: list[tuple[str, int]] = []
        self._sample()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs: set[int] | None = None
        for leaf in tree_leaves(out):
            storage = _storage(leaf)
            if storage is None:
                continue
            key = storage_key(storage)
            if key in self._seen:
                continue
            if inputs is None:
                inputs = _storage_keys((args, kwargs))
            if key in inputs:  # a view or an in-place result of a tensor from before
                continue
            self._seen.add(key)
            size = storage.nbytes()
            self._allocated += size
            weakref.finalize(storage, self._free, key, size)
        self._sample()
        return out

    def _new_storages(self, tensors: Iterable[object]) -> list[torch.UntypedStorage]:
        """The storages of ``tensors`` not seen before, each once; marks them seen."""
        found = []
        for tensor in tensors:
            storage = _storage(tensor)
            if storage is not None and storage_key(storage) not in self._seen:
                self._seen.add(storage_key(storage))
                found.append(storage)
        return found

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self._allocated -= size

    def _sample(self) -> None:
        gathered = sum(map(_NBYTES, self._resizable))  # once per op: the fast spelling
        live = self._held + gathered + self._allocated
        if live > self.peak:
            self.peak, self.peak_phase = live, self.phase
            self.peak_parts = {"held": self._held, "gathered": gathered, "step": self._allocated}
        if not self._timeline or self._timeline[-1] != (self.phase, live):
            self._timeline.append((self.phase, live))

    def timeline(self, points: int = TIMELINE_POINTS) -> list[tuple[str, int]]:
        """The step's ``(phase, live bytes)`` samples, thinned to at most ``points``."""
        return thin(self._timeline, points)


def thin(samples: Sequence[tuple[str, int]], points: int) -> list[tuple[str, int]]:
    """At most ``points`` samples: each the largest of its stretch, phases kept apart."""
    if len(samples) <= points:
        return list(samples)
    stretch = -(-len(samples) // points)
    out: list[tuple[str, int]] = []
    for begin in range(0, len(samples), stretch):
        chunk = samples[begin : begin + stretch]
        out.append(max(chunk, key=lambda sample: sample[1]))
    return out


def _storage_keys(tree: Any) -> set[int]:
    keys = set()
    for leaf in tree_leaves(tree):
        storage = _storage(leaf)
        if storage is not None:
            keys.add(storage_key(storage))
    return keys


def _storage(tensor: object) -> torch.UntypedStorage | None:
    if not isinstance(tensor, torch.Tensor):
        return None
    local = local_tensor(tensor)
    try:
        return local.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. a sparse or nested tensor
        return None
