"""A fake multi-device accelerator module with the torch device-module RNG API."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch


def patch_device_module(monkeypatch: pytest.MonkeyPatch, lookup: Callable[[str], Any]) -> None:
    """Make ``torch.get_device_module`` answer every lookup with ``lookup(device_type)``.

    A test then sees each device-module lookup that the code under test makes.
    """

    def get_device_module(device: Any = None) -> Any:
        kind = device if isinstance(device, str) else getattr(device, "type", None)
        return lookup(str(kind))

    monkeypatch.setattr(torch, "get_device_module", get_device_module)


class FakeAccelerator:
    def __init__(self, count: int = 4, *, available: bool = True) -> None:
        self.generators = [torch.Generator().manual_seed(1000 + i) for i in range(count)]
        self.current = 0
        self.available = available
        self.calls: list[tuple[str, int]] = []
        self.fail_set = False

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return len(self.generators)

    def current_device(self) -> int:
        return self.current

    def get_rng_state(self, index: int) -> torch.Tensor:
        self.calls.append(("get", index))
        return self.generators[index].get_state()

    def set_rng_state(self, state: torch.Tensor, index: int) -> None:
        self.calls.append(("set", index))
        if self.fail_set:
            raise RuntimeError("fake device failure")
        self.generators[index].set_state(state)

    def manual_seed(self, seed: int) -> None:
        self.calls.append(("seed", self.current))
        self.generators[self.current].manual_seed(seed)

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        previous, self.current = self.current, index
        try:
            yield
        finally:
            self.current = previous

    def states(self) -> list[torch.Tensor]:
        return [g.get_state() for g in self.generators]
