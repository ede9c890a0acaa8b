"""Bypass detection: gradients that reach the model in a backward DDP will not reduce.

DDP's reducer reduces the gradients of a backward that follows a DDP forward (it expects the
parameters' hooks then, and ignores them once the reduction is done). So a trainable
submodule run outside DDP's forward desyncs the ranks only when the backward through its
output has no DDP forward to follow: ``ddp.body(x).sum().backward()``. Its output fed into the
wrapped model's forward (``inputs_embeds``, prompt tuning, LLaVA-style projectors), or
combined with the DDP output into one loss (auxiliary losses), is reduced like the rest.

Every submodule that holds trainable parameters of its own gets one forward hook. The hooks
are detached for the duration of DDP's forward (a few dict operations per step, no hook call
inside the step) and attached again after it. Outside DDP's forward, under grad, the hook
puts a gradient hook on the submodule's output; when the backward reaches that output, the
hook refuses it unless DDP will reduce this backward (a DDP forward with gradient sync ran
and its backward has not finished) or ``no_sync`` is active (DDP accumulates locally then,
and the next synchronised backward reduces the sum). The refusal raises before any gradient
reaches the submodule's parameters, whichever path reached it: ``ddp.body(x)``,
``ddp.body.layer1(x)``, a delegated method, or ``ddp.module.body(x)`` (the same object).
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Callable, MutableMapping
from types import FrameType
from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

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
    """The forward hook of one trainable submodule: marks its output outside DDP's forward."""

    __slots__ = ("name", "watch")

    def __init__(self, watch: _Watch, name: str) -> None:
        self.watch = watch
        self.name = name

    def __call__(self, module: nn.Module, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or IN_FORWARD[0]:
            return
        ref = self.watch.wrapper
        wrapper = None if ref is None else ref()
        if wrapper is None or _compat.in_backward():  # inert copy; checkpoint recompute
            return
        tensors = [
            t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if not tensors:
            return
        check = _BackwardCheck(ref, _eager_message(wrapper.module, self.name, module))  # type: ignore[arg-type]
        for tensor in tensors:
            tensor.register_hook(check)  # type: ignore[no-untyped-call]


class _BackwardCheck:
    """The gradient hook on a bypass output: refuses a backward DDP will not reduce."""

    __slots__ = ("message", "wrapper")

    def __init__(
        self, wrapper: weakref.ReferenceType[DistributedDataParallel], message: str
    ) -> None:
        self.wrapper = wrapper
        self.message = message

    def __call__(self, grad: torch.Tensor) -> None:
        wrapper = self.wrapper()
        if wrapper is None or not wrapper.require_backward_grad_sync:  # gone; in no_sync
            return
        if wrapper.__dict__.get("_ddp_wrap_awaiting_backward"):  # a DDP forward feeds it
            return
        raise RuntimeError(self.message)


def await_backward(wrapper: DistributedDataParallel, output: Any) -> None:
    """After a DDP forward with gradient sync: DDP will reduce the backward through ``output``.

    Until that backward ends, bypass outputs in it are reduced too (allowed). The end is
    found with a gradient hook on the forward's outputs, which queues a callback for the end
    of the backward that runs through them.
    """
    state = wrapper.__dict__
    state["_ddp_wrap_awaiting_backward"] = True
    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        state["_ddp_wrap_awaiting_backward"] = False
        return
    queued = [False]

    def done() -> None:
        state["_ddp_wrap_awaiting_backward"] = False

    def hook(grad: torch.Tensor) -> None:
        if not queued[0]:
            queued[0] = True
            torch.autograd.Variable._execution_engine.queue_callback(done)

    for tensor in tensors:
        tensor.register_hook(hook)  # type: ignore[no-untyped-call]


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
        table = sub._forward_hooks
        if table:
            for hook in list(table.values()):
                if isinstance(hook, _Hook):
                    hook.watch.retire()
        if any(p is not None and p.requires_grad for p in sub._parameters.values()):
            hook = _Hook(watch, name or "<root>")
            key = next(_KEYS)
            table[key] = hook  # what register_forward_hook does, without a handle
            watch.entries.append((table, key, hook))
    return watch


def _message(root: nn.Module, name: str, module: nn.Module) -> str:
    method = _calling_method(root)
    what = f"submodule '{name}' ({type(module).__name__})"
    consequence = (
        "outside DDP's forward, and the backward through its output follows no DDP forward: "
        "DDP will not reduce it, so its gradients would differ across ranks (refused before "
        "they reached its parameters; gradients that other parts of this backward already "
        "accumulated are not synchronised either: zero them)."
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
        f"its forward {consequence} Feed its output into the wrapper's forward or add it to "
        "the loss of one (auxiliary losses are reduced), call the whole model through the "
        "wrapper (ddp(...)), route "
        "a method that runs it through DDP with mark_forward_method(ddp, name) or "
        "wrap_module_ddp(..., forward_methods=[name]), or run it under torch.no_grad() / "
        "torch.inference_mode() if no gradient is needed; wrap_module_ddp(..., "
        "detect_bypass=False) turns this check off"
    )


# Under torch.compile the hook is traced; the message walks the stack (sys._getframe), which
# dynamo cannot trace (it warns and breaks the graph): it runs eagerly, outside the graph.
_eager_message = cast(
    Callable[[nn.Module, str, nn.Module], str],
    torch.compiler.disable(_message),  # type: ignore[no-untyped-call]  # torch leaves it untyped
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
