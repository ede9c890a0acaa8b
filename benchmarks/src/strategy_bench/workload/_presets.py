"""The preset models: a transformer-style stack of attention and MLP blocks."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional


@dataclasses.dataclass(frozen=True)
class Preset:
    """One model size.

    Attributes:
        vocab: Vocabulary size (embedding rows and head outputs).
        width: Model width.
        depth: Number of blocks.
        heads: Attention heads.
        seq_len: Tokens per sample.
    """

    vocab: int
    width: int
    depth: int
    heads: int
    seq_len: int

    def init_params(self) -> dict[str, int]:
        """Keyword arguments for :class:`BenchTransformer`."""
        return {"vocab": self.vocab, "width": self.width, "depth": self.depth, "heads": self.heads}

    def parameter_count(self) -> int:
        """Parameters of the model (embedding and head not tied)."""
        per_block = 12 * self.width * self.width + 13 * self.width
        return 2 * self.vocab * self.width + self.depth * per_block + 2 * self.width

    def flops_per_sample(self) -> float:
        """Training FLOPs for one sample: 6 per parameter per token, plus attention scores.

        The input embedding is a lookup, not a matmul: its ``vocab * width`` parameters do no
        FLOPs (counting them overstated ``small`` by ~19%). Norms and biases are in the count
        (they are 0.1% here).
        """
        matmul = 6 * (self.parameter_count() - self.vocab * self.width) * self.seq_len
        attention = 12 * self.depth * self.width * self.seq_len * self.seq_len
        return float(matmul + attention)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(vocab=512, width=64, depth=2, heads=4, seq_len=64),
    "small": Preset(vocab=4096, width=256, depth=4, heads=4, seq_len=128),
    "medium": Preset(vocab=32000, width=1024, depth=16, heads=16, seq_len=1024),
    "large": Preset(vocab=32000, width=2048, depth=24, heads=16, seq_len=2048),
}
CPU_DEFAULT_MODELS = ("tiny", "small")
GPU_DEFAULT_MODELS = ("small", "medium", "large")
ESTIMATE_DEFAULT_MODELS = ("large",)


class Attention(nn.Module):
    """Causal multi-head self-attention with a fused QKV projection."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over the sequence, causally."""
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, width // self.heads).unbind(2)
        out = functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        projected: torch.Tensor = self.proj(out.transpose(1, 2).reshape(batch, seq, width))
        return projected


class Block(nn.Module):
    """Pre-norm transformer block: attention and a 4x MLP, both residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Two residual sub-blocks."""
        x = x + self.attn(self.norm1(x))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class BenchTransformer(nn.Module):
    """Token embedding, a ``ModuleList`` of blocks (FSDP's default units), norm and head."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width ({width}) must be divisible by heads ({heads})")
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for every position."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def synthetic_tokens(
    batch_size: int, seq_len: int, vocab: int, device: torch.device, generator: torch.Generator
) -> torch.Tensor:
    """A reproducible batch of random token ids (drawn on CPU, then moved)."""
    return torch.randint(0, vocab, (batch_size, seq_len + 1), generator=generator).to(device)


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting each next token."""
    logits = model(tokens[:, :-1])
    return functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
