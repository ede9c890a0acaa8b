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


class RunnerNet(nn.Module):
    """Shaped like the MMAudio network as its runner uses it: helper methods reached through
    ``.module``, a parameter read directly, a frozen submodule, a property with a setter."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.net = nn.Linear(width, 1, bias=False)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.empty_clip_feat = nn.Parameter(torch.zeros(width))
        self.register_buffer("mean", torch.zeros(width))
        self.latent_seq_len = 7
        self._cfg_strength = 1.0

    @property
    def cfg_strength(self) -> float:
        return self._cfg_strength

    @cfg_strength.setter
    def cfg_strength(self, value: float) -> None:
        if value < 0:
            raise ValueError("cfg_strength must be >= 0")
        self._cfg_strength = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x + self.empty_clip_feat)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Runs no submodule: allowed through the wrapper under grad."""
        return x - self.mean

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Runs only a frozen submodule: allowed under grad."""
        return self.frozen(x)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """Runs the trainable ``net`` outside ``forward``: a bypass unless marked."""
        return (self.forward(x) ** 2).sum()
