"""What a device argument means: the one resolver every package uses."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import overload

import torch

DeviceLike = torch.device | str | int
"""A device argument: a ``torch.device``, a string (``"cuda:1"``) or an int index."""


def accelerator_type() -> str:
    """The device type that a bare integer index refers to: the current accelerator's.

    That is ``"cuda"`` on a CUDA build (also one without a visible GPU, and on CPU-only
    builds, so that an int keeps meaning a CUDA index as in ``DistributedDataParallel``),
    ``"xpu"`` on an XPU build, and so on.
    """
    current = torch.accelerator.current_accelerator()
    return "cuda" if current is None else str(current.type)


@overload
def resolve_device(device: DeviceLike, *, argument: str = ...) -> torch.device: ...
@overload
def resolve_device(device: None, *, argument: str = ...) -> None: ...
def resolve_device(device: DeviceLike | None, *, argument: str = "device") -> torch.device | None:
    """Turn a device argument into a ``torch.device`` (``None`` stays ``None``).

    An ``int`` is an index of the current accelerator type (:func:`accelerator_type`: CUDA on
    a CUDA build), as in ``torch.device(0)``.

    Args:
        device: A ``torch.device``, a string such as ``"cuda:0"``, an int index, or ``None``.
        argument: The argument name used in error messages.

    Returns:
        The device, or ``None``.

    Raises:
        TypeError: If ``device`` is not a ``torch.device``, string, int or ``None``.
        ValueError: If the string does not name a device, or the index is negative.
    """
    if device is None or isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, str | int):
        raise TypeError(
            f"{argument} must be a torch.device, a string such as 'cuda:0', or an int index of "
            f"the current accelerator, got {type(device).__name__} ({device!r})"
        )
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{argument} index must be >= 0, got {device}; use e.g. 0")
        return torch.device(accelerator_type(), device)
    try:
        return torch.device(device)
    except RuntimeError as error:
        raise ValueError(
            f"{argument}={device!r} is not a device string; use e.g. 'cpu', 'cuda' or 'cuda:1'"
        ) from error


def require_device_index(device: torch.device, *, caller: str, argument: str = "device") -> None:
    """Refuse an accelerator device without an index (``"cuda"``): each rank needs its own.

    Args:
        device: A resolved device.
        caller: The public function named in the message.
        argument: The argument named in the message.

    Raises:
        ValueError: If ``device`` is an accelerator device with no index.
    """
    if device.type not in ("cpu", "meta") and device.index is None:
        raise ValueError(
            f"{caller} requires a concrete local device index: {argument} must be a concrete "
            f"{device.type.upper()} device such as '{device.type}:0' (this rank's device, "
            f"usually {device.type}:LOCAL_RANK), got {str(device)!r}"
        )


def require_current_device(device: torch.device, *, caller: str, argument: str = "device") -> None:
    """Refuse an accelerator device that is not this process's current device.

    Collectives on NCCL that stage tensors of their own (``all_gather_object``,
    ``broadcast_object_list``, ``init_device_mesh``, FSDP2's allocations) use the current
    device, not the one passed: ``device="cuda:3"`` without ``torch.cuda.set_device(3)`` would
    put every rank's buffers on cuda:0 (an error, or a hang).

    Args:
        device: A resolved device; CPU and meta devices always pass.
        caller: The public function named in the message.
        argument: The argument named in the message.

    Raises:
        ValueError: If ``device`` has an index other than the current device's.
    """
    if device.type in ("cpu", "meta") or device.index is None:
        return
    current = torch.get_device_module(device.type).current_device()
    if device.index != current:
        raise ValueError(
            f"{caller}: {argument}={str(device)!r} is not the current {device.type} device "
            f"({device.type}:{current}); collectives stage their buffers on the current device, "
            f"so call torch.{device.type}.set_device({device.index}) first (usually "
            f"set_device(LOCAL_RANK) right after the process starts)"
        )


@contextlib.contextmanager
def on_device(device: torch.device | None) -> Iterator[None]:
    """Make ``device`` the current device of its type in this thread while the block runs.

    A thread other than the one that called ``torch.cuda.set_device`` starts on device 0:
    work that a library runs in its own thread (DCP's background writer, which takes the
    current stream) must enter this rank's device first, or it creates a context and copies
    on GPU 0. CPU, meta, an index-less device, a device type without a ``device`` context
    (MPS) or ``None``: nothing to do.
    """
    if device is None or device.type in ("cpu", "meta") or device.index is None:
        yield
        return
    enter = getattr(torch.get_device_module(device.type), "device", None)
    if enter is None:
        yield
        return
    with enter(device.index):
        yield
