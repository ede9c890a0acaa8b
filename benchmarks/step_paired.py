"""The FSDP2 train step, this library against raw ``fully_shard``, step by step in one job.

On 2 gloo ranks (one thread each), both models of ``step_peers.py`` (built from seed 0: raw
``fully_shard`` per block then the root, and ``prepare_model``) live in the same processes and
take their steps in turns, the order swapped every iteration, each from a barrier to the
slowest rank's end. Paired this way, the machine's drift falls on both alike. Prints the
median step, its forward-and-backward and its clip-and-optimizer parts, the ratio, and whether
the weights are still bit-identical.

Usage: ``python benchmarks/step_paired.py [--iters 13]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CLIP = 1.0


def _build(side: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from step_peers import PARAMS, _model, _shard

    if side == "raw":
        model = _shard(_model())
    else:
        from distributed_strategy import prepare_model
        from strategy_bench.workload._presets import BenchTransformer

        model = prepare_model(
            BenchTransformer,
            PARAMS,
            config={"strategy": "fsdp"},
            device="cpu",
            default_dtype=torch.float32,
            seed=0,
        )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(side: str, model: torch.nn.Module, optimizer: Any, tokens: torch.Tensor) -> float:
    from grad_sync import clip_grad_norm

    begin = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    forward_backward = time.perf_counter() - begin
    if side == "raw":
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    else:
        clip_grad_norm(model, CLIP)
    optimizer.step()
    optimizer.zero_grad()
    return forward_backward


def _rank(rank: int, port: int, iters: int) -> None:
    from step_peers import BATCH, PARAMS, SEQ

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sides = {side: _build(side) for side in ("raw", "ours")}
    generator = torch.Generator().manual_seed(rank)
    warmup = 2
    times: dict[str, list[tuple[float, float]]] = {"raw": [], "ours": []}
    for index in range(iters + warmup):
        tokens = torch.randint(0, PARAMS["vocab"], (BATCH, SEQ + 1), generator=generator)
        for side in ("raw", "ours") if index % 2 == 0 else ("ours", "raw"):
            dist.barrier()
            begin = time.perf_counter()
            forward_backward = _step(side, *sides[side], tokens)
            dist.barrier()
            if index >= warmup:
                times[side].append((time.perf_counter() - begin, forward_backward))
    pairs = zip(sides["raw"][0].parameters(), sides["ours"][0].parameters(), strict=True)
    identical = all(torch.equal(a.to_local(), b.to_local()) for a, b in pairs)
    if rank == 0:
        step = {side: 1e3 * statistics.median(t for t, _ in rows) for side, rows in times.items()}
        fb = {side: 1e3 * statistics.median(f for _, f in rows) for side, rows in times.items()}
        rest = {
            side: 1e3 * statistics.median(t - f for t, f in rows) for side, rows in times.items()
        }
        sys.stdout.write(
            json.dumps(
                {
                    "iters": iters,
                    "step_ms": step,
                    "ratio": step["ours"] / step["raw"],
                    "forward_backward_ms": fb,
                    "clip_optimizer_ms": rest,
                    "identical": identical,
                }
            )
            + "\n"
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    """Spawn the two ranks and print the paired figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=13)
    args = parser.parse_args()
    if args.iters < 1:
        parser.error(f"--iters must be >= 1, got {args.iters}")
    from step_peers import _free_port

    mp.spawn(_rank, args=(_free_port(), args.iters), nprocs=2)


if __name__ == "__main__":
    main()
