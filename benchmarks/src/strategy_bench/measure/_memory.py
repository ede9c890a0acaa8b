"""Peak memory of one rank: the CUDA allocator's peak, or the process's resident set on CPU."""

from __future__ import annotations

import types

import torch

from dist_core import MemoryPeak


def memory_reached(device: torch.device) -> int | None:
    """The most this process has held: the CUDA allocator's peak, or the peak RSS on CPU.

    For the row of a point that failed (an out-of-memory error records how far it got).
    """
    try:
        if device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(device))
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    except Exception:
        return None


class PeakMemory:
    """Context manager measuring peak memory while the block runs (dist-core's ``MemoryPeak``).

    On a CUDA device: the allocator's peak of allocated bytes (``peak``) and of reserved bytes
    (``reserved``: what the caching allocator held from the device, fragmentation included)
    while the block ran; nested readings do not erase each other. Neither counts the CUDA
    context or NCCL's buffers. On CPU: the largest resident set size sampled every
    ``interval`` seconds by a background thread (and at both ends), so it includes everything
    the process holds; ``reserved`` is the same figure.

    Attributes:
        peak: The peak in bytes, set on exit.
        reserved: The peak reserved by the allocator in bytes, set on exit.
        start: Memory in use on entry, in bytes.
    """

    def __init__(self, device: torch.device, *, interval: float = 0.002) -> None:
        self.device = device
        self.peak = 0
        self.reserved = 0
        self.start = 0
        self._cuda = device.type == "cuda"
        self._reading = MemoryPeak(device, interval=interval, host=not self._cuda)

    def __enter__(self) -> PeakMemory:
        self._reading.__enter__()
        self.start = self._reading.device_start if self._cuda else self._reading.host_start
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self._reading.__exit__(exc_type, exc, tb)
        if self._cuda:
            self.peak = self._reading.device_peak
            self.reserved = self._reading.device_reserved_peak
        else:
            self.peak = self.reserved = self._reading.host_peak
