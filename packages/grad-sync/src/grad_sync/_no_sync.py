"""``no_sync``: skip the gradient reduction of accumulation micro-steps, under any strategy."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

from dist_core import fsdp_modules, log_rank0, strategy_of, unwrap_compiled
from grad_sync import _compat

logger = logging.getLogger(__name__)

_FIX = (
    "run the forward and the backward inside the context: "
    "`with no_sync(model): loss = model(batch); loss.backward()`"
)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip the gradient reduction for the micro-steps run inside the block.

    Use it for every micro-step of an accumulation but the last; the last one, outside the
    block, reduces the accumulated gradients once. The same code is right under each
    strategy:

    * DDP (``DistributedDataParallel`` or our ``DelegatingDistributedDataParallel``, also
      under ``torch.compile``): ``model.no_sync()``. It proves it took effect: a backward
      inside the block whose forward ran outside it (DDP then reduces anyway: the classic
      accumulation bug) raises ``RuntimeError`` when the block exits.
    * FSDP2 (``fully_shard``) and HSDP (its 2-D mesh): ``set_requires_gradient_sync(False)``
      on every FSDP module of the model (no reduce-scatter within the shard group, no
      all-reduce across the replicas); each module's previous setting comes back on exit,
      also on an exception.
    * A plain module, or no process group: nothing to do.

    DDP with ``static_graph=True`` records its graph in its first iteration, which must
    synchronise (torch 2.13 fails there with an internal assert in ``reducer.cpp``); in that
    first iteration the block lets DDP synchronise, with one log line, and skips the
    reduction from the second iteration on. The gradients are the same either way.

    Args:
        model: The model as the trainer calls it.

    Yields:
        Nothing.

    Raises:
        RuntimeError: Under DDP, on exit, if a backward inside the block belonged to a
            forward that ran outside it.
    """
    strategy = strategy_of(model)
    sharded = fsdp_modules(model) if strategy in ("fsdp", "hsdp") else []
    if strategy == "ddp":
        outer = unwrap_compiled(model)
        assert isinstance(outer, DistributedDataParallel)
        with _ddp_no_sync(outer):
            yield
    elif sharded:
        with _fsdp_no_sync(sharded):
            yield
    elif strategy == "fsdp":  # FSDP1: its own no_sync
        with model.no_sync():  # type: ignore[operator]
            yield
    else:
        yield


class _Tracker:
    """Flags a backward, inside ``no_sync``, of a forward that ran with synchronisation on.

    Installed once per DDP model on its first ``no_sync``: a forward hook puts a tensor hook
    on the outputs of each forward that will reduce in its backward; the tensor hook counts
    a backward that reaches them while a ``no_sync`` block is open.
    """

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.open = 0
        self.violations = 0
        ddp.register_forward_hook(self._after_forward)

    def _after_forward(self, module: nn.Module, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or not module.require_backward_grad_sync:
            return
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._on_backward)  # type: ignore[no-untyped-call]

    def _on_backward(self, _grad: torch.Tensor) -> None:
        if self.open:
            self.violations += 1


_TRACKERS: weakref.WeakKeyDictionary[DistributedDataParallel, _Tracker] = (
    weakref.WeakKeyDictionary()
)


@contextlib.contextmanager
def _ddp_no_sync(ddp: DistributedDataParallel) -> Iterator[None]:
    tracker = _TRACKERS.get(ddp)
    if tracker is None:
        tracker = _TRACKERS[ddp] = _Tracker(ddp)
    if ddp.static_graph and not _compat.ddp_forward_has_run(ddp):
        log_rank0(
            logger,
            logging.INFO,
            "no_sync: DDP with static_graph=True synchronises in its first iteration (it "
            "records the graph there); accumulation skips the reduction from the next one",
        )
        yield
        return
    violations = tracker.violations
    tracker.open += 1
    try:
        with ddp.no_sync():
            yield
    finally:
        tracker.open -= 1
    if tracker.violations != violations:
        raise RuntimeError(
            "no_sync(model) did not take effect: a backward ran inside it for a forward that "
            "ran outside it, so DDP reduced the gradients anyway (every micro-step "
            f"communicates, as without accumulation). To skip the reduction, {_FIX}"
        )


@contextlib.contextmanager
def _fsdp_no_sync(modules: list[Any]) -> Iterator[None]:
    previous = [_compat.requires_gradient_sync(module) for module in modules]
    try:
        for module in modules:
            module.set_requires_gradient_sync(False, recurse=False)
        yield
    finally:
        for module, value in zip(modules, previous, strict=True):
            module.set_requires_gradient_sync(value, recurse=False)
