"""Peak memory of one rank: the CUDA allocator's peak, or the process's resident set on CPU."""

from __future__ import annotations

import threading
import types

import torch

from distributed_strategy import current_rss


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
    """Context manager measuring peak memory while the block runs.

    On a CUDA device: ``torch.cuda.max_memory_allocated`` (``peak``) and
    ``max_memory_reserved`` (``reserved``: what the caching allocator held from the device,
    fragmentation included) after resetting both peaks on entry. Neither counts the CUDA
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
        self.interval = interval
        self.peak = 0
        self.reserved = 0
        self.start = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            return self
        self.start = self.peak = current_rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.reserved = torch.cuda.max_memory_reserved(self.device)
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = self.reserved = max(self.peak, current_rss())

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, current_rss())
