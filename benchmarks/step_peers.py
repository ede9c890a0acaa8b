"""The train step beside its peers: raw torch, this library, Lightning Fabric and Accelerate.

The same nanoGPT-sized model (6 blocks, 512 wide, vocab 4096: 23.1 M parameters; batch 4,
sequence 256, AdamW, clip 1.0) on 2 gloo ranks, under DDP and FSDP2, built from seed 0 by:

- raw: ``DistributedDataParallel`` / ``fully_shard`` per block then the root, torch's
  ``clip_grad_norm_``, checkpoints through ``get_state_dict`` and ``dcp.save`` / ``dcp.load``;
- ours: ``prepare_model``, ``grad_sync.clip_grad_norm``, ``save_checkpoint`` /
  ``load_checkpoint``;
- fabric: ``Fabric(strategy="ddp")`` / ``ModelParallelStrategy`` with the same
  ``fully_shard`` calls, ``fabric.clip_gradients``, ``fabric.save`` / ``fabric.load``;
- accelerate: ``Accelerator(cpu=True)`` (DDP only: its FSDP plugin is used on accelerator
  devices only),
  ``clip_grad_norm_``, ``save_state`` / ``load_state``.

Each is one job (its own 2 spawned ranks) per round, in an order rotated every round. A job
times its setup (build, wrap, optimizer), ``--steps`` train steps after one warm-up (each from
a barrier to the slowest rank's end; the median), a checkpoint save and its load, and writes
its final weights. Each figure is reported as its ratio to raw's in the same round: the
median over the rounds and their range; the weights are compared with raw's, bit for bit.
Fabric and Accelerate are optional peers: one without its package is one line, not a failure.

Usage: ``python benchmarks/step_peers.py [--rounds 6] [--steps 5] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import importlib.util
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
import torch.multiprocessing as mp

PARAMS = {"vocab": 4096, "width": 512, "depth": 6, "heads": 8}
BATCH, SEQ, CLIP = 4, 256, 1.0
PEERS = {"fabric": "lightning_fabric", "accelerate": "accelerate"}
FRAMEWORKS = ("raw", "ours", "fabric", "accelerate")
STRATEGIES = ("ddp", "fsdp")


def _model() -> torch.nn.Module:
    from strategy_bench.workload._presets import BenchTransformer

    torch.manual_seed(0)
    return BenchTransformer(**PARAMS)


def _shard(model: torch.nn.Module, mesh: Any = None) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class _Side:
    """One framework's build, step and checkpoint on one rank."""

    def __init__(self, framework: str, strategy: str) -> None:
        self.framework, self.strategy = framework, strategy
        self.owner: Any = None
        build: Callable[[], None] = getattr(self, f"_build_{framework}")
        build()

    # -- builds ---------------------------------------------------------------------------
    def _build_raw(self) -> None:
        dist.init_process_group("gloo")
        model = _model()
        if self.strategy == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            model = _shard(model)
        self.model, self.optimizer = model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def _build_ours(self) -> None:
        from distributed_strategy import prepare_model
        from strategy_bench.workload._presets import BenchTransformer

        dist.init_process_group("gloo")
        self.model = prepare_model(
            BenchTransformer,
            PARAMS,
            config={"strategy": self.strategy},
            device="cpu",
            default_dtype=torch.float32,
            seed=0,
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def _build_fabric(self) -> None:
        from lightning_fabric import Fabric
        from lightning_fabric.strategies import ModelParallelStrategy

        strategy: Any = "ddp"
        if self.strategy == "fsdp":
            strategy = ModelParallelStrategy(
                parallelize_fn=lambda model, mesh: _shard(model, mesh["data_parallel"]),
                data_parallel_size=2,
                tensor_parallel_size=1,
            )
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        model = fabric.setup_module(_model())
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
        self.owner, self.model, self.optimizer = fabric, model, optimizer

    def _build_accelerate(self) -> None:
        from accelerate import Accelerator

        if self.strategy == "fsdp":
            raise RuntimeError(
                "Accelerate turns its FSDP plugin on for accelerator devices only (not MULTI_CPU)"
            )
        accelerator = Accelerator(cpu=True)
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.owner = accelerator

    # -- the step -------------------------------------------------------------------------
    def step(self, tokens: torch.Tensor) -> None:
        logits = self.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), tokens[:, 1:].flatten()
        )
        if self.framework == "ours":
            from grad_sync import clip_grad_norm

            loss.backward()
            clip_grad_norm(self.model, CLIP)
        elif self.framework == "fabric":
            self.owner.backward(loss)
            self.owner.clip_gradients(self.model, self.optimizer, max_norm=CLIP)
        elif self.framework == "accelerate":
            self.owner.backward(loss)
            self.owner.clip_grad_norm_(self.model.parameters(), CLIP)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad()

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, path: str) -> None:
        if self.framework == "ours":
            from distributed_strategy import save_checkpoint

            save_checkpoint(path, self.model, self.optimizer, step=1)
        elif self.framework == "fabric":
            self.owner.save(path, {"model": self.model, "optimizer": self.optimizer})
        elif self.framework == "accelerate":
            self.owner.save_state(path)
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model, optim = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": model, "optim": optim}, checkpoint_id=path)

    def load(self, path: str) -> None:
        if self.framework == "ours":
            from distributed_strategy import load_checkpoint

            load_checkpoint(path, self.model, self.optimizer)
        elif self.framework == "fabric":
            self.owner.load(path, {"model": self.model, "optimizer": self.optimizer})
        elif self.framework == "accelerate":
            self.owner.load_state(path)
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model, optim = get_state_dict(self.model, self.optimizer)
            state = {"model": model, "optim": optim}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(
                self.model, self.optimizer, model_state_dict=model, optim_state_dict=optim
            )

    def weights(self) -> dict[str, torch.Tensor]:
        """The whole model's weights (every rank takes part; rank 0 gets them)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        module = self.model
        while hasattr(module, "module") and not hasattr(module, "blocks"):
            module = module.module  # DDP's, Fabric's and Accelerate's wrappers
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {k: v.clone() for k, v in get_model_state_dict(module, options=options).items()}


def _barrier_time(action: Callable[[], None]) -> float:
    dist.barrier()
    begin = time.perf_counter()
    action()
    dist.barrier()  # the slowest rank's end
    return time.perf_counter() - begin


def _job(rank: int, framework: str, strategy: str, port: int, steps: int, folder: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="step-peers",
    )  # fmt: skip
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    begin = time.perf_counter()
    side = _Side(framework, strategy)
    setup = torch.tensor([time.perf_counter() - begin])
    dist.all_reduce(setup, op=dist.ReduceOp.MAX)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, PARAMS["vocab"], (BATCH, SEQ + 1), generator=generator)]
    batches += [torch.randint(0, PARAMS["vocab"], (BATCH, SEQ + 1), generator=generator)]
    batches = [batches[i % 2] for i in range(steps + 1)]
    times = [_barrier_time(lambda tokens=tokens: side.step(tokens)) for tokens in batches]
    weights = side.weights()
    path = os.path.join(folder, f"ckpt-{framework}-{strategy}")
    figures: dict[str, Any] = {"setup_s": setup.item(), "step_s": statistics.median(times[1:])}
    for name, action in (("save_s", side.save), ("load_s", side.load)):
        try:
            figures[name] = _barrier_time(lambda action=action: action(path))
        except Exception as error:  # a peer's checkpoint that does not run here
            figures[name] = None
            figures[f"{name}_error"] = f"{type(error).__name__}: {error}"[:200]
    if rank == 0:
        from safetensors.torch import save_file

        save_file(weights, os.path.join(folder, f"weights-{framework}-{strategy}.safetensors"))
        Path(folder, f"figures-{framework}-{strategy}.json").write_text(json.dumps(figures))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run(framework: str, strategy: str, steps: int, folder: str) -> dict[str, Any]:
    try:
        mp.spawn(_job, args=(framework, strategy, _free_port(), steps, folder), nprocs=2)
    except Exception as error:
        return {"error": str(error).strip().splitlines()[-1][:200]}
    return json.loads(Path(folder, f"figures-{framework}-{strategy}.json").read_text())


def _compare(folder: str, framework: str, strategy: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    mine = load_file(os.path.join(folder, f"weights-{framework}-{strategy}.safetensors"))
    raw = load_file(os.path.join(folder, f"weights-raw-{strategy}.safetensors"))
    if set(mine) != set(raw):
        return {"identical": False, "max_abs_diff": None}
    diff = max((mine[k] - raw[k]).abs().max().item() for k in raw)
    return {"identical": all(torch.equal(mine[k], raw[k]) for k in raw), "max_abs_diff": diff}


def main() -> None:
    """Run the rounds and print (and write) the ratios to raw."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds and --steps must be >= 1, got {args.rounds} and {args.steps}")
    frameworks = ["raw", "ours"]
    for peer, module in PEERS.items():
        if importlib.util.find_spec(module) is None:
            sys.stderr.write(
                f"step_peers: {peer} is not installed ({module}); measured without it\n"
            )
        else:
            frameworks.append(peer)
    figures: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for index in range(args.rounds):
        order = frameworks[index % len(frameworks) :] + frameworks[: index % len(frameworks)]
        for strategy in args.strategies:
            folder = tempfile.mkdtemp(prefix="step-peers-")
            try:
                got = {name: _run(name, strategy, args.steps, folder) for name in order}
                for name, row in got.items():
                    if "error" not in row and "error" not in got["raw"]:
                        row.update(_compare(folder, name, strategy))
                    figures.setdefault(strategy, {}).setdefault(name, []).append(row)
                    sys.stderr.write(f"round {index + 1} {strategy} {name}: {json.dumps(row)}\n")
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    summary = _summary(figures)
    text = json.dumps({"rounds": args.rounds, "steps": args.steps, "summary": summary}, indent=1)
    sys.stdout.write(text + "\n")
    if args.out is not None:
        args.out.write_text(text + "\n")


def _summary(figures: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per strategy and framework: each figure's ratio to raw's in the same round."""
    out: dict[str, Any] = {}
    for strategy, by_framework in figures.items():
        raw = by_framework["raw"]
        for name, rows in by_framework.items():
            entry: dict[str, Any] = {}
            errors = [row["error"] for row in rows if "error" in row]
            if errors:
                entry["error"] = errors[0]
            for key in ("step_s", "setup_s", "save_s", "load_s"):
                ratios = [
                    row[key] / base[key]
                    for row, base in zip(rows, raw, strict=True)
                    if row.get(key) and base.get(key)
                ]
                seconds = [row[key] for row in rows if row.get(key)]
                if ratios:
                    entry[key.replace("_s", "_ratio")] = {
                        "median": statistics.median(ratios),
                        "min": min(ratios),
                        "max": max(ratios),
                    }
                    entry[key.replace("_s", "_ms")] = 1e3 * statistics.median(seconds)
                problems = {row.get(f"{key}_error") for row in rows} - {None}
                if problems:
                    entry[f"{key}_error"] = sorted(problems)[0]
            if any("identical" in row for row in rows):
                entry["identical_to_raw"] = all(row.get("identical") for row in rows)
                entry["max_abs_diff"] = max(row.get("max_abs_diff") or 0.0 for row in rows)
            out[f"{strategy} {name}"] = entry
    return out


if __name__ == "__main__":
    main()
