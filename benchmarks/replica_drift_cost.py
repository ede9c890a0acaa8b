"""What ``replica_drift`` costs beside a training step: the bench's ``small`` under DDP.

Two gloo ranks on this host (``--ranks``), AdamW, batch 8; each round times one training step
and then one ``replica_drift`` call between barriers; the medians of the rounds after the
first are printed, with their ratio::

    python benchmarks/replica_drift_cost.py --rounds 6

Needs strategy-bench (for the preset) and replica-init installed (``nox -s bench`` builds them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel


def _rank(rank: int, world: int, store: str, rounds: int, queue: Any) -> None:
    from replica_init import replica_drift
    from strategy_bench.workload import PRESETS, BenchTransformer, next_token_loss, synthetic_tokens

    torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        torch.manual_seed(0)
        preset = PRESETS["small"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = DistributedDataParallel(
                BenchTransformer(**preset.init_params()), broadcast_buffers=False
            )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(rank)
        tokens = synthetic_tokens(8, preset.seq_len, preset.vocab, torch.device("cpu"), generator)
        steps, calls = [], []
        for _ in range(rounds):
            dist.barrier()
            begin = time.perf_counter()
            next_token_loss(model, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
            dist.barrier()
            steps.append(time.perf_counter() - begin)
            begin = time.perf_counter()
            report = replica_drift(model)
            dist.barrier()
            calls.append(time.perf_counter() - begin)
        if rank == 0:
            queue.put(
                {
                    "params": sum(p.numel() for p in model.parameters()),
                    "tensors_compared": report.compared,
                    "drifted": report.drifted,
                    "step_ms": statistics.median(steps[1:]) * 1e3,
                    "replica_drift_ms": statistics.median(calls[1:]) * 1e3,
                }
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Spawn the ranks, print the medians and their ratio as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        mp.start_processes(
            _rank,
            args=(args.ranks, store, max(2, args.rounds), queue),
            nprocs=args.ranks,
            start_method="spawn",
        )
    result = queue.get(timeout=10)
    result["ratio"] = result["replica_drift_ms"] / result["step_ms"]
    sys.stdout.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
