"""Which random generators a device names, and how to read, write and seed exactly those."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

# Device types that have no generator of their own: forking them forks the CPU stream only.
_HOST_TYPES = frozenset({"cpu", "meta"})


@dataclass(frozen=True)
class AcceleratorStream:
    """The default generator of one accelerator device: read, write and seed only it."""

    type: str
    index: int
    module: ModuleType

    def get_state(self) -> torch.Tensor:
        """A copy of this device's generator state."""
        state: torch.Tensor = self.module.get_rng_state(self.index)
        return state

    def set_state(self, state: torch.Tensor) -> None:
        """Set this device's generator state."""
        self.module.set_rng_state(state, self.index)

    def seed(self, seed: int) -> None:
        """Seed this device's generator, and no other device's."""
        context = getattr(self.module, "device", None)
        if context is None:  # single-device backends (mps) seed their only generator
            self.module.manual_seed(seed)
            return
        with context(self.index):
            self.module.manual_seed(seed)


def accelerator_stream(device: torch.device | None, *, argument: str) -> AcceleratorStream | None:
    """The accelerator generator that ``device`` names, or ``None`` for CPU, meta or no device.

    Raises:
        RuntimeError: If the device type is not available in this process, or the index is
            out of range. Nothing is initialized before the checks pass.
    """
    if device is None or device.type in _HOST_TYPES:
        return None
    module = torch.get_device_module(device.type)
    if not module.is_available():
        raise RuntimeError(
            f"{argument}={str(device)!r}: {device.type} is not available in this process; "
            "pass a device that exists here (e.g. 'cpu')"
        )
    current = getattr(module, "current_device", None)
    index = device.index if device.index is not None else int(current() if current else 0)
    count = int(module.device_count())
    if index >= count:
        raise RuntimeError(
            f"{argument}={str(device)!r}: only {count} {device.type} device(s) are visible; "
            f"use an index in 0..{count - 1}"
        )
    return AcceleratorStream(type=device.type, index=index, module=module)
