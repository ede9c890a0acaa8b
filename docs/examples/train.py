"""A small trainer on distributed-strategy: DDP or FSDP from the command line.

Run it on CPU with two gloo ranks:

    torchrun --nproc-per-node 2 docs/examples/train.py --strategy ddp
    torchrun --nproc-per-node 2 docs/examples/train.py --strategy fsdp --steps 5

On a GPU host it uses NCCL and one GPU per rank. It builds the model with ``prepare_model``
(identical replicas, verified), freezes the encoder with a trainable policy, trains a few
steps of SGD on per-rank data, and prints the loss and a fingerprint of the full weights from
rank 0: the same for both strategies.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from distributed_strategy import derive_seed, prepare_model, unwrap_model


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


def freeze_encoder(model: nn.Module) -> None:
    """The trainable policy: applied before the wrap, so DDP's reducer sees it."""
    model.encoder.requires_grad_(False)


def main() -> None:
    """Parse arguments, prepare the model, train a few steps, report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        model = prepare_model(
            TinyNet,
            {"width": 32, "depth": 4},
            config={"strategy": args.strategy},
            device=device,
            default_dtype=torch.float32,
            seed=args.seed,
            trainable=freeze_encoder,
            forward_methods=["loss"],
        )
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
        data = torch.Generator().manual_seed(derive_seed(args.seed, "data", rank))
        for step in range(args.steps):
            x = torch.randn(8, 32, generator=data).to(device)
            y = x.sum(dim=1, keepdim=True).div(32).to(device)
            loss = model.loss(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if rank == 0:
                print(f"step {step}: loss {loss.item():.6f}")
        full = {
            name: tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            for name, tensor in unwrap_model(model).state_dict().items()
        }
        if rank == 0:
            total = sum(float(t.double().sum()) for t in full.values())
            print(f"{args.strategy}: final weight sum {total:.6f}")
        # Every rank is done before any rank tears the group down: a gloo peer that is torn
        # down while the other still holds the connection can abort the process.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
