"""The small model and trained state the one-process checkpoint-io tests share."""

from __future__ import annotations

import struct
import subprocess
import sys

import torch
from torch import nn


class Small(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def trained() -> tuple[Small, torch.optim.Optimizer]:
    """A seeded ``Small`` after one AdamW step (so the optimizer has state)."""
    torch.manual_seed(0)
    model = Small()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def wsum64(data: bytes) -> str:
    """Manifest format 2's checksum, from its definition, in plain Python."""
    block = 64 << 10
    padded = data + bytes(-len(data) % block)
    total = weighted = 0
    for index in range(len(padded) // block):
        words = struct.unpack(f"<{block // 8}Q", padded[index * block : (index + 1) * block])
        total += sum(words)
        weighted += (index + 1) * sum(words)
    return f"{total % 2**64:016x}{weighted % 2**64:016x}"


def checkpoint_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m checkpoint_io ARGS`` in a child process: its exit code and output."""
    return subprocess.run(
        [sys.executable, "-m", "checkpoint_io", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
