"""Rank bodies for the checkpoint-io tests (spawned children import them by name)."""

from __future__ import annotations

import json
import os
import signal
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from checkpoint_io import (
    CheckpointError,
    CheckpointManager,
    async_save_checkpoint,
    full_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from dist_harness import rank_device


class Net(nn.Module):
    """Blocks with dropout, and a conditioning parameter that gets no gradient (sparse state)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8, 1)
        self.empty_cond = nn.Parameter(torch.zeros(8))  # unused: never has AdamW state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.drop(torch.tanh(block(x)))
        return self.head(x)


def build(strategy: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = Net().to(rank_device())
    if strategy == "ddp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return DistributedDataParallel(
                model, broadcast_buffers=False, find_unused_parameters=True
            )
    if strategy == "fsdp":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model


def optimizer_for(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)


def train(model: nn.Module, optimizer: Any, scheduler: Any, rank: int, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(100 * step + rank)  # data follows the step
        x = torch.randn(4, 8, generator=generator).to(rank_device())
        (model(x) - 1).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return full_state_dict(model, rank0_only=False)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool) -> bool:
    if a.keys() != b.keys():
        return False
    if exact:
        return all(torch.equal(a[k], b[k]) for k in a)
    return all(torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4) for k in a)


def optimizer_snapshot(optimizer: torch.optim.Optimizer) -> list[Any]:
    out = []
    for values in optimizer.state_dict()["state"].values():
        out.append(
            {
                k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
                for k, v in values.items()
            }
        )
    return out


class TwoPartError(Exception):
    """An error that cannot be rebuilt from its pickle (its ``__init__`` takes two parts)."""

    def __init__(self, what: str, where: str) -> None:
        super().__init__(f"{what} at {where}")


class Exploding:
    """A stateful object whose state_dict fails on rank 1 only."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error or OSError("disk quota exceeded (simulated on rank 1)")

    def state_dict(self) -> dict[str, Any]:
        if dist.get_rank() == 1:
            raise self.error
        return {"x": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def everything(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    root = Path(folder)
    out: dict[str, Any] = {}
    # Uninterrupted DDP reference: 4 steps.
    ref = build("ddp")
    opt, sched = optimizer_for(ref)
    torch.manual_seed(7 + rank)  # each rank's dropout stream
    train(ref, opt, sched, rank, range(2))
    saved_path = save_checkpoint(
        root / "ddp-2",
        ref,
        opt,
        step=2,
        extra={"lr": sched.get_last_lr()[0]},
        stateful={"sched": sched},
    )
    out["state_after_2_missing"] = "empty_cond" not in {
        name for name, p in ref.module.named_parameters() if p in opt.state
    }
    train(ref, opt, sched, rank, range(2, 4))
    reference = full(ref)
    out["saved_path"] = str(saved_path)

    # Same strategy, same world size: bit for bit, dropout included (RNG restored).
    again = build("ddp", seed=99)
    opt2, sched2 = optimizer_for(again)
    info = load_checkpoint(root / "ddp-2", again, opt2, stateful={"sched": sched2})
    out["info"] = (info.step, info.extra, info.world_size, info.strategy)
    train(again, opt2, sched2, rank, range(2, 4))
    out["ddp_resume_exact"] = same(full(again), reference, exact=True)

    # DDP -> FSDP2: the same weights to fp tolerance; the optimizer moments moved along.
    sharded = build("fsdp", seed=98)
    opt3, sched3 = optimizer_for(sharded)
    load_checkpoint(root / "ddp-2", sharded, opt3, stateful={"sched": sched3})
    out["sched_restored"] = sched3.state_dict()["last_epoch"] == 2
    train(sharded, opt3, sched3, rank, range(2, 4))
    after = full(sharded)
    out["fsdp_resume_close"] = same(after, reference, exact=False)

    # FSDP2 -> DDP: the loaded weights are the saved ones exactly.
    save_checkpoint(root / "fsdp-4", sharded, opt3, step=4, stateful={"sched": sched3})
    back = build("ddp", seed=97)
    opt4, sched4 = optimizer_for(back)
    info4 = load_checkpoint(root / "fsdp-4", back, opt4, stateful={"sched": sched4})
    out["fsdp_to_ddp_exact"] = same(full(back), after, exact=True)
    out["fsdp_to_ddp_optimizer"] = [
        {k: torch.equal(a[k], b[k]) for k in a}
        for a, b in zip(optimizer_snapshot(opt3), optimizer_snapshot(opt4), strict=True)
    ]
    out["info4"] = (info4.strategy, info4.world_size)
    # verify=False reads in place, into the FSDP2 shards and the optimizer's own moments.
    in_place = build("fsdp", seed=96)
    opt6, _ = optimizer_for(in_place)
    train(in_place, opt6, torch.optim.lr_scheduler.StepLR(opt6, 1), rank, range(1))
    load_checkpoint(root / "fsdp-4", in_place, opt6, verify=False)
    out["in_place_exact"] = same(full(in_place), after, exact=True) and all(
        all(torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(optimizer_snapshot(opt3), optimizer_snapshot(opt6), strict=True)
    )

    # A save that fails on rank 1: every rank raises, the old checkpoint stays, no leftovers.
    before = sorted(p.name for p in root.iterdir())
    dist.barrier()  # every rank listed the folder before rank 0 begins the save (its partial)
    try:
        save_checkpoint(root / "ddp-2", ref, opt, stateful={"boom": Exploding()}, overwrite=True)
        out["failed_save"] = "no error"
    except Exception as error:
        out["failed_save"] = f"{type(error).__name__}: {error}"
    dist.barrier()
    cases: tuple[tuple[str, nn.Module, dict[str, Any]], ...] = (
        # an error that does not unpickle; rank 0's refusal; FSDP (rank 1's shards unplanned)
        ("two_part", ref, {"stateful": {"boom": Exploding(TwoPartError("lost", "rank 1"))}}),
        ("exists", ref, {"overwrite": False}),
        ("fsdp", sharded, {"stateful": {"boom": Exploding()}}),
    )
    for case, model, kwargs in cases if world_size == 2 else ():  # Exploding fails on rank 1
        try:
            save_checkpoint(
                root / "ddp-2", model, overwrite=kwargs.pop("overwrite", True), **kwargs
            )
            out[f"failed_save_{case}"] = "no error"
        except Exception as error:
            out[f"failed_save_{case}"] = f"{type(error).__name__}: {error}"
        dist.barrier()
    now = {p.name for p in root.iterdir()}
    out["after_failed_save"] = sorted(f"-{n}" for n in set(before) - now) + sorted(
        f"+{n}" for n in now - set(before)
    )
    probe = build("ddp", seed=1)
    load_checkpoint(root / "ddp-2", probe)  # still loads, verified
    out["old_still_loads"] = True

    # A load that fails: nothing changes (model, optimizer, RNG), on every rank.
    wrong = build("ddp", seed=5)
    opt5, _ = optimizer_for(wrong)
    train(wrong, opt5, torch.optim.lr_scheduler.StepLR(opt5, 1), rank, range(1))
    weights, moments, rng = full(wrong), optimizer_snapshot(opt5), torch.get_rng_state()
    if rank == 0:
        data = sorted((root / "fsdp-4").glob("rank*.safetensors"))[-1]
        data.write_bytes(data.read_bytes()[:40])  # truncated
    dist.barrier()
    try:
        load_checkpoint(root / "fsdp-4", wrong, opt5)
        out["corrupt"] = "no error"
    except CheckpointError as error:
        out["corrupt"] = str(error)
    out["unchanged"] = (
        same(full(wrong), weights, exact=True)
        and all(
            all(torch.equal(a[k], b[k]) for k in a)
            for a, b in zip(optimizer_snapshot(opt5), moments, strict=True)
        )
        and torch.equal(torch.get_rng_state(), rng)
    )
    if world_size == 2:  # the long-run checks name rank 1
        out.update(long_runs(rank, world_size, folder))
        out.update(per_rank_state(rank, folder))
        out.update(replicated_async(rank, folder))
    return out


def replicated_async(rank: int, folder: str) -> dict[str, Any]:
    """A DDP background save: each rank stages its share of the replicated state, and it
    reads back exactly; ranks whose plain tensors differ are refused on every rank."""
    from checkpoint_io._background import staging

    root = Path(folder) / "replicated"
    model = build("ddp", seed=11)
    opt, sched = optimizer_for(model)
    train(model, opt, sched, rank, range(1))
    saved, moments = full(model), optimizer_snapshot(opt)
    path = async_save_checkpoint(root / "a", model, opt, step=1).wait()
    tensors = [*saved.values(), *(v for group in moments for v in group.values())]
    out: dict[str, Any] = {
        "replicated_staged": sum(
            b.numel() * b.element_size() for b, _ in staging._BUFFERS.values()
        ),
        "replicated_whole": sum(t.numel() * t.element_size() for t in tensors),
    }
    fresh = build("ddp", seed=12)
    opt2, _ = optimizer_for(fresh)
    load_checkpoint(path, fresh, opt2)
    out["replicated_exact"] = same(full(fresh), saved, exact=True) and all(
        all(torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(optimizer_snapshot(opt2), moments, strict=True)
    )
    if rank == 1:  # a buffer rank 0 does not have
        model.module.register_buffer("extra", torch.zeros(3, device=rank_device()))
    try:
        async_save_checkpoint(root / "b", model, opt, step=2).wait()
        out["replicated_differ"] = "no error"
    except CheckpointError as error:
        out["replicated_differ"] = str(error)
    dist.barrier()
    out["replicated_left"] = sorted(p.name for p in root.iterdir())
    return out


class Counter:
    """A per-rank state (a streaming dataset's offset): its value differs by rank."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def per_rank_state(rank: int, folder: str) -> dict[str, Any]:
    """Each rank's own stateful state back to it, through the three save paths; an equal
    state and a differing one saved for a load in one process."""
    root = Path(folder) / "per-rank"
    model = build("ddp", seed=1)
    out: dict[str, Any] = {}
    mine = (rank + 1) * 100  # [100, 200]
    generator = torch.Generator().manual_seed(rank)  # a sampler's generator: a byte tensor
    for how in ("sync", "async", "manager"):
        objects = {
            "offset": Counter(mine),
            "gen": Counter(generator.get_state()),
            "same": Counter(7),
        }
        if how == "sync":
            path = save_checkpoint(root / how, model, step=1, stateful=objects)
        elif how == "async":
            path = async_save_checkpoint(root / how, model, step=1, stateful=objects).wait()
        else:
            manager = CheckpointManager(root / how, every=1)
            manager.maybe_save(1, model, stateful=objects)
            manager.wait()
            path = manager.latest()  # type: ignore[assignment]
        fresh = {"offset": Counter(), "gen": Counter(), "same": Counter()}
        if how == "manager":
            CheckpointManager(root / how, every=1).resume(model, stateful=fresh)
        else:
            load_checkpoint(path, model, stateful=fresh)
        out[f"per_rank_{how}"] = (
            fresh["offset"].value,
            torch.equal(fresh["gen"].value, generator.get_state()),
            fresh["same"].value,
        )
    out["per_rank_path"] = str(root / "sync")
    return out


def long_runs(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Per-rank digests, async save, an async failure, SIGTERM (2 ranks, FSDP2)."""
    root = Path(folder) / "long"
    out: dict[str, Any] = {}
    model = build("fsdp", seed=3)
    opt, sched = optimizer_for(model)
    train(model, opt, sched, rank, range(2))

    # Each rank hashed what it wrote; a damaged shard of rank 1 is caught, on every rank.
    path = save_checkpoint(root / "sync", model, opt, step=2)
    files = json.loads((path / "checkpoint.json").read_text())["files"]
    out["files"] = sorted(files)
    if rank == 0:
        data = path / "rank1.safetensors"
        damaged = bytearray(data.read_bytes())
        index = json.loads((path / "index.json").read_text())["tensors"]
        weights = [  # a model record of rank 1's file: one bit in the middle of it
            (chunk["at"], chunk["bytes"])
            for fqn, entry in index.items()
            for chunk in entry["chunks"]
            if chunk["file"] == data.name and fqn.startswith("model.")
        ]
        offset, length = max(weights, key=lambda span: span[1])
        damaged[offset + length // 2] ^= 0xFF  # same size: only the digest can tell
        (root / "damaged").mkdir()
        for item in path.rglob("*"):
            if item.is_file():
                target = root / "damaged" / item.relative_to(path)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(bytes(damaged) if item == data else item.read_bytes())
    dist.barrier()
    fresh = build("fsdp", seed=4)
    before = full(fresh)
    try:
        load_checkpoint(root / "damaged", fresh)
        out["damaged"] = "no error"
    except CheckpointError as error:
        out["damaged"] = str(error)
    after = full(fresh)  # read into staging: the damaged file changed nothing
    out["damaged_unchanged"] = before.keys() == after.keys() and all(
        torch.equal(before[k], after[k]) for k in before
    )

    # Async: the state is staged when the call returns; the next steps do not leak into it.
    staged = full(model)
    pending = async_save_checkpoint(root / "async", model, opt, step=2)
    train(model, opt, sched, rank, range(2, 3))
    out["async_path"] = pending.wait().name
    probe = build("fsdp", seed=5)
    load_checkpoint(root / "async", probe)
    out["async_is_staged_state"] = same(full(probe), staged, exact=True)
    out["async_moved_on"] = not same(full(model), staged, exact=True)

    # An async save whose background write fails on rank 1 only: every rank raises at wait();
    # nothing published. (A value that cannot be written is refused before staging now.)
    from checkpoint_io._storage.writer import SafeWriter

    write_data = SafeWriter.write_data

    def disk_full(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError("disk full (simulated on rank 1)")

    if rank == 1:
        SafeWriter.write_data = disk_full  # type: ignore[method-assign]
    try:
        pending = async_save_checkpoint(root / "async", model, opt, step=3, overwrite=True)
        try:
            pending.wait()
            out["async_failure"] = "no error"
        except CheckpointError as error:
            out["async_failure"] = str(error)
    finally:
        SafeWriter.write_data = write_data  # type: ignore[method-assign]
    dist.barrier()
    out["async_old_kept"] = load_checkpoint(root / "async", build("fsdp", seed=6)).step == 2
    out["async_leftovers"] = sorted(p.name for p in root.iterdir() if p.name.startswith("."))

    # SIGTERM on rank 1 alone: both ranks save at the same step and exit with code 0.
    manager = CheckpointManager(root / "run", every=5, keep_last=1, on_sigterm=True)
    steps_done = 0
    try:
        for step in range(3, 10):
            train(model, opt, sched, rank, range(step, step + 1))
            steps_done = step + 1
            if rank == 1 and step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            manager.maybe_save(steps_done, model, opt)
        out["sigterm"] = "no exit"
    except SystemExit as stop:
        out["sigterm"] = (stop.code, steps_done, manager.latest().name)  # type: ignore[union-attr]
    out["handler_restored"] = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    return out


def saves_for_the_audit(rank: int, world_size: int, folder: str) -> None:
    """A step-1 checkpoint (optimizer, a stateful scheduler, the RNG) of each strategy:
    DDP and FSDP over every rank, HSDP over 2 x (world / 2)."""
    from torch.distributed.device_mesh import init_device_mesh

    from checkpoint_io import CheckpointManager

    for strategy in ("ddp", "fsdp", "hsdp"):
        if strategy == "hsdp":
            torch.manual_seed(0)
            model = Net().to(rank_device())
            shape = (2, world_size // 2)
            mesh = init_device_mesh(rank_device().type, shape, mesh_dim_names=("rep", "shard"))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            model = build(strategy)
        optimizer, scheduler = optimizer_for(model)
        train(model, optimizer, scheduler, rank, range(1))
        manager = CheckpointManager(Path(folder) / strategy, every=1)
        manager.maybe_save(1, model, optimizer, stateful={"sched": scheduler})
        manager.close()
