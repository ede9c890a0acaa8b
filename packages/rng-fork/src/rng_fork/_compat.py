"""Torch-version differences for rng-fork, kept in one place."""

from __future__ import annotations

from types import ModuleType

import torch


def device_module(device_type: str) -> ModuleType:
    """The torch device module (``torch.cuda``, ``torch.xpu``, ``torch.mps``, ...) of a type."""
    get = getattr(torch, "get_device_module", None)
    if get is not None:
        module: ModuleType = get(device_type)
        return module
    fallback = getattr(torch, device_type, None)  # torch < 2.3
    if not isinstance(fallback, ModuleType):
        raise ValueError(f"torch has no device module for device type {device_type!r}")
    return fallback


def current_accelerator_type() -> str:
    """The accelerator type that a bare integer device index refers to (``"cuda"`` if unsure)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        current = accelerator.current_accelerator()
        if current is not None:
            return str(current.type)
    return "cuda"
