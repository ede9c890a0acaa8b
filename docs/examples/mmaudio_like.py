r"""A small MMAudio-like network, for benchmarking a user model with strategy-bench.

The shape of the real thing at toy size: audio latents and visual (CLIP-like) features, a
timestep embedding, a stack of joint-attention blocks in an ``nn.ModuleList``, and a
flow-matching velocity head. Benchmark it with::

    PYTHONPATH=docs/examples strategy-bench sweep --device cpu \\
        --model-factory mmaudio_like:MMAudioLike --init-params '{"width": 256, "depth": 4}' \\
        --input-factory mmaudio_like:make_batch --trainable mmaudio_like:freeze_clip_projection
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional

LATENT_DIM = 20
LATENT_LEN = 64
CLIP_DIM = 64
CLIP_LEN = 16


class JointBlock(nn.Module):
    """Self-attention over [latents; clip tokens] with adaptive layer-norm from the timestep."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False)
        self.modulation = nn.Linear(width, 4 * width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.SiLU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        """One block: modulated attention, then a modulated MLP."""
        shift1, scale1, shift2, scale2 = self.modulation(t_emb).unsqueeze(1).chunk(4, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        batch, seq, width = h.shape
        q, k, v = self.qkv(h).view(batch, seq, 3, self.heads, width // self.heads).unbind(2)
        attended = functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        out: torch.Tensor = x + self.mlp(self.norm2(x) * (1 + scale2) + shift2)
        return out


class MMAudioLike(nn.Module):
    """Predicts the flow-matching velocity of audio latents given video features."""

    def __init__(self, width: int = 256, depth: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.width = width
        self.latent_in = nn.Linear(LATENT_DIM, width)
        self.clip_in = nn.Linear(CLIP_DIM, width)
        self.time_mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.blocks = nn.ModuleList(JointBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.velocity = nn.Linear(width, LATENT_DIM)
        self.empty_clip_feat = nn.Parameter(torch.zeros(1, CLIP_DIM))
        self.latent_seq_len = LATENT_LEN

    def timestep_embedding(self, t: torch.Tensor) -> torch.Tensor:
        """Sinusoidal embedding of the flow time in [0, 1], in the weights' compute dtype."""
        half = self.width // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
        angles = t[:, None].float() * 1000.0 * freqs[None]
        embedding = torch.cat([angles.sin(), angles.cos()], dim=-1)
        return embedding.to(self.latent_in.weight.dtype)  # bf16 under FSDP mixed precision

    def forward(
        self, latent: torch.Tensor, clip: torch.Tensor, t: torch.Tensor, drop: torch.Tensor
    ) -> torch.Tensor:
        """The velocity for every latent frame; ``drop`` marks samples trained unconditionally."""
        empty = self.empty_clip_feat.expand_as(clip)
        clip = torch.where(drop[:, None, None], empty, clip)  # classifier-free guidance dropout
        t_emb = self.time_mlp(self.timestep_embedding(t))
        x = torch.cat([self.latent_in(latent), self.clip_in(clip)], dim=1)
        for block in self.blocks:
            x = block(x, t_emb)
        out: torch.Tensor = self.velocity(self.norm(x[:, : latent.shape[1]]))
        return out


def freeze_clip_projection(model: nn.Module) -> None:
    """A trainable policy: the visual projection stays frozen, as with a pretrained encoder."""
    model.clip_in.requires_grad_(False)


def make_batch(
    batch_size: int, device: torch.device, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """One rank's batch: latents, clip features, flow times, CFG drop mask (drawn on CPU)."""
    latent = torch.randn(batch_size, LATENT_LEN, LATENT_DIM, generator=generator)
    clip = torch.randn(batch_size, CLIP_LEN, CLIP_DIM, generator=generator)
    t = torch.rand(batch_size, generator=generator)
    drop = torch.rand(batch_size, generator=generator) < 0.1
    return {
        "latent": latent.to(device),
        "clip": clip.to(device),
        "t": t.to(device),
        "drop": drop.to(device),
    }
