"""HSDP's train step under torchft beside plain HSDP: 2 groups x 2 ranks on gloo, in one run.

- plain: one torchrun job of 4 ranks, HSDP (replicate 2 x shard 2) from ``prepare_model``;
- torchft: the real lighthouse (``torchft_lighthouse``, started and stopped here) and 2
  torchrun jobs of 2 ranks, each sharding the model over its own ranks, with
  ``fault_tolerance`` set: the quorum in ``zero_grad``, the cross-group reduce through
  torchft's ``Manager`` in FSDP2's all-reduce hook, the commit in ``step``.

The same small transformer, tokens per rank and AdamW in both. Each job times ``--steps``
train steps after ``--warmup`` (each step from ``zero_grad`` to the end of ``step`` on rank 0;
the job's median). The rounds alternate which mode goes first. The JSON printed holds each
mode's median over the rounds with its range, and the ratio torchft / plain per round with
their median. No step fails here: this is the cost of being ready for a failure.

Usage: ``python benchmarks/ft_step.py [--rounds 3] [--steps 20] [--out FILE]`` (needs torchft).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PARAMS = {"vocab": 1024, "width": 128, "depth": 2, "heads": 4}
BATCH, SEQ = 4, 64
GROUPS, RANKS = 2, 2
_TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone")
_LIGHTHOUSE = ("--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "5000")


def _worker(mode: str, lighthouse: str, replica: int, steps: int, warmup: int, out: str) -> None:
    """One rank of a job: build, train, and (rank 0 of replica 0) write the step times."""
    import torch
    import torch.distributed as dist

    from distributed_strategy import prepare_model
    from distributed_strategy.fault_tolerance import fault_tolerance_of
    from strategy_bench.workload._presets import BenchTransformer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config: dict[str, Any] = {"strategy": "hsdp", "shard": RANKS}
    if mode == "torchft":
        config["fault_tolerance"] = {
            "lighthouse": lighthouse,
            "replica_id": replica,
            "replica_groups": GROUPS,
            "min_replica_size": GROUPS,
            "timeout_s": 60,
        }
    model = prepare_model(
        BenchTransformer, PARAMS, config=config, device="cpu", default_dtype=torch.float32, seed=0
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ft = fault_tolerance_of(model) if mode == "torchft" else None
    if ft is not None:
        optimizer = ft.wrap_optimizer(optimizer)
    generator = torch.Generator().manual_seed(1000 * replica + dist.get_rank())
    tokens = torch.randint(0, PARAMS["vocab"], (BATCH, SEQ + 1), generator=generator)
    times: list[float] = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0 and replica == 0:
        Path(out).write_text(json.dumps({"times": times[warmup:]}))
    if ft is not None:
        ft.shutdown()
    dist.barrier()
    dist.destroy_process_group()


def _torchrun(nproc: int, *args: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [*_TORCHRUN, "--nproc-per-node", str(nproc), str(Path(__file__).resolve()), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _lighthouse(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The real lighthouse, waiting for both groups before the first quorum."""
    executable = shutil.which("torchft_lighthouse") or str(
        Path(sys.executable).parent / "torchft_lighthouse"
    )
    with open(folder / "lighthouse.err", "wb") as err:
        process = subprocess.Popen(
            [executable, "--bind", "[::]:0", "--min_replicas", str(GROUPS), *_LIGHTHOUSE],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = (folder / "lighthouse.err").read_text(errors="replace")
        found = re.search(r"listening on: http://\S+:(\d+)", text)
        if found:
            return process, f"localhost:{found.group(1)}"
        if process.poll() is not None:
            break
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGKILL)
    raise RuntimeError(f"the lighthouse did not start: {text[-2000:]}")


def _job(mode: str, folder: Path, lighthouse: str, steps: int, warmup: int) -> float:
    """One job of ``mode``; the median of its rank 0's step times."""
    out = folder / f"{mode}.json"
    out.unlink(missing_ok=True)
    common = ["--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
    if mode == "plain":
        jobs = [_torchrun(GROUPS * RANKS, "--worker", "plain", *common, log=folder / "plain.log")]
    else:
        jobs = [
            _torchrun(
                RANKS,
                *("--worker", "torchft", "--lighthouse", lighthouse, "--replica", str(replica)),
                *common,
                log=folder / f"torchft-{replica}.log",
            )
            for replica in range(GROUPS)
        ]
    for job in jobs:
        if job.wait(timeout=600) != 0:
            raise RuntimeError(f"the {mode} job failed; see {folder}")
    times: list[float] = json.loads(out.read_text())["times"]
    return statistics.median(times)


def main() -> None:
    """Run the comparison, or one rank of a job (``--worker``, under torchrun)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="")
    parser.add_argument("--worker", choices=("plain", "torchft"), default=None)
    parser.add_argument("--lighthouse", default="")
    parser.add_argument("--replica", type=int, default=0)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.lighthouse, args.replica, args.steps, args.warmup, args.out)
        return
    try:
        import torchft  # noqa: F401
    except ImportError:
        sys.stdout.write("torchft is not installed: pip install torchft==0.2.0\n")
        return
    folder = Path(tempfile.mkdtemp(prefix="ft-step-"))
    lighthouse, address = _lighthouse(folder)
    medians: dict[str, list[float]] = {"plain": [], "torchft": []}
    try:
        for round_ in range(args.rounds):
            order = ["plain", "torchft"] if round_ % 2 == 0 else ["torchft", "plain"]
            for mode in order:
                medians[mode].append(_job(mode, folder, address, args.steps, args.warmup))
    finally:
        os.kill(lighthouse.pid, signal.SIGTERM)
        lighthouse.wait(timeout=30)
    ratios = [ft / plain for ft, plain in zip(medians["torchft"], medians["plain"], strict=True)]
    summary = {
        "layout": f"{GROUPS} groups x {RANKS} ranks, HSDP, gloo",
        "model": PARAMS,
        "batch_per_rank": BATCH,
        "seq": SEQ,
        "rounds": args.rounds,
        "steps": args.steps,
        **{
            f"{mode}_step_s": {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
            for mode, values in medians.items()
        },
        "torchft_over_plain": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "per_round": ratios,
        },
    }
    text = json.dumps(summary, indent=2)
    sys.stdout.write(text + "\n")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
