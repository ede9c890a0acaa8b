"""Small models shared by the tests: blocks in a ModuleList, tied weights, buffers."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class ToyNet(nn.Module):
    """Embedding, blocks, a head tied to the embedding, and buffers of both kinds."""

    def __init__(self, vocab: int = 16, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(width))
        self.register_buffer("noise", torch.randn(width), persistent=False)
        self.latent_seq_len = 4

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.scale + self.noise
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Regressor(nn.Module):
    """A plain MLP with a frozen-able encoder, for training-parity tests."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.encoder = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.encoder(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)
