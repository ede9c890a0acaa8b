"""Torch-version differences for ddp-wrap, kept in one place."""

from __future__ import annotations

import inspect
import itertools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn
from torch.nn.modules import module as _module_impl
from torch.nn.parallel import DistributedDataParallel

_DDP = TypeVar("_DDP", bound=DistributedDataParallel)

# torch 2.13 deprecates ``broadcast_buffers`` in favour of ``forward_sync_buffers``, whose
# ``False`` still syncs buffers at init. The reference semantics (no buffer sync at init nor
# in forward) are still only reachable through ``broadcast_buffers=False``.
HAS_FORWARD_SYNC_BUFFERS = (
    "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
)
_DEPRECATION = r"`broadcast_buffers` is deprecated"


def construct_ddp(
    cls: type[_DDP], module: nn.Module, *, broadcast_buffers: bool, **kwargs: Any
) -> _DDP:
    """Construct ``cls(module, ...)`` with the reference buffer semantics and no warning.

    ``broadcast_buffers=False``: buffers are synced neither at init nor before each forward.
    ``broadcast_buffers=True``: synced at init and before each forward.
    """
    if not HAS_FORWARD_SYNC_BUFFERS:
        return cls(module, broadcast_buffers=broadcast_buffers, **kwargs)
    if broadcast_buffers:
        return cls(module, forward_sync_buffers=True, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATION, category=FutureWarning)
        return cls(module, broadcast_buffers=False, **kwargs)


_GLOBAL_PRE_HOOKS: dict[Any, Any] | None = getattr(_module_impl, "_global_forward_pre_hooks", None)
_HOOK_IDS = itertools.count(-1, -1)  # negative: never collides with RemovableHandle ids


def add_global_forward_pre_hook(hook: Callable[[Any, Any], None]) -> Any:
    """Run ``hook`` before every module forward in the process; returns a key for removal.

    Inserting into torch's global hook table directly costs a fraction of
    ``register_module_forward_pre_hook`` (which builds a ``RemovableHandle``); that matters
    because it happens on every delegated method call. Falls back to the public function.
    """
    if _GLOBAL_PRE_HOOKS is None:  # pragma: no cover - torch without the module-level table
        return _module_impl.register_module_forward_pre_hook(hook)
    key = next(_HOOK_IDS)
    _GLOBAL_PRE_HOOKS[key] = hook
    return key


def remove_global_forward_pre_hook(key: Any) -> None:
    """Remove a hook added by :func:`add_global_forward_pre_hook`."""
    if _GLOBAL_PRE_HOOKS is None:  # pragma: no cover
        key.remove()
    else:
        _GLOBAL_PRE_HOOKS.pop(key, None)
