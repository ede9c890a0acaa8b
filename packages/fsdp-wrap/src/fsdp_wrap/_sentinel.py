"""Optimizers that would change nothing or cannot step are refused at their first step.

A stale optimizer is refused: one built before the wrap replaced the parameters it holds.

``fully_shard`` gives every parameter of the module a new ``DTensor`` parameter. An optimizer
created before the wrap still holds the old ones, which no gradient ever reaches: its steps
change no weight of the wrapped model, and nothing says so. The wrap remembers the parameters
it replaced, weakly (an old parameter that nothing else holds is forgotten with it), and a
global optimizer step pre-hook checks each optimizer once, at its first ``step()`` after a
wrap, before any weight changes.

So is one that would keep device-resident state for parameters a wrap offloaded to the host
(``offload=True``): ``capturable=True`` (its step counts stay on the device, for CUDA graphs),
or state already on another device than its parameter. torch raises on such a step only
once it is under way (or, for state on the device, not at all on every path); the check
names the option before any weight changes. ``fused=True`` is not refused: torch runs fused
Adam and AdamW on host parameters (and refuses, at construction, a fused optimizer on a
device it has no kernel for).

Cost: one hook call per ``step()`` of any optimizer in the process (a set lookup once the
optimizer was checked); the check itself walks the optimizer's parameters once per wrap.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dist_core import local_tensor

_REPLACED: dict[int, weakref.ref[torch.Tensor]] = {}
"""The parameters a wrap replaced (and that something still holds), by ``id``. Not a
``WeakSet``: its lookups compare tensors with ``==``, which is elementwise."""

_OFFLOADED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""The modules a wrap with ``offload=True`` left in host memory. Modules, not parameters: a
weak reference to a tensor makes ``torch.utils.swap_tensors`` refuse it, and with it a later
``to_empty`` or ``_apply`` of the model ("Couldn't swap Embedding.weight")."""

_CHECKED: dict[int, weakref.ref[torch.optim.Optimizer]] = {}
"""Optimizers checked since the last wrap that replaced parameters, by ``id`` (an optimizer
class may define ``__eq__`` without ``__hash__``)."""

_LOCK = threading.Lock()
_HOOK: list[Any] = []  # the registered hook's handle, once


def parameters_of(module: nn.Module) -> list[weakref.ref[nn.Parameter]]:
    """Weak references to ``module``'s parameters before a wrap (what an early optimizer holds).

    Weak: ``fully_shard`` moves each unit's parameters to the device before it keeps the
    shards, and a strong reference would keep every unit's whole copy there until the wrap
    ends (the whole model on the device).
    """
    return [weakref.ref(param) for param in module.parameters()]


def remember_replaced(before: list[weakref.ref[nn.Parameter]], module: nn.Module) -> int:
    """Record the parameters of ``before`` that ``module`` no longer holds after its wrap.

    Only the ones still alive matter (something, an optimizer say, holds them). Installs the
    step pre-hook the first time a wrap replaces anything, and makes every optimizer be
    checked again at its next step.

    Returns:
        How many of the replaced parameters are still held elsewhere.
    """
    now = {id(param) for param in module.parameters()}
    alive = (ref() for ref in before)
    replaced = [param for param in alive if param is not None and id(param) not in now]
    if not replaced:
        return 0
    with _LOCK:
        for param in replaced:
            _REPLACED[id(param)] = weakref.ref(param, _forget(id(param)))
        _CHECKED.clear()
    _enable_hook(True)
    return len(replaced)


def remember_offloaded(module: nn.Module) -> None:
    """Record ``module``'s parameters as offloaded (kept in host memory by the wrap).

    An optimizer holding them is checked for device-resident state at its next step.
    """
    with _LOCK:
        _OFFLOADED.add(module)
        _CHECKED.clear()
    _enable_hook(True)


def _forget(key: int) -> Any:
    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        if _REPLACED.get(key) is ref:
            del _REPLACED[key]

    return forget


def _is_replaced(param: torch.Tensor) -> bool:
    ref = _REPLACED.get(id(param))
    return ref is not None and ref() is param


def _check_offloaded(optimizer: torch.optim.Optimizer) -> None:
    """Refuse device-resident state for offloaded parameters (see the module's docstring).

    Raises:
        ValueError: Naming the group and the option, or the state on another device.
    """
    name = type(optimizer).__name__
    with _LOCK:
        held = {id(param) for module in list(_OFFLOADED) for param in module.parameters()}
    for index, group in enumerate(optimizer.param_groups):
        offloaded = [param for param in group["params"] if id(param) in held]
        if not offloaded:
            continue
        if group.get("capturable"):
            raise ValueError(
                f"{name}(capturable=True) keeps its step counts on the device (for CUDA graphs), "
                f"but parameter group {index} holds {len(offloaded)} parameter(s) that "
                "wrap_module_fsdp(offload=True) keeps in host memory, with their gradients and "
                "this optimizer's state: its step cannot run there. Nothing was changed. Create "
                f"it with capturable=False (torch.optim.{name}(..., fused=True) steps fast on "
                "host parameters)"
            )
        for param in offloaded:
            home = local_tensor(param).device
            for key, value in optimizer.state.get(param, {}).items():
                if not isinstance(value, torch.Tensor) or not value.dim():
                    continue  # 0-dim state (AdamW's step) is where torch keeps it: not compared
                where = local_tensor(value).device
                if where != home:
                    raise ValueError(
                        f"{name}'s state {key!r} of an offloaded parameter (group {index}) is on "
                        f"{where}, its parameter on {home}: "
                        "wrap_module_fsdp(offload=True) keeps parameters, gradients and "
                        "optimizer state in host memory. Nothing was changed. Create the "
                        "optimizer after the wrap, from model.parameters(), and load its "
                        "state with checkpoint-io (which places it with its parameter)"
                    )


def _check_first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global step pre-hook: check ``optimizer`` once per wrap, before its step runs.

    Raises:
        RuntimeError: If the optimizer holds parameters a wrap replaced.
        ValueError: If it would keep device-resident state for offloaded parameters.
    """
    checked = _CHECKED.get(id(optimizer))
    if checked is not None and checked() is optimizer:
        return
    stale = sum(
        1 for group in optimizer.param_groups for param in group["params"] if _is_replaced(param)
    )
    if stale:
        total = sum(len(group["params"]) for group in optimizer.param_groups)
        raise RuntimeError(
            f"{type(optimizer).__name__} was created before the model was sharded: it holds "
            f"{stale} of its {total} parameter(s) that wrap_module_fsdp replaced (fully_shard "
            "gives every parameter a new DTensor, and the old ones get no gradient), so its "
            "step() would change none of the trained weights. Nothing was changed. Create the "
            "optimizer after the wrap, from model.parameters() (e.g. "
            f"torch.optim.{type(optimizer).__name__}(model.parameters(), ...))"
        )
    if _OFFLOADED:
        _check_offloaded(optimizer)
    key = id(optimizer)
    _CHECKED[key] = weakref.ref(optimizer, lambda ref: _CHECKED.pop(key, None))


def _enable_hook(enabled: bool) -> None:
    """Install or remove the step pre-hook (for measuring its cost beside raw torch)."""
    with _LOCK:
        if enabled and not _HOOK:
            _HOOK.append(register_optimizer_step_pre_hook(_check_first_step))
        elif not enabled and _HOOK:
            _HOOK.pop().remove()
