"""One torchft replica group of one rank, run as its own process (its own job, as on a cluster).

``python ft_worker.py LIGHTHOUSE REPLICA_ID GROUPS LOG FINISH [DIE_AT]``: builds a seeded
Gated regressor with ``prepare_model`` (DDP, ``fault_tolerance`` set), trains with AdamW on the batch
of (replica id, step), its loss the mean over the samples that count in every live group
(``global_count``, ``count_mean``), and appends one JSON line per step to LOG: the step it ran, whether it
committed, the live groups and the weights' digest. With DIE_AT it SIGKILLs itself once step
DIE_AT is logged. It stops at the step written in the file FINISH (when that file appears) and
logs its final digest and weights.
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

from toy_models import Regressor

BATCH = 4
WIDTH = 8
STEP_PAUSE_S = 0.15


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The samples replica group ``replica`` trains on at ``step`` (the record's unit), and the
    mask of those that count: 1 to BATCH of them, a different number per group and step, so
    a mean of the groups' means is not the mean over the samples that counted."""
    generator = torch.Generator().manual_seed(1_000_003 * replica + step)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    mask = (torch.arange(BATCH) <= (replica + step) % BATCH).float()
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


def uses_aux(replica: int, step: int) -> bool:
    return (replica + step) % 3 == 0


def loss_sum(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, use_aux: bool
) -> torch.Tensor:
    """The summed squared error of the samples that count."""
    return ((model(x, use_aux=use_aux) - y).squeeze(1).pow(2) * mask).sum()


def digest(model: torch.nn.Module) -> str:
    hasher = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        hasher.update(name.encode())
        hasher.update(tensor.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()


def main() -> None:
    lighthouse, replica, groups, log, finish = sys.argv[1:6]
    die_at = int(sys.argv[6]) if len(sys.argv) > 6 else None
    replica_id = int(replica)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    from distributed_strategy import count_mean, global_count, prepare_model
    from distributed_strategy.fault_tolerance import fault_tolerance_of

    config = {
        "strategy": "ddp",
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
    optimizer = ft.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    finish_at: int | None = None
    with open(log, "a", encoding="utf-8") as out:

        def record(**fields: object) -> None:
            out.write(
                json.dumps({"replica": replica_id, "pid": os.getpid(), "t": time.time(), **fields})
                + "\n"
            )
            out.flush()

        while True:
            optimizer.zero_grad()  # the quorum: a group behind the others heals here
            step = ft.step
            if finish_at is None and Path(finish).is_file():
                finish_at = int(Path(finish).read_text())
            if finish_at is not None and step >= finish_at:
                break
            x, y, mask = batch(replica_id, step)
            count = global_count(mask, model=model)  # the live groups' samples only
            summed = loss_sum(model, x, y, mask, uses_aux(replica_id, step))
            count_mean(summed, count, model=model).backward()
            optimizer.step()
            record(
                step=step,
                committed=ft.step == step + 1,
                participants=ft.manager.num_participants(),
                digest=digest(model),
            )
            if step == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(STEP_PAUSE_S)
        weights = {k: v.tolist() for k, v in model.module.state_dict().items()}
        record(final=digest(model), step=ft.step, weights=weights)
    ft.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
