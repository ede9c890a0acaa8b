"""Small models shared by the tests: blocks in a ModuleList, tied weights, buffers."""

from __future__ import annotations

from typing import ClassVar

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


class Body(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.layer1 = nn.Linear(width, width)
        self.layer2 = nn.Linear(width, width)
        self.hooks_seen: list[int] = []  # bypass hooks present while the forward ran

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hooks_seen.append(len(self.layer1._forward_hooks))
        return self.layer2(torch.tanh(self.layer1(x)))


class Nested(nn.Module):
    """Trainable submodules at depth 1 and 2 (``body``, ``body.layer1``), for the bypass
    through submodules; ``checkpoint`` recomputes ``body`` in backward."""

    def __init__(self, width: int = 4, checkpoint: str | None = None) -> None:
        super().__init__()
        self.body = Body(width)
        self.head = nn.Linear(width, 1)
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint is None:
            h = self.body(x)
        else:
            from torch.utils.checkpoint import checkpoint

            h = checkpoint(self.body, x, use_reentrant=self.checkpoint == "reentrant")
        return self.head(h)


class DecoderLayer(Block):
    """A transformer block under the name a Hugging Face model declares."""


class DecoderStack(nn.Module):
    """Shaped like a Hugging Face decoder: ``_no_split_modules`` names its layer class; the
    layers sit in a ModuleList next to a second, undeclared one (which must not be chosen)."""

    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer"]

    def __init__(self, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, width)
        self.layers = nn.ModuleList(DecoderLayer(width) for _ in range(depth))
        self.adapters = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer, adapter in zip(self.layers, self.adapters, strict=True):
            x = adapter(layer(x))
        return self.norm(x)


class CausalLM(nn.Module):
    """The declaration sits on a submodule (a ``...ForCausalLM`` around its base model)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = DecoderStack()
        self.lm_head = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))


class SequentialViT(nn.Module):
    """Shaped like timm's ViT: the blocks in an ``nn.Sequential``, an MLP head that is a
    ``Sequential`` of single layers (one MLP, not blocks), a parameter-free repeat."""

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(4, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 2))
        self.acts = nn.ModuleList([nn.GELU(), nn.GELU()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.patch_embed(x)))


class WideNet(nn.Module):
    """About ``4 * depth + 32`` MiB of float32 in ``2 * depth + 1`` tensors plus a tied head:
    the model that FSDP's memory tests build (a random non-persistent buffer included)."""

    def __init__(self, width: int = 1024, depth: int = 120, vocab: int = 8192) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("noise", torch.randn(width), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.noise
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


class TinyDecoder(nn.Module):
    """Shaped like a Hugging Face causal LM: an input embedding (``get_input_embeddings``),
    blocks, a head tied to the embedding, and ``forward(input_ids=..., inputs_embeds=...)``."""

    def __init__(self, vocab: int = 16, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def forward(
        self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)
