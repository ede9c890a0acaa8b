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


# The device readings open now, by device index, innermost last. The allocator keeps one peak
# per device, and a reading resets it on entry: before any reset, every open reading takes the
# peak reached so far, so that nested readings (prepare_model's stages inside a caller's
# reading) never erase each other. All of them were open since the last reset.
_OPEN: dict[int, list[MemoryPeak]] = {}
_OPEN_LOCK = threading.Lock()


def _fold_peak_into_open(index: int) -> None:
    """Every open reading of device ``index`` takes the allocator's peaks since the last reset."""
    allocated = torch.cuda.max_memory_allocated(index)
    reserved = torch.cuda.max_memory_reserved(index)
    for reading in _OPEN.get(index, ()):
        reading.device_peak = max(reading.device_peak, allocated)
        reading.device_reserved_peak = max(reading.device_reserved_peak, reserved)


class MemoryPeak:
    """Context manager: the peak host and accelerator memory while its block runs.

    Host: the largest resident set size of this process, sampled every ``interval`` seconds
    by a background thread (and at both ends), minus the size on entry. Device: on an
    accelerator with an allocator that keeps statistics (CUDA), the allocator's peak
    (``max_memory_allocated``) while the block ran; ``0`` on CPU (the device's memory is the
    host's). Readings nest: the allocator keeps a single peak per device, which a reading
    resets on entry, so every reading still open first takes the peak reached so far (an outer
    reading around ``prepare_model`` sees the peak of every stage, not only the last one).

    Args:
        device: The device whose allocator is read (``None`` or CPU: host only).
        interval: Seconds between two samples of the host's resident set.
        host: Sample the host's resident set (a background thread); ``False`` reads only
            the device.

    Attributes:
        host_start: Resident set size on entry, in bytes.
        host_peak: The largest resident set size seen, in bytes (set on exit).
        device_start: Device memory allocated on entry, in bytes.
        device_peak: The device allocator's peak, in bytes (set on exit).
        device_reserved_peak: The most the caching allocator reserved from the device, in
            bytes (set on exit; fragmentation included).
    """

    def __init__(
        self, device: torch.device | None = None, *, interval: float = 0.002, host: bool = True
    ) -> None:
        self.device = device
        self.interval = interval
        self.host = host
        self.host_start = self.host_peak = 0
        self.device_start = self.device_peak = self.device_reserved_peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._index: int | None = None  # the CUDA device read, fixed on entry

    @property
    def host_growth(self) -> int:
        """How far the resident set grew above its size on entry, in bytes."""
        return max(0, self.host_peak - self.host_start)

    @property
    def device_growth(self) -> int:
        """How far the device allocator's use grew above its use on entry, in bytes."""
        return max(0, self.device_peak - self.device_start)

    def __enter__(self) -> MemoryPeak:
        index = self._index = self._device_index()
        if index is not None:
            torch.cuda.synchronize(index)
            with _OPEN_LOCK:
                _fold_peak_into_open(index)
                torch.cuda.reset_peak_memory_stats(index)
                self.device_start = self.device_peak = torch.cuda.memory_allocated(index)
                self.device_reserved_peak = torch.cuda.memory_reserved(index)
                _OPEN.setdefault(index, []).append(self)
        if self.host:
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
        if self.host:
            self.host_peak = max(self.host_peak, current_rss())
        index, self._index = self._index, None
        if index is not None:
            torch.cuda.synchronize(index)
            with _OPEN_LOCK:
                _fold_peak_into_open(index)  # this reading and the ones around it
                open_now = _OPEN.get(index, [])
                if self in open_now:
                    open_now.remove(self)

    def _device_index(self) -> int | None:
        """The CUDA device index read, or ``None`` when no device allocator is read."""
        if self.device is None or self.device.type != "cuda":
            return None
        return torch.cuda.current_device() if self.device.index is None else self.device.index

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.host_peak = max(self.host_peak, current_rss())
