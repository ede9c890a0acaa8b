"""Bypass detection: a trainable submodule that runs under grad outside DDP's forward.

Every submodule that holds trainable parameters of its own gets one forward pre-hook. The
hooks are detached for the duration of DDP's forward (a few dict operations per step, no hook
call inside the step) and attached again after it, so outside DDP's forward a trainable
submodule that runs while grad is enabled raises, whichever path reached it: ``ddp.body(x)``,
``ddp.body.layer1(x)``, a delegated method, or ``ddp.module.body(x)`` (the same object).
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import MutableMapping
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_wrap import _compat

_Entry = tuple[MutableMapping[int, Any], int, "_Hook"]

_KEYS = itertools.count(-1, -1)  # negative: never one of torch's RemovableHandle ids
IN_FORWARD = [0]
"""How many delegating DDP forwards are running in this process (any wrapper)."""


class _Watch:
    """What the hooks of one wrapper share: the wrapper (weakly) and the hook table entries.

    A pickled or deep-copied watch is inert (its wrapper is ``None``) until a wrapper
    unpickled with it binds it again, so a copy of the bare model (EMA, ``torch.save(model)``)
    is never checked.
    """

    __slots__ = ("attached", "entries", "wrapper")

    def __init__(self) -> None:
        self.wrapper: weakref.ReferenceType[DistributedDataParallel] | None = None
        self.entries: list[_Entry] = []
        self.attached = True

    def bind(self, wrapper: DistributedDataParallel) -> None:
        self.wrapper = weakref.ref(wrapper)

    def detach(self) -> None:
        if self.attached:
            for table, key, _ in self.entries:
                table.pop(key, None)
            self.attached = False

    def attach(self) -> None:
        if not self.attached and self.entries:
            for table, key, hook in self.entries:
                table[key] = hook
            self.attached = True

    def retire(self) -> None:
        """Remove the hooks for good (the module was wrapped again)."""
        self.detach()
        self.entries = []
        self.wrapper = None

    def __getstate__(self) -> dict[str, Any]:
        return {"entries": self.entries, "attached": self.attached}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.wrapper = None
        self.entries = state["entries"]
        self.attached = state["attached"]


class _Hook:
    """The forward pre-hook of one trainable submodule."""

    __slots__ = ("name", "watch")

    def __init__(self, watch: _Watch, name: str) -> None:
        self.watch = watch
        self.name = name

    def __call__(self, module: nn.Module, _args: Any) -> None:
        if not torch.is_grad_enabled() or IN_FORWARD[0]:
            return
        ref = self.watch.wrapper
        wrapper = None if ref is None else ref()
        if wrapper is None or _compat.in_backward():  # inert copy; checkpoint recompute
            return
        raise RuntimeError(_message(wrapper.module, self.name, module))


def watch_trainable_submodules(wrapper: DistributedDataParallel, root: nn.Module) -> _Watch:
    """Hook every submodule of ``root`` with trainable parameters of its own.

    Hooks left by an earlier wrapper of ``root`` are removed first: a module is watched by
    its newest wrapper only.

    Args:
        wrapper: The DDP wrapper, held weakly: once it is gone the hooks do nothing.
        root: The wrapped model.

    Returns:
        The watch; the wrapper detaches it around its forward.
    """
    watch = _Watch()
    watch.bind(wrapper)
    for name, sub in root.named_modules():
        table = sub._forward_pre_hooks
        if table:
            for hook in list(table.values()):
                if isinstance(hook, _Hook):
                    hook.watch.retire()
        if any(p is not None and p.requires_grad for p in sub._parameters.values()):
            hook = _Hook(watch, name or "<root>")
            key = next(_KEYS)
            table[key] = hook  # what register_forward_pre_hook does, without a handle
            watch.entries.append((table, key, hook))
    return watch


def _message(root: nn.Module, name: str, module: nn.Module) -> str:
    method = _calling_method(root)
    what = f"submodule '{name}' ({type(module).__name__})"
    consequence = (
        "outside DDP's forward while grad is enabled: its gradients would not be synchronised "
        "across ranks."
    )
    if method is not None:
        return (
            f"{type(root).__name__}.{method}() ran the forward of {what}, which has trainable "
            f"parameters, {consequence} Route it through DDP with "
            f"mark_forward_method(model, '{method}') or "
            f"wrap_module_ddp(..., forward_methods=['{method}']), or call it under "
            "torch.no_grad() if no gradient is needed"
        )
    return (
        f"{what} of the DDP-wrapped {type(root).__name__}, which has trainable parameters, ran "
        f"its forward {consequence} Call the whole model through the wrapper (ddp(...)), route "
        "a method that runs it through DDP with mark_forward_method(ddp, name) or "
        "wrap_module_ddp(..., forward_methods=[name]), or run it under torch.no_grad() / "
        "torch.inference_mode() if no gradient is needed; wrap_module_ddp(..., "
        "detect_bypass=False) turns this check off"
    )


def _calling_method(root: nn.Module) -> str | None:
    """The outermost method of ``root`` on the stack (the one called through the wrapper)."""
    found = None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        method = getattr(type(root), code.co_name, None)
        if (
            not hasattr(nn.Module, code.co_name)
            and getattr(method, "__code__", None) is code
            and frame.f_locals.get("self") is root
        ):
            found = code.co_name
        frame = frame.f_back
    return found
