"""Each stage of prepare_model: its time and memory peaks (host RSS, device allocator)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dist_core import MemoryPeak


class Stages:
    """Each stage's time and memory peaks (host RSS, device allocator), summed over entries."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._seconds: dict[str, float] = {}
        self._host: dict[str, int] = {}
        self._device_peak: dict[str, int] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        peak = MemoryPeak(self._device, interval=0.005)
        try:
            with peak:
                yield
        finally:
            self._seconds[stage] = self._seconds.get(stage, 0.0) + time.perf_counter() - start
            self._host[stage] = max(self._host.get(stage, 0), peak.host_growth)
            self._device_peak[stage] = max(self._device_peak.get(stage, 0), peak.device_peak)

    def summary(self) -> str:
        """``build 12.3 ms (host +40.0 MiB), ...``; the device's peak where it keeps one."""
        parts = []
        for stage, seconds in self._seconds.items():
            memory = f"host +{self._host[stage] / 2**20:.1f} MiB"
            if self._device.type == "cuda":
                memory += f", device peak {self._device_peak[stage] / 2**20:.1f} MiB"
            parts.append(f"{stage} {seconds * 1e3:.1f} ms ({memory})")
        return ", ".join(parts)
