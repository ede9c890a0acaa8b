"""How long a checkpoint of the bench's ``large`` takes, against the 30 s kill window.

torchrun's agent sends SIGKILL 30 s after SIGTERM (``--shutdown-timeout``), and SLURM's
``KillWait`` is 30 s by default: a save that starts on SIGTERM must finish inside it. Two gloo
ranks on this host, the model sharded with ``fully_shard`` (per block, then the root), AdamW's
state filled as after a step; each case once, in a fresh directory, fsynced:

- ``sync``: ``save_checkpoint`` of the model and AdamW (what CheckpointManager writes);
- ``sync, model only`` and ``async, model only``: ``async_save_checkpoint`` stages the whole
  state in host memory first, which for the model and AdamW (16 GB) would not fit this 24 GB
  host beside the live state; its stall and its total are measured on the model alone.

Writes ``save_vs_kill_window.json`` and ``README.md`` into ``--out``::

    python benchmarks/save_vs_kill_window.py --out docs/results/clusters
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KILL_WINDOW_S = 30.0


def _rank(rank: int, world: int, store: str, folder: str, queue: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    from checkpoint_io import async_save_checkpoint, save_checkpoint
    from strategy_bench.workload import PRESETS, BenchTransformer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=900),
    )
    try:
        with torch.device("meta"):
            model = BenchTransformer(**PRESETS["large"].init_params())
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for p in model.parameters():  # AdamW's state after a step, without the gradients
            optimizer.state[p] = {
                "step": torch.tensor(1.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
        times: dict[str, float] = {}

        def timed(name: str, work: Any) -> Any:
            dist.barrier()
            start = time.perf_counter()
            out = work()
            dist.barrier()
            times[name] = time.perf_counter() - start
            return out

        root = Path(folder)
        timed("sync", lambda opt=optimizer: save_checkpoint(root / "sync", model, opt))
        if rank == 0:
            shutil.rmtree(root / "sync")
        optimizer.state.clear()  # room for the async staging copy
        timed("sync_model", lambda: save_checkpoint(root / "sync_model", model))
        if rank == 0:
            shutil.rmtree(root / "sync_model")
        dist.barrier()
        start = time.perf_counter()
        pending = async_save_checkpoint(root / "async_model", model)
        times["async_stall_model"] = time.perf_counter() - start
        pending.wait()
        dist.barrier()
        times["async_total_model"] = time.perf_counter() - start
        state_bytes = sum(p.to_local().numel() * 4 for p in model.parameters()) * world
        queue.put((rank, times, state_bytes))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Measure and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory(dir=os.environ.get("SAVE_DIR")) as tmp:
        store = os.path.join(tmp, "store")
        procs = [context.Process(target=_rank, args=(r, 2, store, tmp, queue)) for r in range(2)]
        for proc in procs:
            proc.start()
        results = sorted(queue.get(timeout=1800) for _ in procs)
        for proc in procs:
            proc.join(timeout=120)
    times = {k: max(r[1][k] for r in results) for k in results[0][1]}
    model_bytes = results[0][2]
    report = {
        "torch": torch.__version__,
        "model_bytes": model_bytes,
        "with_adamw_bytes": 3 * model_bytes,
        "seconds": times,
        "kill_window_s": KILL_WINDOW_S,
    }
    (args.out / "save_vs_kill_window.json").write_text(json.dumps(report, indent=2) + "\n")
    gb = 1e9
    rows = [
        ("sync save, model + AdamW", 3 * model_bytes, times["sync"]),
        ("sync save, model only", model_bytes, times["sync_model"]),
        ("async save, model only: training stalled", model_bytes, times["async_stall_model"]),
        ("async save, model only: until published", model_bytes, times["async_total_model"]),
    ]
    lines = [
        "# Save time of the bench's `large` against the 30 s kill window",
        "",
        f"2 gloo ranks on this CPU host (2 cores), FSDP2, torch {torch.__version__}; each case "
        "once, fsynced. Command: `python benchmarks/save_vs_kill_window.py --out "
        "docs/results/clusters`.",
        "",
        "| case | state | seconds | share of the 30 s window |",
        "| --- | --- | --- | --- |",
        *[
            f"| {name} | {size / gb:.1f} GB | {sec:.1f} | {sec / KILL_WINDOW_S:.0%} |"
            for name, size, sec in rows
        ],
        "",
        "A save started on SIGTERM must end inside the window, or the checkpoint is lost; save on "
        "an earlier signal (`sbatch --signal=USR1@N`), with N above one step plus the sync save.",
        "",
    ]
    (args.out / "README.md").write_text("\n".join(lines))
    sys.stdout.write("\n".join(lines))


if __name__ == "__main__":
    main()
