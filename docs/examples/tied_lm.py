r"""A small decoder-only language model whose output head shares the token embedding.

The tied case of Hugging Face decoders (``tie_word_embeddings``): one parameter, two uses.
Benchmark or estimate it with::

    PYTHONPATH=docs/examples strategy-bench estimate --model-factory tied_lm:TiedLM \\
        --init-params '{"width": 256, "depth": 4}' --input-factory tied_lm:make_batch
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 4096
SEQ_LEN = 128


class TiedLM(nn.Module):
    """Token embedding, ``depth`` pre-norm transformer layers, a head tied to the embedding."""

    def __init__(self, width: int = 256, depth: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next-token cross-entropy of ``tokens`` (a scalar: the benchmark's loss)."""
        x = self.embed(tokens[:, :-1])
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def make_batch(batch_size: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """One rank's batch of random tokens (drawn on CPU)."""
    return torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=generator).to(device)
