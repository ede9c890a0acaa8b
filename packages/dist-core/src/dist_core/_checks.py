"""The checks before a data-parallel wrap, shared by the DDP and the FSDP wrapper."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import cast

import torch
from torch import nn

from dist_core._devices import DeviceLike, require_device_index, resolve_device
from dist_core._group import require_process_group

_MISSING = object()


def check_wrap_preconditions(
    module: object,
    device: object,
    *,
    wrapper: str,
    allow_meta: bool = False,
    allow_host: bool = False,
) -> torch.device:
    """The reference checks before a data-parallel wrap, in the reference order.

    1. ``module`` is an ``nn.Module`` (``TypeError``).
    2. The default process group is initialized (``RuntimeError``).
    3. At least one parameter requires grad (``ValueError``).
    4. An accelerator device names a concrete index (``ValueError``).
    5. Every parameter is on ``device`` (``ValueError`` naming the first that is not), or on
       the meta device where ``allow_meta`` says the wrapper can shard it unmaterialized,
       or on the CPU where ``allow_host`` says the wrapper moves it to ``device`` itself.

    Args:
        module: The module about to be wrapped.
        device: This rank's device: a ``torch.device``, a string, or an int index.
        wrapper: The caller's name, used in the messages.
        allow_meta: Accept parameters on the meta device (FSDP2's deferred initialization:
            shard first, then ``to_empty(device=...)`` and initialize the local shards).
        allow_host: Accept parameters on the CPU when ``device`` is an accelerator (FSDP2
            moves each unit to the device as it shards it, so only the shards stay there).

    Returns:
        The resolved ``torch.device``.

    Raises:
        TypeError: If ``module`` is not a module or ``device`` has a bad type.
        RuntimeError: If the default process group is not initialized.
        ValueError: See the checks above.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"{wrapper} needs an nn.Module, got {type(module).__name__}")
    require_process_group(wrapper, instead="before wrapping")
    params = list(module.named_parameters())  # one pass: checks run on every wrap
    if not any(param.requires_grad for _, param in params):
        raise ValueError(
            f"{wrapper} needs at least one parameter with requires_grad=True; "
            f"{type(module).__name__} has {len(params)} parameter tensor(s) and none is "
            "trainable. Apply the trainable policy so that something trains, or do not wrap "
            "the model"
        )
    target = resolve_device(cast("DeviceLike", device))  # checks the type at run time
    require_device_index(target, caller=wrapper)
    for name, param in params:
        if param.device == target:
            continue
        if allow_meta and param.device.type == "meta":
            continue
        if allow_host and param.device.type == "cpu":
            continue
        raise ValueError(
            f"parameter '{name}' of {type(module).__name__} is on {param.device}, but "
            f"device={str(target)!r}; move the model first (model.to({str(target)!r}))"
        )
    return target


def check_forward_methods(
    module: nn.Module,
    names: Iterable[object],
    *,
    reserved: Collection[str] = (),
    wrapper: str = "the wrapper",
) -> tuple[str, ...]:
    """Validate the names of methods that a wrapper will route like ``forward``.

    One exception type per mistake, for every wrapper: a name that is not a string or not
    a method: ``TypeError``; a missing attribute: ``AttributeError``; ``"forward"`` itself or
    a name the wrapper owns (``reserved``): ``ValueError``.

    Args:
        module: The module whose methods are named.
        names: The method names.
        reserved: Names the wrapper class defines itself.
        wrapper: The wrapper's name in messages.

    Returns:
        The names, as a tuple.
    """
    checked: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                f"forward method names must be strings, got {type(name).__name__} ({name!r})"
            )
        if name == "forward":
            raise ValueError(
                "cannot route 'forward' as a forward method: it is the forward itself; name a "
                "method other than forward (e.g. 'ode_wrapper')"
            )
        if name in reserved:
            raise ValueError(
                f"cannot route {name!r} as a forward method: {wrapper} has its own {name!r}; "
                f"call it on the wrapped module instead (wrapper.module.{name})"
            )
        value = getattr(module, name, _MISSING)
        if value is _MISSING:
            raise AttributeError(
                f"cannot route {name!r} as a forward method: {type(module).__name__} has no "
                f"attribute {name!r}"
            )
        if not callable(value) or isinstance(value, nn.Module):
            raise TypeError(
                f"cannot route {name!r} as a forward method: {type(module).__name__}.{name} is "
                f"a {type(value).__name__}, not a method"
            )
        checked.append(name)
    return tuple(checked)
