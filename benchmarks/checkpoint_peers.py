"""A DDP checkpoint's save and verified load beside its peers, on 2 gloo ranks.

The same nanoGPT-sized model (6 blocks, 512 wide, vocab 4096: 23.1 M parameters) with its
AdamW state, wrapped by Accelerate's ``prepare`` (torch's DDP), saved and loaded by:

- checkpoint-io: ``save_checkpoint`` / ``load_checkpoint`` (verified: every record's digest);
- raw DCP: ``get_state_dict`` + ``dcp.save`` / ``dcp.load`` + ``set_state_dict``;
- Accelerate: ``save_state`` / ``load_state`` (its model as one safetensors file, the
  optimizer and RNG through ``torch.save``; no digest);
- the floor of a verified, all-or-nothing load (load only): the bytes work alone on
  checkpoint-io's files, with no planning and no check: every record read into a fresh tensor
  and hashed, then the model's copied into the live parameters (the optimizer's kept as read).

Each round runs them in a rotated order, each timed from a barrier to the slowest rank's
end; the medians and the spread of the rounds are printed as JSON, with the ratios to raw DCP
and to Accelerate. Accelerate is an optional peer: without it, one line says so.

Usage: ``python benchmarks/checkpoint_peers.py [--rounds 6] [--width 512] [--out FILE]``
(``--width`` scales the bytes, the tensor count stays).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from checkpoint_io import load_checkpoint, save_checkpoint
from safe_store import read_header, record_digest
from strategy_bench.workload._presets import BenchTransformer


def _rank(rank: int, world: int, port: int, folder: str, rounds: int, out: str, width: int) -> None:
    from accelerate import Accelerator

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = BenchTransformer(vocab=4096, width=width, depth=6, heads=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(rank))
    model(tokens).float().mean().backward()
    optimizer.step()
    root = Path(folder)

    def raw_save() -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / "raw"))

    def raw_load() -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(root / "raw"))
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

    def floor_load() -> None:
        staged: dict[str, torch.Tensor] = {}
        for file in sorted((root / "ours").glob("rank*.safetensors")):
            entries = read_header(file).entries
            with open(file, "rb", buffering=0) as stream:
                for name, entry in entries.items():
                    tensor = torch.empty(entry.shape, dtype=entry.dtype)
                    view = tensor.reshape(-1).view(torch.uint8).numpy()
                    stream.seek(entry.data_start + entry.begin)
                    stream.readinto(view)  # type: ignore[attr-defined]
                    record_digest(view.data)
                    staged[name] = tensor
        with torch.no_grad():
            for name, value in model.module.state_dict().items():
                value.copy_(staged[f"model.{name}"])

    cases: dict[str, Callable[[], object]] = {
        "ours_save": lambda: save_checkpoint(root / "ours", model, optimizer, overwrite=True),
        "ours_load": lambda: load_checkpoint(root / "ours", model, optimizer),
        "raw_save": raw_save,
        "raw_load": raw_load,
        "accelerate_save": lambda: accelerator.save_state(str(root / "accelerate")),
        "accelerate_load": lambda: accelerator.load_state(str(root / "accelerate")),
        "floor_load": floor_load,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    peers = ["ours", "raw", "accelerate", "floor"]
    for round_ in range(rounds + 1):  # the first round warms up, untimed
        order = peers[round_ % 4 :] + peers[: round_ % 4]
        for kind in ("save", "load"):
            for peer in order:
                name = f"{peer}_{kind}"
                if name not in cases:
                    continue
                if kind == "save" and rank == 0:
                    shutil.rmtree(root / peer, ignore_errors=True)
                dist.barrier()
                start = time.perf_counter()
                cases[name]()
                took = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's end
                if round_:
                    times[name].append(float(took))
    if rank == 0:
        summary: dict[str, Any] = {}
        for name, values in times.items():
            q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
            summary[name] = {"median_s": statistics.median(values), "q1": q[0], "q3": q[-1]}
        for kind in ("save", "load"):
            ours = summary[f"ours_{kind}"]["median_s"]
            summary[f"{kind}_ours_over_raw"] = ours / summary[f"raw_{kind}"]["median_s"]
            summary[f"{kind}_ours_over_accelerate"] = (
                ours / summary[f"accelerate_{kind}"]["median_s"]
            )
        floor = summary["floor_load"]["median_s"]
        summary["load_floor_over_accelerate"] = floor / summary["accelerate_load"]["median_s"]
        summary["load_ours_over_floor"] = summary["ours_load"]["median_s"] / floor
        summary["rounds"] = rounds
        summary["parameters"] = sum(p.numel() for p in model.parameters())
        text = json.dumps(summary, indent=2)
        sys.stdout.write(text + "\n")
        if out:
            Path(out).write_text(text + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    """Run the comparison on 2 ranks."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    try:
        import accelerate  # noqa: F401
    except ImportError:
        sys.stdout.write("accelerate is not installed: pip install accelerate (an optional peer)\n")
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="peers-") as folder:
        mp.spawn(_rank, args=(2, port, folder, args.rounds, args.out, args.width), nprocs=2)


if __name__ == "__main__":
    main()
