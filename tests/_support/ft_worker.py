"""One torchft replica group, run as its own job (one process, or torchrun's ranks).

``python ft_worker.py LIGHTHOUSE REPLICA_ID GROUPS LOG FINISH CKPT [die|die-in-step]`` (one rank,
DDP), or
the same under torchrun with ``FT_STRATEGY=hsdp`` (HSDP inside the group). It builds a seeded
Gated regressor with ``prepare_model`` (``fault_tolerance`` set) and trains with AdamW (two
micro-batches, the first under ``no_sync``, then ``clip_grad_norm``) on its samples of each step (``FaultTolerance.samples`` under one ``SampleOrder``), its loss the mean
over the samples that count in every live group (``global_count``, ``count_mean``); the
library records each committed step's samples in CKPT/../record (``record_samples``). Each
rank appends one JSON line per step to LOG (rank r > 0 to LOG.r): the step it ran, whether it
committed, the live groups, a draw from the CPU stream after the quorum, the digest of its
weights. Every SAVE_EVERY steps each group saves a checkpoint, with the manager's state, under
CKPT/replica_<id> (resumed from there at the start); with ``die`` the group's last rank
SIGKILLs itself inside the group's second save, with ``die-in-step`` in step DIE_STEP, between
its two backwards (its peers are then in that step's cross-group reduce, which fails). It stops at the step written in the file
FINISH (when that file appears), compares the groups (``replica_drift``) and logs the report,
its final digest and whole weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sample_order import SampleOrder
from toy_models import Regressor

BATCH = 4  # samples per rank and step
WIDTH = 8
NUM_SAMPLES = 96
MAX_NORM = 2.0  # clips about half the steps
STEP_PAUSE_S = 0.15
SAVE_EVERY = 3
DIE_STEP = 7  # with die-in-step: not a step that saves


def order(groups: int, ranks: int) -> SampleOrder:
    """The run's order: a global batch of BATCH samples per rank of every group."""
    return SampleOrder(NUM_SAMPLES, global_batch=BATCH * groups * ranks, seed=11)


def data(samples: list[int]) -> tuple[torch.Tensor, ...]:
    """The samples' inputs, targets, and the mask of those that count (3 in 4 samples, so a
    shard's count varies and a mean of means is not the mean over the samples that count)."""
    x = torch.randn(NUM_SAMPLES, WIDTH, generator=torch.Generator().manual_seed(123))[samples]
    mask = torch.tensor([float(i % 4 != 0) for i in samples])
    return x, x.sum(dim=1, keepdim=True).sin(), mask


class Gated(torch.nn.Module):
    """A Regressor with an extra head that a group uses at some steps only (:func:`uses_aux`):
    at those steps the head is unused in some groups and used in others."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = Regressor(width)
        self.aux = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out + self.aux(x) if use_aux else out


def uses_aux(strategy: str, replica: int, step: int) -> bool:
    """DDP: the head at some steps in some groups. HSDP: never (see docs/fault-tolerance.md)."""
    return strategy == "ddp" and (replica + step) % 3 == 0


def loss_sum(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, use_aux: bool
) -> torch.Tensor:
    """The summed squared error of the samples that count."""
    return ((model(x, use_aux=use_aux) - y).squeeze(1).pow(2) * mask).sum()


def digest(model: torch.nn.Module) -> str:
    """This rank's weights (its shards under HSDP), hashed."""
    hasher = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        hasher.update(name.encode())
        hasher.update(local.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()


class _DieInSecondSave:
    """A ``stateful=`` object that, with ``die``, SIGKILLs this process in its second save (a
    group that dies while a checkpoint is being written, one complete checkpoint before it)."""

    def __init__(self, die: bool) -> None:
        self.die, self.saves = die, 0

    def state_dict(self) -> dict[str, int]:
        self.saves += 1
        if self.die and self.saves == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"saves": self.saves}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.saves = 0


def main() -> None:
    lighthouse, replica, groups, log, finish, ckpt_root = sys.argv[1:7]
    die = sys.argv[7:] == ["die"]
    die_in_step = sys.argv[7:] == ["die-in-step"]
    replica_id = int(replica)
    strategy = os.environ.get("FT_STRATEGY", "ddp")
    if "RANK" not in os.environ:  # one rank, no torchrun
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from distributed_strategy import (
        CheckpointManager,
        clip_grad_norm,
        count_mean,
        global_count,
        no_sync,
        prepare_model,
        replica_drift,
        unwrap_model,
    )
    from distributed_strategy.fault_tolerance import fault_tolerance_of

    config = {
        "strategy": strategy,
        "fault_tolerance": {
            "lighthouse": lighthouse,
            "replica_id": replica_id,
            "replica_groups": int(groups),
            "timeout_s": 5,
            "quorum_timeout_s": 30,
            "connect_timeout_s": 5,
        },
    }
    model = prepare_model(
        Gated,
        {"width": WIDTH},
        config=config,
        device="cpu",
        default_dtype=torch.float32,
        seed=0,
    )
    ft = fault_tolerance_of(model)
    ft.record_samples(order(int(groups), world), Path(ckpt_root).parent / "record")
    optimizer = ft.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    # Each group checkpoints into its own directory, through the manager's commit and with its
    # state; the dying rank dies inside its group's second save.
    checkpoints = CheckpointManager(Path(ckpt_root) / f"replica_{replica_id}", every=SAVE_EVERY)
    stateful = {"fault": _DieInSecondSave(die and rank == world - 1)}
    resumed = ft.resume(checkpoints, stateful=stateful)
    ft.save_on_commit(checkpoints, stateful=stateful)
    finish_at: int | None = None
    with open(log if rank == 0 else f"{log}.{rank}", "a", encoding="utf-8") as out:

        def record(**fields: object) -> None:
            out.write(
                json.dumps({"replica": replica_id, "pid": os.getpid(), "t": time.time(), **fields})
                + "\n"
            )
            out.flush()

        record(resumed=resumed)
        while True:
            optimizer.zero_grad()  # the quorum: a group behind the others heals here
            step = ft.step
            probe = torch.rand(1).item()  # the CPU stream, healed with the state
            if finish_at is None and Path(finish).is_file():
                finish_at = int(Path(finish).read_text())
            if finish_at is not None and step >= finish_at:  # every group, in one quorum
                report = replica_drift(model)
                record(drift=str(report), drifted=report.drifted, groups=report.groups)
                break
            x, y, mask = data(ft.samples(order(int(groups), world)))
            count = global_count(mask, model=model)  # the live groups' samples only
            aux = uses_aux(strategy, replica_id, step)
            # Two micro-batches, the first without the reduction; then the clip.
            with no_sync(model):
                summed = loss_sum(model, x[:2], y[:2], mask[:2], aux)
                count_mean(summed, count, model=model).backward()
            if die_in_step and step == DIE_STEP and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)  # before its cross-group reduce
            count_mean(loss_sum(model, x[2:], y[2:], mask[2:], aux), count, model=model).backward()
            norm = float(clip_grad_norm(model, MAX_NORM))  # the same on every live rank
            optimizer.step()
            record(
                step=step,
                committed=ft.step == step + 1,
                participants=ft.manager.num_participants(),
                probe=probe,
                norm=norm,
                digest=digest(model),
            )
            time.sleep(STEP_PAUSE_S)
        state = unwrap_model(model).state_dict()
        weights = {  # the whole tensors (a collective under HSDP)
            k: (v.full_tensor() if isinstance(v, DTensor) else v).tolist() for k, v in state.items()
        }
        record(final=digest(model), step=ft.step, weights=weights)
    ft.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
