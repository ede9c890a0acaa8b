"""``DelegatingDistributedDataParallel``: DDP through which the wrapped model stays reachable."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_wrap._bypass import IN_FORWARD, await_backward, watch_trainable_submodules
from dist_core import check_forward_methods

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_MISSING = object()


class DelegatingDistributedDataParallel(DistributedDataParallel):
    """``DistributedDataParallel`` whose wrapped module stays reachable through the wrapper.

    Reads of names that DDP does not have fall through to the wrapped module (attributes,
    properties, methods, submodules, parameters); DDP's own names win; ``dir()`` lists both.
    Writes of a name that the wrapped module has and DDP does not go to the wrapped module
    (property setters included); other writes go to the wrapper.

    Three guards against silent gradient desync:

    * Methods marked as forward methods (``forward_methods=`` or :func:`mark_forward_method`)
      run through DDP's forward, so their gradients are synchronised like ``wrapper(...)``'s.
    * Bypass detection (``detect_bypass=True``): a submodule with trainable parameters of its
      own that runs its forward while grad is enabled, outside DDP's forward, raises
      ``RuntimeError``, however it was reached (``ddp.body(x)``, ``ddp.body.layer1(x)``, a
      delegated method, ``ddp.module.body(x)``). Allowed under ``torch.no_grad()`` /
      ``inference_mode()`` and in activation checkpointing's recompute during backward.
    * Trainable guard (``check_trainable=True``): if the set of parameters that require grad
      changes after the wrap (DDP's reducer never sees that), the next forward raises.

    Args:
        module: The module to wrap.
        *args: Positional arguments of ``DistributedDataParallel``.
        forward_methods: Names of the module's methods to route through DDP's forward.
        check_trainable: Enable the trainable guard.
        detect_bypass: Enable bypass detection.
        **kwargs: Keyword arguments of ``DistributedDataParallel``.
    """

    def __init__(
        self,
        module: nn.Module,
        *args: Any,
        forward_methods: Iterable[str] = (),
        check_trainable: bool = True,
        detect_bypass: bool = True,
        **kwargs: Any,
    ) -> None:
        names = check_forward_methods(module, forward_methods, reserved=_DDP_NAMES, wrapper=_DDP)
        super().__init__(module, *args, **kwargs)
        params = tuple(module.parameters()) if check_trainable else ()
        state = self.__dict__
        state["_ddp_wrap_params"] = params
        state["_ddp_wrap_trainable"] = tuple(map(_REQUIRES_GRAD, params))
        watch = watch_trainable_submodules(self, module) if detect_bypass else None
        state["_ddp_wrap_watch"] = watch
        state["_ddp_wrap_forward_methods"] = {}
        state["_ddp_wrap_in_forward"] = 0
        state["_ddp_wrap_ready"] = True  # from here on, reads and writes may delegate
        for name in names:
            state["_ddp_wrap_forward_methods"][name] = _ForwardMethod(self, name)

    # --- delegation -----------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__
        modules = state.get("_modules")
        if modules is not None:
            for table in (modules, state["_parameters"], state["_buffers"]):
                if name in table:
                    return table[name]
        if not state.get("_ddp_wrap_ready"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        marked = state["_ddp_wrap_forward_methods"].get(name)
        if marked is not None:
            return marked
        module = modules["module"]  # type: ignore[index]
        try:
            value = getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"neither {type(self).__name__} nor the wrapped {type(module).__name__} has an "
                f"attribute '{name}'"
            ) from None
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        state = self.__dict__
        if state.get("_ddp_wrap_ready") and not _owns(self, name):
            module = state["_modules"]["module"]
            if _owns(module, name):
                setattr(module, name, value)
                return
        super().__setattr__(name, value)

    def __dir__(self) -> Iterable[str]:
        return sorted(set(super().__dir__()) | set(dir(self.module)))  # type: ignore[no-untyped-call]

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        watch = self.__dict__.get("_ddp_wrap_watch")
        if watch is not None:
            watch.bind(self)  # the unpickled hooks watch for this wrapper

    # --- forward and the trainable guard --------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """DDP's forward, after the trainable guard's check."""
        state = self.__dict__
        params = state["_ddp_wrap_params"]
        if params and tuple(map(_REQUIRES_GRAD, params)) != state["_ddp_wrap_trainable"]:
            self._raise_trainable_changed()
        watch = state["_ddp_wrap_watch"]
        if watch is not None:
            watch.detach()  # no bypass hook runs inside DDP's forward
        state["_ddp_wrap_in_forward"] += 1
        IN_FORWARD[0] += 1
        try:
            output = super().forward(*inputs, **kwargs)  # type: ignore[no-untyped-call]
            if watch is not None and torch.is_grad_enabled() and self.require_backward_grad_sync:
                await_backward(self, output)
            return output
        finally:
            IN_FORWARD[0] -= 1
            state["_ddp_wrap_in_forward"] -= 1
            if watch is not None and not state["_ddp_wrap_in_forward"]:
                watch.attach()

    def _raise_trainable_changed(self) -> None:
        names = {id(p): n for n, p in self.module.named_parameters()}
        params, before = self.__dict__["_ddp_wrap_params"], self.__dict__["_ddp_wrap_trainable"]
        thawed = [
            names.get(id(p), "?")
            for p, was in zip(params, before, strict=True)
            if p.requires_grad and not was
        ]
        frozen = [
            names.get(id(p), "?")
            for p, was in zip(params, before, strict=True)
            if was and not p.requires_grad
        ]
        raise RuntimeError(
            "the set of trainable parameters changed after the DDP wrap: "
            f"now trainable {thawed}, now frozen {frozen}. DDP builds its gradient reducer from "
            "the parameters that require grad at wrap time, so gradients would no longer be "
            "synchronised correctly. Apply the trainable policy before wrapping (or wrap "
            "again); check_trainable=False turns this check off"
        )


class _ForwardMethod:
    """A marked method: calling it runs the method as the module's forward, through DDP."""

    __slots__ = ("_name", "_wrapper")

    def __init__(self, wrapper: DelegatingDistributedDataParallel, name: str) -> None:
        self._wrapper = wrapper
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._wrapper.module
        method = getattr(module, self._name)
        saved = module.__dict__.get("forward", _MISSING)

        def restore() -> None:
            if saved is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = saved

        def redirected(*a: Any, **k: Any) -> Any:
            restore()  # nested self.forward(...) calls reach the real forward
            return method(*a, **k)

        module.__dict__["forward"] = redirected
        try:
            return self._wrapper(*args, **kwargs)
        finally:
            restore()

    def __repr__(self) -> str:
        return f"<forward method {self._name!r} of {type(self._wrapper.module).__name__} via DDP>"


def mark_forward_method(wrapped: DistributedDataParallel, name: str) -> None:
    """Route ``wrapped.<name>(...)`` through DDP's forward.

    After this, calling the method through the wrapper runs it as the wrapped module's
    forward inside DDP's forward, so its gradients are synchronised exactly as those of
    ``wrapped(...)``.

    Args:
        wrapped: A :class:`DelegatingDistributedDataParallel` (from :func:`wrap_module_ddp`).
        name: The name of a method of the wrapped module.

    Raises:
        TypeError: If ``wrapped`` is not a delegating DDP wrapper, or ``name`` is no method.
        AttributeError: If the wrapped module has no attribute ``name``.
        ValueError: If ``name`` is ``forward`` or one of DDP's own names.
    """
    if not isinstance(wrapped, DelegatingDistributedDataParallel):
        raise TypeError(
            "mark_forward_method needs a DelegatingDistributedDataParallel (use "
            f"wrap_module_ddp to wrap the model), got {type(wrapped).__name__}"
        )
    check_forward_methods(wrapped.module, (name,), reserved=_DDP_NAMES, wrapper=_DDP)
    wrapped.__dict__["_ddp_wrap_forward_methods"][name] = _ForwardMethod(wrapped, name)


def _owns(obj: nn.Module, name: str) -> bool:
    """Whether ``name`` is an attribute of ``obj`` itself, without running any property."""
    state = obj.__dict__
    return (
        name in state
        or name in state.get("_parameters", ())
        or name in state.get("_buffers", ())
        or name in state.get("_modules", ())
        or hasattr(type(obj), name)
    )


# A forward method may not take a name that the wrapper itself has.
_DDP = "DistributedDataParallel"
_DDP_NAMES = frozenset(dir(DelegatingDistributedDataParallel))
