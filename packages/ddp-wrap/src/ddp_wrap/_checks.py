"""Preconditions for wrapping a module for data parallelism (shared by DDP and FSDP wrappers)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

DeviceLike = torch.device | str | int


def check_wrap_preconditions(module: object, device: object, *, wrapper: str) -> torch.device:
    """The reference checks before a data-parallel wrap, in the reference order.

    Shared by ``wrap_module_ddp`` and fsdp-wrap's ``wrap_module_fsdp`` so that both fail
    with the same errors.

    1. ``module`` is an ``nn.Module`` (``TypeError``).
    2. The default process group is initialised (``RuntimeError``).
    3. At least one parameter requires grad (``ValueError``).
    4. A CUDA device names a concrete index (``ValueError``).
    5. Every parameter is on ``device`` (``ValueError`` naming the first that is not).

    Args:
        module: The module about to be wrapped.
        device: This rank's device: a ``torch.device``, a string, or an int (CUDA index).
        wrapper: The caller's name, used in the messages.

    Returns:
        The resolved ``torch.device``.

    Raises:
        TypeError: If ``module`` is not a module or ``device`` has a bad type.
        RuntimeError: If the default process group is not initialised.
        ValueError: See the checks above.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"{wrapper} needs an nn.Module, got {type(module).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{wrapper} requires an initialised torch.distributed process group; call "
            "torch.distributed.init_process_group() (e.g. under torchrun) before wrapping"
        )
    params = list(module.named_parameters())  # one pass: checks run on every wrap
    if not any(param.requires_grad for _, param in params):
        raise ValueError(
            f"{wrapper} needs at least one parameter with requires_grad=True; "
            f"{type(module).__name__} has {len(params)} parameter tensor(s) and none is "
            "trainable. Apply the trainable policy so that something trains, or do not wrap "
            "the model"
        )
    target = resolve_wrap_device(device)
    if target.type == "cuda" and target.index is None:
        raise ValueError(
            f"device must be a concrete CUDA device such as 'cuda:0' (this rank's GPU, "
            f"usually cuda:LOCAL_RANK), got {str(target)!r}"
        )
    for name, param in params:
        if param.device != target:
            raise ValueError(
                f"parameter '{name}' of {type(module).__name__} is on {param.device}, but "
                f"device={str(target)!r}; move the model first (model.to({str(target)!r}))"
            )
    return target


def resolve_wrap_device(device: object) -> torch.device:
    """A ``torch.device`` from a device, a string, or an int (CUDA index)."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, str | int):
        raise TypeError(
            f"device must be a torch.device, a string such as 'cuda:0', or an int CUDA index, "
            f"got {type(device).__name__} ({device!r})"
        )
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device index must be >= 0, got {device}")
        return torch.device("cuda", device)
    try:
        return torch.device(device)
    except RuntimeError as error:
        raise ValueError(
            f"device={device!r} is not a device string; use e.g. 'cpu' or 'cuda:0'"
        ) from error
