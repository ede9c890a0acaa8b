"""Device check: FSDP's prepare_model from rank 0 never holds the whole model on the device.

Run by ``benchmarks/device_check.sh``, on ``--ranks`` spawned ranks (default 2): NCCL with
rank r on cuda:r where that many GPUs are visible; on a host with fewer GPUs, gloo with every
rank on cuda:0 (the init's collectives are broadcasts and object gathers, which gloo runs;
each process's allocator is its own); gloo on the host with ``--device cpu``.

The bound is the estimate's own init peak for this source (a rank's shards plus one stream
bucket or the largest unit or tensor in transit, ``strategy_bench.estimate._init_peak``) plus
10%. At 2 ranks a rank's shards are half the model, so the bound is below the whole model: a
path that put the full replica on the device first fails the check (the script says so with
``discriminates``; at 1 rank the bound is the whole model and proves nothing). On CUDA each
rank's figure is the allocator's peak during ``prepare_model`` (nested stage readings no longer
reset it: dist-core's ``MemoryPeak``); on CPU the resident set's growth of the ranks that
built on the meta device (rank 0 builds the whole model on its host by design), plus 128 MiB of
slack for the process's own allocations.

    python benchmarks/fsdp_init_memory.py --device cuda --width 4096 --depth 12 --ranks 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dist_core import MemoryPeak
from distributed_strategy import prepare_model
from strategy_bench.estimate import ModelSizes, init_peaks

CPU_SLACK_BYTES = 128 * 2**20


class Wide(nn.Module):
    """Blocks of two square linear layers (FSDP's units) between a tied embedding and head.

    A unit is twice its largest tensor, which is what the load holds in transit.
    """

    def __init__(self, width: int, depth: int, vocab: int = 8192) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Linear(width, width)) for _ in range(depth)
        )
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("noise", torch.randn(width), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of ``tokens``."""
        x = self.embed(tokens) + self.noise
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _layout(kind: str, ranks: int) -> tuple[str, list[torch.device]]:
    """The backend and each rank's device."""
    if kind == "cpu":
        return "gloo", [torch.device("cpu")] * ranks
    if torch.cuda.device_count() >= ranks:
        return "nccl", [torch.device("cuda", r) for r in range(ranks)]
    return "gloo", [torch.device("cuda", 0)] * ranks


def _rank(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    backend, devices = _layout(args.device, args.ranks)
    device = devices[rank]
    extra: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if backend == "nccl":
            extra["device_id"] = device
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    dist.init_process_group(
        backend,
        store=dist.FileStore(store, args.ranks),
        rank=rank,
        world_size=args.ranks,
        timeout=datetime.timedelta(seconds=60),
        **extra,
    )
    try:
        params = {"width": args.width, "depth": args.depth}
        with torch.device("meta"):
            sizes = ModelSizes.of(Wide(**params))
        with MemoryPeak(device) as peak:
            model = prepare_model(
                Wide,
                params,
                config={"strategy": "fsdp", "source": "rank0"},
                device=device,
                default_dtype=torch.float32,
                seed=0,
            )
        shards = sum(
            t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else 0
            for t in model.parameters()
        )
        if device.type == "cuda":
            reached, slack, checked = peak.device_peak - peak.device_start, 0, True
        else:  # rank 0 builds the whole model on its host by design
            reached, slack, checked = peak.host_growth, CPU_SLACK_BYTES, rank > 0
        expected = init_peaks(sizes, "fsdp", shards, args.ranks)["rank0"]["device"]
        bound = int(1.10 * expected) + slack
        report = {
            "rank": rank,
            "backend": backend,
            "device": str(device),
            "model_bytes": sizes.whole,
            "shard_bytes": shards,
            "largest_unit_bytes": sizes.largest_unit,
            "estimated_bytes": expected,
            "peak_bytes": reached,
            "bound_bytes": bound,
            "checked": checked,
            "ok": reached <= bound or not checked,
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> int:
    """Prepare the model on every rank; print the figures as JSON; 1 if a rank is over bound."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    if args.ranks < 1:
        parser.error(f"--ranks must be >= 1, got {args.ranks}")
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        mp.spawn(_rank, args=(args, store, folder), nprocs=args.ranks, join=True)
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    whole = ranks[0]["model_bytes"]
    checked = [r for r in ranks if r["checked"]]
    summary = {
        "ranks": ranks,
        # The check can fail: a full replica on the device is over every checked bound.
        "discriminates": bool(checked) and all(r["bound_bytes"] < whole for r in checked),
        "ok": all(r["ok"] for r in ranks),
    }
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0 if summary["ok"] and summary["discriminates"] else 1


if __name__ == "__main__":
    sys.exit(main())
