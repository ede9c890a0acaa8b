"""Models for the microbenchmarks."""

from __future__ import annotations

import torch
from torch import nn


class RunnerModel(nn.Module):
    """A small transformer-ish stack with the helpers a runner calls through the wrapper."""

    def __init__(self, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 4 * width),
                nn.GELU(),
                nn.Linear(4 * width, width),
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)
        self.register_buffer("mean", torch.zeros(width))
        self.latent_seq_len = 250

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return x - self.mean

    def identity(self, x: torch.Tensor) -> torch.Tensor:
        """An empty method: calling it through the wrapper shows only the delegation cost."""
        return x
