"""Device check: FSDP's prepare_model from rank 0 never holds the whole model on the device.

Run by ``benchmarks/device_check.sh`` (one process, one rank: NCCL on a GPU, gloo on CPU).
The bound is the estimate's own init peak for this source (this rank's shards plus one stream
bucket or the largest tensor in transit, ``strategy_bench.estimate._init_peak``) plus 10%: the full
replica that the path before it built first would add the whole model again. On CUDA the
figure is the allocator's peak during ``prepare_model``; on CPU the resident set's growth
(plus 96 MiB of slack for the process's own allocations).

    python benchmarks/fsdp_init_memory.py --device cuda --width 4096 --depth 12
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from distributed_strategy import MemoryPeak, prepare_model
from strategy_bench.estimate import ModelSizes, init_peaks


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


def main() -> int:
    """Prepare the model on one rank, print the figures as one JSON line; 1 if over bound."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=12)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if args.device == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=0, world_size=1)
    params = {"width": args.width, "depth": args.depth}
    try:
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
            reached, slack = peak.device_peak, 0
        else:
            reached, slack = peak.host_growth, 96 * 2**20
        expected = init_peaks(sizes, "fsdp", shards, 1)["rank0"]["device"]
        bound = int(1.10 * expected) + slack
        report = {
            "device": str(device),
            "model_bytes": sizes.whole,
            "shard_bytes": shards,
            "largest_tensor_bytes": sizes.largest_tensor,
            "estimated_bytes": expected,
            "peak_bytes": reached,
            "bound_bytes": bound,
            "ok": reached <= bound,
        }
        sys.stdout.write(json.dumps(report) + "\n")
        dist.barrier()
        return 0 if report["ok"] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
