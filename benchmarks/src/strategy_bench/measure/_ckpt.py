"""What a checkpoint costs: checkpoint-io's save and load beside raw DCP, on the trained model."""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from distributed_strategy import (
    PendingCheckpoint,
    async_save_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from strategy_bench._errors import error_summary
from strategy_bench.measure._accounting import local_bytes
from strategy_bench.measure._options import CKPT_SAMPLES
from strategy_bench.measure._timing import timed_ms


def checkpoint_cost(
    wrapped: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    raw_first: bool,
    out: dict[str, Any],
    samples: int = CKPT_SAMPLES,
) -> None:
    """Time a checkpoint-io save beside a raw ``get_state_dict`` + ``dcp.save``, then a load.

    ``samples`` rounds (default ``CKPT_SAMPLES``) of one save each, ours and raw in
    alternating order (the first round's order is ``raw_first``: alternate it between
    points), the median of each
    recorded with every sample (``<key>_all``); only one
    checkpoint is on disk at a time (the raw one is deleted before ours is written, and ours
    after its load), and the measurement is skipped when the disk has less than
    ``DISK_FACTOR`` times the state's size free. A failure (a full disk, say) is recorded as
    ``ckpt_error`` and the point's other measurements stand.

    The directory is a temporary one that rank 0 creates and every rank is told (ranks of
    one host share it; across hosts, point ``TMPDIR`` at a shared filesystem). Records
    ``ckpt_save_ms``, ``raw_ckpt_save_ms``, ``ckpt_load_ms`` (verified, the default),
    ``ckpt_async_stall_ms`` (what ``async_save_checkpoint`` holds the caller: staging the
    state; the write itself runs behind it) and ``ckpt_bytes`` (the checkpoint's files,
    counted on rank 0), or ``ckpt_error``.
    """
    first = dist.get_rank() == 0
    state = [_state_bytes(wrapped, optimizer)]
    sizes: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(sizes, state[0])
    shared: list[Any] = [None, None]
    if first:
        folder_name = tempfile.mkdtemp(prefix="strategy-bench-ckpt-")
        free = shutil.disk_usage(folder_name).free
        need = DISK_FACTOR * sum(sizes)
        reason = None
        if free < need:
            reason = (
                f"skipped: {free / 2**30:.1f} GiB free in {folder_name}, under {DISK_FACTOR}x "
                f"the state's {sum(sizes) / 2**30:.1f} GiB; point TMPDIR at a larger disk"
            )
        shared = [folder_name, reason]
    dist.broadcast_object_list(shared, src=0)
    folder = Path(str(shared[0]))
    if shared[1] is not None:
        out["ckpt_error"] = shared[1]
        dist.barrier()
        if first:
            shutil.rmtree(folder, ignore_errors=True)
        return

    def ours() -> None:
        save_checkpoint(folder / "ours", wrapped, optimizer, rng=False, overwrite=True)

    def load() -> None:
        load_checkpoint(folder / "ours", wrapped, optimizer, rng=False)

    def raw() -> None:
        model_sd, optim_sd = get_state_dict(wrapped, optimizer)
        dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "raw"))

    def remove(name: str) -> None:
        dist.barrier()
        if first:
            shutil.rmtree(folder / name, ignore_errors=True)
        dist.barrier()

    def start_async() -> PendingCheckpoint:
        return async_save_checkpoint(folder / "async", wrapped, optimizer, rng=False)

    taken: dict[str, list[float]] = {key: [] for key in CKPT_SAMPLED}

    def ours_then_load() -> None:
        taken["ckpt_save_ms"].append(timed_ms(ours, device)[0])
        taken["ckpt_load_ms"].append(timed_ms(load, device)[0])
        out["ckpt_bytes"] = sum(
            f.stat().st_size for f in (folder / "ours").rglob("*") if f.is_file()
        )
        remove("ours")
        # The training loop's stall: until the state is staged; the write goes on behind it.
        stall, pending = timed_ms(start_async, device)
        taken["ckpt_async_stall_ms"].append(stall)
        pending.wait()
        remove("async")

    def raw_save() -> None:
        taken["raw_ckpt_save_ms"].append(timed_ms(raw, device)[0])
        remove("raw")

    try:
        for index in range(samples):  # alternating which goes first, as the wraps do
            first_raw = raw_first if index % 2 == 0 else not raw_first
            for run in (raw_save, ours_then_load) if first_raw else (ours_then_load, raw_save):
                run()
        for key, values in taken.items():
            out[key] = statistics.median(values)
            out[f"{key}_all"] = values
    except Exception as error:  # collective errors reach every rank (DCP, checkpoint-io)
        for key in CKPT_TIMES:
            out.pop(key, None)
        out["ckpt_error"] = error_summary(error, 300)
    finally:
        dist.barrier()
        if first:
            shutil.rmtree(folder, ignore_errors=True)


CKPT_SAMPLED = ("ckpt_save_ms", "raw_ckpt_save_ms", "ckpt_load_ms", "ckpt_async_stall_ms")
"""The checkpoint timings, each a median of ``CKPT_SAMPLES`` samples."""

CKPT_TIMES = (*CKPT_SAMPLED, *(f"{key}_all" for key in CKPT_SAMPLED), "ckpt_bytes")
"""What a measured checkpoint cost records (dropped together when it fails)."""

DISK_FACTOR = 2.5
"""Free disk needed, as a multiple of the state's size (one checkpoint and slack)."""


def _state_bytes(wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """What DCP writes of this rank's parameters, buffers and optimizer state.

    DCP writes a replicated tensor once: a plain tensor (DDP's replica, a buffer) is
    counted on rank 0 only, a ``DTensor``'s shard only on the ranks at coordinate 0 of each
    dimension it is replicated over (HSDP's first replica). Summed over the ranks, the bytes
    of one checkpoint.
    """
    tensors = [*wrapped.parameters(), *wrapped.buffers()]
    tensors += [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    return local_bytes(t for t in tensors if _writes(t))


def _writes(tensor: torch.Tensor) -> bool:
    """Whether this rank writes ``tensor`` (its shard) in a DCP checkpoint."""
    if not isinstance(tensor, DTensor):
        return dist.get_rank() == 0
    coordinate = list(tensor.device_mesh.get_coordinate() or ())
    return all(
        index == 0
        for index, placement in zip(coordinate, tensor.placements, strict=True)
        if placement.is_replicate()
    )
