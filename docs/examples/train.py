"""A small trainer on distributed-strategy: DDP or FSDP from the command line.

Run it on CPU with two gloo ranks:

    torchrun --nproc-per-node 2 docs/examples/train.py --strategy ddp
    torchrun --nproc-per-node 2 docs/examples/train.py --strategy fsdp --steps 5
    torchrun --nproc-per-node 2 docs/examples/train.py --strategy fsdp --grad-accum 4 --clip 1.0

Stop anywhere and resume anywhere (checkpoint-io): save under DDP, resume under FSDP.

    torchrun --nproc-per-node 2 docs/examples/train.py --strategy ddp --steps 2 --save ckpt
    torchrun --nproc-per-node 2 docs/examples/train.py --strategy fsdp --steps 4 --resume ckpt

A global batch that stays the same on any number of ranks (sample-order): each step reads the
same samples whether 4, 2 or 1 rank(s) run it, accumulating ``global / (ranks x micro)``
micro-batches; killed on 4 ranks, it continues on 1 from the latest checkpoint:

    torchrun --nproc-per-node 4 docs/examples/train.py --global-batch 16 --micro-batch 4 \
        --steps 6 --ckpt-dir runs/any --ckpt-every 2
    torchrun --nproc-per-node 1 docs/examples/train.py --global-batch 16 --micro-batch 4 \
        --steps 6 --ckpt-dir runs/any --ckpt-every 2

Under SLURM without torchrun (``srun`` starts the ranks; init_distributed reads SLURM's
variables), saved and requeued ahead of the time limit (see docs/clusters.md):

    srun --ntasks 2 python docs/examples/train.py --global-batch 16 --micro-batch 4 \
        --steps 100 --ckpt-dir runs/slurm --ckpt-every 10 --save-on-signal USR1 --requeue

A long, preemptible run: a checkpoint every 2 steps, the last 3 kept, written in the
background, saved on SIGTERM, and resumed by itself from the latest complete checkpoint when
torchrun restarts the job (a rank killed at any moment, a save included):

    torchrun --nproc-per-node 2 --max-restarts 3 docs/examples/train.py --steps 20 \
        --ckpt-dir runs/ckpt --ckpt-every 2 --keep-last 3 --async-save --save-on-sigterm

Fault tolerance (torchft, see docs/fault-tolerance.md): each replica group is its own job,
the groups meet at the lighthouse; a group that dies is started again and heals from a live
peer while the others train on:

    torchft_lighthouse --bind "[::]:29510" --min_replicas 1 &
    torchrun --standalone --nproc-per-node 1 docs/examples/train.py --steps 50 \
        --fault-tolerance localhost:29510 --replica-id 0 --replica-groups 2 &
    torchrun --standalone --nproc-per-node 1 docs/examples/train.py --steps 50 \
        --fault-tolerance localhost:29510 --replica-id 1 --replica-groups 2

On a GPU host it uses NCCL and one GPU per rank. It builds the model with ``prepare_model``
(identical replicas, verified), freezes the encoder with a trainable policy, trains a few
steps of AdamW on per-rank data, and prints the loss and a fingerprint of the full weights from
rank 0 (the same for both strategies, and the same with or without gradient accumulation
(``--grad-accum K`` splits each rank's batch into K micro-batches; grad-sync's ``no_sync``
skips the reduction on all but the last, ``clip_grad_norm`` clips the whole model's norm),
and, with ``--ckpt-dir``, the same whether or not the job was killed and restarted.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distributed_strategy import (
    CheckpointManager,
    SampleOrder,
    clip_grad_norm,
    count_mean,
    derive_seed,
    full_state_dict,
    global_count,
    init_distributed,
    load_checkpoint,
    no_sync,
    prepare_model,
    save_checkpoint,
    state_fingerprint,
)
from distributed_strategy.fault_tolerance import fault_tolerance_of


class Block(nn.Module):
    """Pre-norm MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual MLP."""
        return x + self.mlp(self.norm(x))


class TinyNet(nn.Module):
    """A frozen encoder, a stack of blocks, a head, and a custom loss method."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Encoder, blocks, head."""
        x = self.encoder(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Called by the trainer instead of forward: registered as a forward method."""
        return nn.functional.mse_loss(self.forward(x), y)

    def loss_sum(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The summed squared error of the valid positions (variable-length samples)."""
        return ((self.forward(x) - y).pow(2).squeeze(-1) * mask).sum()


def freeze_encoder(model: nn.Module) -> None:
    """The trainable policy: applied before the wrap, so DDP's reducer sees it."""
    model.encoder.requires_grad_(False)


def main() -> None:
    """Parse arguments, prepare the model, train a few steps, report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank per optimizer step")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="samples per optimizer step over all ranks, read in sample-order's order (the "
        "same batches at any world size); accumulation is global / (ranks x --micro-batch)",
    )
    parser.add_argument("--micro-batch", type=int, default=4, help="with --global-batch")
    parser.add_argument("--samples", type=int, default=256, help="dataset size (--global-batch)")
    parser.add_argument(
        "--variable-length",
        action="store_true",
        help="with --global-batch: samples of 1-4 valid positions, the loss normalised by the "
        "step's global count of them (global_count + count_mean: the same at any world size)",
    )
    parser.add_argument(
        "--naive-mean",
        action="store_true",
        help="with --variable-length: each micro-batch's mean / accumulation instead (the "
        "usual mean(), whose gradient changes with the world size)",
    )
    parser.add_argument("--clip", type=float, default=None, help="max gradient norm")
    parser.add_argument("--save", default=None, help="checkpoint directory to write at the end")
    parser.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    parser.add_argument("--ckpt-dir", default=None, help="save step-<N> checkpoints here")
    parser.add_argument("--ckpt-every", type=int, default=1, help="steps between checkpoints")
    parser.add_argument("--keep-last", type=int, default=None, help="checkpoints to keep")
    parser.add_argument("--async-save", action="store_true", help="write in the background")
    parser.add_argument(
        "--save-on-sigterm", action="store_true", help="on SIGTERM: save, then exit 0"
    )
    parser.add_argument(
        "--save-on-signal",
        action="append",
        default=None,
        metavar="SIG",
        help="on this signal (e.g. USR1, what sbatch --signal=USR1@120 sends): save at the next "
        "step, then exit 0; repeatable",
    )
    parser.add_argument(
        "--requeue",
        action="store_true",
        help="after such a save, requeue the SLURM job (scontrol requeue) from rank 0",
    )
    parser.add_argument(
        "--fault-tolerance",
        default=None,
        metavar="HOST:PORT",
        help="train as one replica group of torchft's, its lighthouse at HOST:PORT (DDP)",
    )
    parser.add_argument("--replica-id", type=int, default=0, help="with --fault-tolerance")
    parser.add_argument("--replica-groups", type=int, default=1, help="with --fault-tolerance")
    parser.add_argument(
        "--pg-timeout-s",
        type=float,
        default=60.0,
        help="collective timeout: a rank whose peer was killed fails after it, so that "
        "torchrun restarts the job instead of waiting (torch's default is 10-30 min)",
    )
    args = parser.parse_args()
    if args.global_batch is None and (args.grad_accum < 1 or args.batch_size % args.grad_accum):
        parser.error("--grad-accum must be >= 1 and divide --batch-size")
    if args.global_batch is not None and (args.global_batch < 1 or args.micro_batch < 1):
        parser.error("--global-batch and --micro-batch must be >= 1")
    if args.variable_length and args.global_batch is None:
        parser.error("--variable-length reads sample-order's global batches: add --global-batch")
    if args.fault_tolerance and args.global_batch is not None:
        parser.error("--fault-tolerance draws each group's own batches: drop --global-batch")
    config: dict[str, Any] = {"strategy": args.strategy}
    if args.fault_tolerance:  # checked by strategy-config (fsdp is refused, naming both keys)
        config["fault_tolerance"] = {
            "lighthouse": args.fault_tolerance,
            "replica_id": args.replica_id,
            "replica_groups": args.replica_groups,
        }

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    # NCCL bound to this rank's GPU where CUDA is available (gloo elsewhere), a store prefix
    # per torchrun attempt, the timeout after which a rank whose peer died fails.
    device = init_distributed(timeout=args.pg_timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    order = None
    if args.global_batch is not None:
        if args.global_batch % (world * args.micro_batch):
            parser.error(
                f"--global-batch {args.global_batch} is not divisible by {world} rank(s) x "
                f"--micro-batch {args.micro_batch}"
            )
        args.grad_accum = args.global_batch // (world * args.micro_batch)
        if rank == 0:  # re-planned at every (elastic) start: the global batch stays the same
            print(
                f"world {world}: {args.grad_accum} micro-batch(es) of {args.micro_batch} per step"
            )
        order = SampleOrder(args.samples, global_batch=args.global_batch, seed=args.seed)
        data = torch.Generator().manual_seed(args.seed)
        if args.variable_length:  # 4 positions per sample, 1 + index % 4 of them valid
            dataset = torch.randn(args.samples, POSITIONS, 32, generator=data)
        else:
            dataset = torch.randn(args.samples, 32, generator=data)
    try:
        model = prepare_model(
            TinyNet,
            {"width": 32, "depth": 4},
            config=config,
            device=device,
            default_dtype=torch.float32,
            seed=args.seed,
            trainable=freeze_encoder,
            forward_methods=["loss", "loss_sum"],
        )
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
        ft = fault_tolerance_of(model) if args.fault_tolerance else None
        first = 0
        if args.resume:  # any strategy, any world size: DCP reshards
            first = load_checkpoint(args.resume, model, optimizer).step or 0
        manager = None
        if args.ckpt_dir:  # resumes by itself: the latest complete checkpoint, if any
            manager = CheckpointManager(
                args.ckpt_dir,
                every=args.ckpt_every,
                keep_last=args.keep_last,
                async_save=args.async_save,
                on_sigterm=args.save_on_sigterm,
                signals=(
                    [*args.save_on_signal, *(["TERM"] if args.save_on_sigterm else [])]
                    if args.save_on_signal
                    else None
                ),
                requeue=args.requeue,
            )
            if ft is None:
                first = manager.resume(model, optimizer)
        # torchft's commit: zero_grad() joins the step's quorum (a group behind heals there),
        # step() runs only if this group's step succeeded on all its ranks.
        stepper = ft.wrap_optimizer(optimizer) if ft is not None else optimizer
        if ft is not None and manager is not None:
            # Through the manager's commit, with its state: a checkpoint never holds a step
            # that the group rolled back.
            first = ft.resume(manager)
            ft.save_on_commit(manager)
        step = first
        while step < args.steps:
            if ft is not None:
                stepper.zero_grad()
                step = ft.step  # the steps committed: a healed group's too
                if step >= args.steps:
                    break
            if order is None:
                # A step's data depends only on (seed, rank, step), and the replica group: a
                # resumed run sees the same.
                keys = (rank, step) if ft is None else (f"group{args.replica_id}", rank, step)
                data = torch.Generator().manual_seed(derive_seed(args.seed, "data", *keys))
                x = torch.randn(args.batch_size, 32, generator=data).to(device)
                y = x.sum(dim=1, keepdim=True).div(32)
                micro = list(zip(x.chunk(args.grad_accum), y.chunk(args.grad_accum), strict=True))
                seen = ""
            else:  # this rank's share of the step's global batch, the same at any world size
                parts = order.micro_batches(
                    step, rank=rank, world_size=world, accum=args.grad_accum
                )
                micro = []
                for indices in parts:
                    xs = dataset[indices].to(device)
                    micro.append((xs, xs.sum(dim=-1, keepdim=True).div(32)))
                seen = ", samples " + _consumed([i for part in parts for i in part], world)
            masks = [_valid(part, device) for part in parts] if args.variable_length else []
            # Variable length: the items of the whole global batch, counted once per step.
            count = global_count([m.sum() for m in masks], model=model) if masks else None
            total = 0.0
            for index, (xs, ys) in enumerate(micro):
                last = index == len(micro) - 1
                # All micro-steps but the last skip the gradient reduction (DDP or FSDP alike);
                # forward and backward both run inside the block.
                with contextlib.nullcontext() if last else no_sync(model):
                    if count is None:
                        loss = model.loss(xs, ys) / args.grad_accum
                    elif args.naive_mean:  # each micro-batch's token mean: split-dependent
                        loss = model.loss_sum(xs, ys, masks[index]) / masks[index].sum()
                        loss = loss / args.grad_accum
                    else:  # sum of item losses / global count, scaled for the reduction
                        loss = count_mean(model.loss_sum(xs, ys, masks[index]), count, model=model)
                    loss.backward()
                total += loss.item()
            if args.clip is not None:
                norm = clip_grad_norm(model, args.clip)  # the same value on every rank
            stepper.step()
            if ft is None:
                optimizer.zero_grad()
            if rank == 0:
                clipped = f", grad norm {norm.item():.6f}" if args.clip is not None else ""
                print(f"step {step}: loss {total:.6f}{clipped}{seen}")
            _test_kill(rank, step + 1, "step")
            time.sleep(float(os.environ.get("TRAIN_TEST_STEP_SLEEP", "0")))  # tests: a slow step
            if manager is not None and ft is None:  # (under torchft: saved in the commit)
                _test_kill(rank, step + 1, "save")
                manager.maybe_save(step + 1, model, optimizer)  # the steps completed so far
            step = step + 1 if ft is None else ft.step
        if manager is not None:
            manager.close()  # waits for a background save
        if ft is not None:
            ft.shutdown()
        if args.save:
            save_checkpoint(args.save, model, optimizer, step=args.steps, overwrite=True)
        full = full_state_dict(model)  # plain CPU tensors on rank 0, under either strategy
        if rank == 0:
            total = sum(float(t.double().sum()) for t in full.values())
            print(f"{args.strategy}: final weight sum {total:.6f}")
            # A fixed random projection: unlike the sum, it moves with the updates' direction.
            axis = torch.Generator().manual_seed(0)
            projection = sum(
                float(
                    (t.double().flatten() * torch.randn(t.numel(), generator=axis).double()).sum()
                )
                for _, t in sorted(full.items())
            )
            print(f"{args.strategy}: final weight projection {projection:.9f}")
            print(f"{args.strategy}: final fingerprint {state_fingerprint(sorted(full.items()))}")
        # Every rank is done before any rank tears the group down: a gloo peer that is torn
        # down while the other still holds the connection can abort the process.
        dist.barrier()
    finally:
        dist.destroy_process_group()


POSITIONS = 4
"""Positions per sample with --variable-length."""


def _valid(indices: list[int], device: torch.device) -> torch.Tensor:
    """The mask of a micro-batch's valid positions: sample ``i`` has ``1 + i % 4`` of them."""
    lengths = torch.tensor([1 + i % POSITIONS for i in indices])
    return (torch.arange(POSITIONS)[None, :] < lengths[:, None]).to(device)


def _consumed(mine: list[int], world: int) -> str:
    """A digest of the sample indices every rank read this step (collective)."""
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    indices = sorted(i for part in everyone for i in part)
    return hashlib.sha256(str(indices).encode()).hexdigest()[:12]


def _test_kill(rank: int, steps_done: int, where: str) -> None:
    """The restart test's hook: kill this rank with SIGKILL where ``TRAIN_TEST_KILL`` says.

    ``TRAIN_TEST_KILL="attempt:rank:steps:where,..."``: after that many steps (``step``), or
    inside the save that follows them, after its files are written and before the checkpoint
    is published (``save``), in the given torchrun attempt (``TORCHELASTIC_RESTART_COUNT``).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for spec in filter(None, os.environ.get("TRAIN_TEST_KILL", "").split(",")):
        if spec.split(":") == [attempt, str(rank), str(steps_done), where]:
            if where == "step":
                os.kill(os.getpid(), signal.SIGKILL)
            _kill_in_save(f"step-{steps_done}")


def _kill_in_save(name: str) -> None:
    """Inject the restart test's fault into checkpoint-io's writer: SIGKILL in a save.

    Once this rank's files of the save of ``name`` are written, before the checkpoint is
    published (this save only: a background save still finishing must not be the one killed).
    """
    from checkpoint_io._storage.writer import SafeWriter

    write_data = SafeWriter.write_data

    def then_die(self: Any, plan: Any, planner: Any) -> Any:
        done = write_data(self, plan, planner)
        if self.partial.name.startswith(f".{name}.partial-"):  # the save of ``name``
            done.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    SafeWriter.write_data = then_die  # type: ignore[method-assign]


def _end(code: int) -> None:
    """Leave without the interpreter's C++ teardown, once everything is done and flushed.

    The process group is destroyed by then; what is left is torch's static destructors, and
    with gloo one of them aborts now and then ("terminate called without an active
    exception", SIGABRT after the last line was printed: 5 of 110 runs here). An
    abort would turn a finished run into a failed one for torchrun (and restart it).
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as stop:  # a SIGTERM save (code 0), or an argparse error (code 2)
        if not isinstance(stop.code, (int, type(None))):
            raise
        _end(stop.code or 0)
    _end(0)
