"""Whether an estimated rank fits a device: the datasheet memory table and the reserve."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from strategy_bench._errors import BenchUsageError

DATASHEET_MEMORY_GIB: dict[str, float] = {
    "B200": 178.4,
    "H200": 139.8,
    "H100": 79.2,
    "A100-80GB": 79.2,
    "A100-40GB": 39.4,
    "L40S": 44.4,
    "A10G": 22.0,
    "L4": 22.0,
}
"""Memory per GPU as CUDA reports it (``torch.cuda.get_device_properties(i).total_memory``, in
GiB), what ``--gpu NAME`` reads, beside the FLOPs table
(``strategy_bench.measure._flops.DATASHEET_TFLOPS``). Not the datasheets' figures: an H200's
"141 GB" is about 139.8 GiB to CUDA, an H100's "80 GB" 79.2 GiB, and a table of datasheet
figures made ``fits`` 1-2 GiB optimistic. The H200's figure was read on this project's lent
H200 ("about 139 GiB"); the others are the capacities those cards report, rounded down to
0.1 GiB. Pass ``--device-memory`` for a card not listed or a figure of your own."""

DEVICE_RESERVE_BYTES = 2 * 2**30
"""Taken off every device's memory (as CUDA reports it) before a rank's peak is compared with
it: the CUDA context (about 0.5-1 GiB with torch's kernels loaded) and NCCL's communication
buffers (a few hundred MiB per communicator), which no tensor estimate sees."""


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """A device's memory and what of it the tensors may use.

    Attributes:
        name: The GPU's name, or ``"--device-memory"`` for a given size.
        total_bytes: The device's memory.
        reserve_bytes: Kept for the CUDA context and NCCL (:data:`DEVICE_RESERVE_BYTES`).
    """

    name: str
    total_bytes: int
    reserve_bytes: int = DEVICE_RESERVE_BYTES

    @property
    def usable_bytes(self) -> int:
        """What a rank's tensors may use."""
        return self.total_bytes - self.reserve_bytes

    def to_json(self) -> dict[str, Any]:
        """The device as ``estimate.json`` records it."""
        return {**dataclasses.asdict(self), "usable_bytes": self.usable_bytes}


def device_memory(gpu: str | None, gib: float | None) -> DeviceMemory | None:
    """The device named by ``--gpu`` or sized by ``--device-memory``; ``None`` for neither.

    Raises:
        BenchUsageError: An unknown GPU (the known ones are listed), or a size that is not a
            positive number of GiB larger than the reserve.
    """
    if gpu is not None:
        known = {name.lower(): name for name in DATASHEET_MEMORY_GIB}
        name = known.get(gpu.lower())
        if name is None:
            raise BenchUsageError(
                f"--gpu {gpu!r} is not in the datasheet table; known: "
                f"{', '.join(DATASHEET_MEMORY_GIB)} (or give --device-memory GIB)"
            )
        return DeviceMemory(name, int(DATASHEET_MEMORY_GIB[name] * 2**30))
    if gib is None:
        return None
    reserve = DEVICE_RESERVE_BYTES / 2**30
    if not math.isfinite(gib) or gib <= reserve:
        raise BenchUsageError(
            f"--device-memory must be a number of GiB above the {reserve:g} GiB reserved for "
            f"the CUDA context and NCCL, got {gib:g}"
        )
    return DeviceMemory("--device-memory", round(gib * 2**30))


def annotate_fits(row: Mapping[str, Any], device: DeviceMemory) -> dict[str, Any]:
    """``fits`` and ``headroom_bytes``: usable memory less the row's device peak.

    The device peak is ``peak_bytes``, or, for a point that offloads, ``device_peak_bytes``
    (its sharded state is in host memory).
    """
    headroom = device.usable_bytes - int(row.get("device_peak_bytes") or row["peak_bytes"])
    return {"fits": headroom >= 0, "headroom_bytes": headroom}
