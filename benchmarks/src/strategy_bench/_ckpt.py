"""What a checkpoint costs: checkpoint-io's save and load beside raw DCP, on the trained model."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from distributed_strategy import load_checkpoint, save_checkpoint
from strategy_bench._timing import timed_ms


def checkpoint_cost(
    wrapped: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    raw_first: bool,
    out: dict[str, Any],
) -> None:
    """Time a checkpoint-io save beside a raw ``get_state_dict`` + ``dcp.save``, then a load.

    One save each, in the order ``raw_first`` says (alternate it between points).

    The directory is a temporary one that rank 0 creates and every rank is told (ranks of
    one host share it; across hosts, point ``TMPDIR`` at a shared filesystem). Records
    ``ckpt_save_ms``, ``raw_ckpt_save_ms``, ``ckpt_load_ms`` (verified, the default) and
    ``ckpt_bytes`` (the checkpoint's files, counted on rank 0).
    """
    first = dist.get_rank() == 0
    shared = [tempfile.mkdtemp(prefix="strategy-bench-ckpt-") if first else None]
    dist.broadcast_object_list(shared, src=0)
    folder = Path(str(shared[0]))

    def ours() -> None:
        save_checkpoint(folder / "ours", wrapped, optimizer, rng=False, overwrite=True)

    def raw() -> None:
        model_sd, optim_sd = get_state_dict(wrapped, optimizer)
        dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "raw"))

    try:
        for name, save in (
            (("raw", raw), ("ours", ours))
            if raw_first
            else (
                ("ours", ours),
                ("raw", raw),
            )
        ):
            elapsed, _ = timed_ms(save, device)
            out["raw_ckpt_save_ms" if name == "raw" else "ckpt_save_ms"] = elapsed
        out["ckpt_load_ms"], _ = timed_ms(
            lambda: load_checkpoint(folder / "ours", wrapped, optimizer, rng=False), device
        )
        out["ckpt_bytes"] = sum(
            f.stat().st_size for f in (folder / "ours").rglob("*") if f.is_file()
        )
    finally:
        dist.barrier()
        if first:
            shutil.rmtree(folder, ignore_errors=True)
