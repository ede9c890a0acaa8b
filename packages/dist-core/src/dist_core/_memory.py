"""How much memory a stretch of work took: the host's resident set and the accelerator's peak."""

from __future__ import annotations

import os
import threading
import types

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss() -> int:
    """Resident set size of this process in bytes (0 where ``/proc`` is unavailable)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except OSError:  # pragma: no cover - not Linux
        return 0


class MemoryPeak:
    """Context manager: the peak host and accelerator memory while its block runs.

    Host: the largest resident set size of this process, sampled every ``interval`` seconds
    by a background thread (and at both ends), minus the size on entry. Device: on an
    accelerator with an allocator that keeps statistics (CUDA), ``max_memory_allocated``
    after resetting the peak on entry, minus what was allocated on entry; ``0`` on CPU
    (the device's memory is the host's).

    Attributes:
        host_start: Resident set size on entry, in bytes.
        host_peak: The largest resident set size seen, in bytes (set on exit).
        device_start: Device memory allocated on entry, in bytes.
        device_peak: The device allocator's peak, in bytes (set on exit).
    """

    def __init__(self, device: torch.device | None = None, *, interval: float = 0.002) -> None:
        self.device = device
        self.interval = interval
        self.host_start = self.host_peak = 0
        self.device_start = self.device_peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def host_growth(self) -> int:
        """How far the resident set grew above its size on entry, in bytes."""
        return max(0, self.host_peak - self.host_start)

    @property
    def device_growth(self) -> int:
        """How far the device allocator's use grew above its use on entry, in bytes."""
        return max(0, self.device_peak - self.device_start)

    def __enter__(self) -> MemoryPeak:
        if self._tracks_device():
            assert self.device is not None
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.device_start = self.device_peak = torch.cuda.memory_allocated(self.device)
        self.host_start = self.host_peak = current_rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="memory-peak")
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.host_peak = max(self.host_peak, current_rss())
        if self._tracks_device():
            assert self.device is not None
            torch.cuda.synchronize(self.device)
            self.device_peak = torch.cuda.max_memory_allocated(self.device)

    def _tracks_device(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.host_peak = max(self.host_peak, current_rss())
