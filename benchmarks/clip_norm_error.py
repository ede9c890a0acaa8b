"""The global gradient norm under FSDP2, ours and torch's, against a float64 reference.

On 2 gloo ranks, the nanoGPT-sized model of ``step_peers.py`` sharded with ``fully_shard``:
for each of ``--steps`` steps, the total 2-norm of the sharded gradients as grad-sync's
``clip_grad_norm`` computes it, as torch's ``get_total_norm`` computes it on the ``DTensor``
gradients, and as the reduction ``clip_grad_norm`` falls back on where torch's cannot run
(each rank's shards' norm, squared, summed over the ranks, the square root), each against the
norm of the gathered gradients in float64, and the collectives each issues
(torch's ``CommDebugMode``). Prints one JSON line per step and a summary: the largest relative
error of each, how often the two are the same float, and the collectives per norm.

Usage: ``python benchmarks/clip_norm_error.py [--steps 20]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from grad_sync._clip import _power, _total_norm


def _rank(rank: int, port: int, steps: int) -> None:
    from step_peers import BATCH, PARAMS, SEQ, _model, _shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = _shard(_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    rows = []
    for step in range(steps):
        tokens = torch.randint(0, PARAMS["vocab"], (BATCH, SEQ + 1), generator=generator)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        with CommDebugMode() as ours_comm:
            total = _total_norm(grads, 2.0, None)
            ours = (total.full_tensor() if isinstance(total, DTensor) else total).item()
        with CommDebugMode() as torch_comm:
            theirs = torch.nn.utils.get_total_norm(grads, 2.0).full_tensor().item()
        # the reduction clip_grad_norm falls back on (host shards over an NCCL mesh, mixed
        # meshes): each rank's shards' squared norm, summed over the ranks
        shards = _power([g.to_local() for g in grads], 2.0, None, torch.device("cpu"))
        dist.all_reduce(shards)
        fallback = shards.sqrt().item()
        full = [g.full_tensor().double() for g in grads]
        reference = torch.linalg.vector_norm(torch.stack([g.norm() for g in full])).item()
        rows.append(
            {
                "step": step,
                "reference": reference,
                "ours_rel_error": abs(ours - reference) / reference,
                "torch_rel_error": abs(theirs - reference) / reference,
                "fallback_rel_error": abs(fallback - reference) / reference,
                "fallback_same_float": fallback == theirs,
                "same_float": ours == theirs,
                "ours_collectives": ours_comm.get_total_counts(),
                "torch_collectives": torch_comm.get_total_counts(),
            }
        )
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        for row in rows:
            sys.stdout.write(json.dumps(row) + "\n")
        summary = {
            "steps": steps,
            "ours_max_rel_error": max(r["ours_rel_error"] for r in rows),
            "torch_max_rel_error": max(r["torch_rel_error"] for r in rows),
            "fallback_max_rel_error": max(r["fallback_rel_error"] for r in rows),
            "same_float_steps": sum(r["same_float"] for r in rows),
            "fallback_same_float_steps": sum(r["fallback_same_float"] for r in rows),
            "collectives_per_norm": {
                "ours": rows[-1]["ours_collectives"],
                "torch": rows[-1]["torch_collectives"],
            },
            "float32_eps": torch.finfo(torch.float32).eps,
        }
        sys.stdout.write(json.dumps(summary) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    """Spawn the two ranks and print what they measured."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    from step_peers import _free_port

    mp.spawn(_rank, args=(_free_port(), args.steps), nprocs=2)


if __name__ == "__main__":
    main()
