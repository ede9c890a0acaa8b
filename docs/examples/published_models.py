r"""Models of published multi-GPU runs, rebuilt with their published parameter counts.

What ``docs/results/estimate-published`` checks the estimate against (its README names each
run and its source). Each family is built exactly, so the parameter count equals the one the
run published:

- MPT (mosaicml/llm-foundry, ``scripts/train/yamls/pretrain/mpt-7b.yaml`` / ``mpt-13b.yaml``
  and MPTConfig's defaults): learned positions of ``max_seq_len``, biases, low-precision
  LayerNorm with bias, a 4x GELU MLP, a head tied to the token embedding (vocabulary 50368),
  a cross-entropy that keeps the logits' own dtype and writes its gradient over them (LLM
  Foundry's fused one). At 2048
  positions MPT-7B has 6,658,859,008 parameters and MPT-13B 12,853,954,560, the ``NumParams``
  of LLM Foundry's benchmark table.
- Llama 3.1 8B (pytorch/torchtitan ``torchtitan/models/llama``): RMSNorm, grouped-query
  attention (32 heads, 8 KV heads), SwiGLU MLP of 14336, rotary positions (no parameters),
  an untied head (vocabulary 128256): 8,030,261,248 parameters. Llama 2 70B the same way
  (64 heads, 8 KV heads, 80 layers, MLP 28672, vocabulary 32000): 68,976,648,192.

Estimate one with::

    PYTHONPATH=docs/examples strategy-bench estimate --model-factory published_models:mpt_13b \\
        --input-factory published_models:mpt_batch --tokens-per-sample 2048 --batch-size 2 \\
        --world-size 8 16 32 64 --gpu H100 --dtype bf16 --reduce-dtype bf16
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional

MPT_VOCAB = 50368
MPT_SEQ_LEN = 2048
LLAMA_VOCAB = 128256
LLAMA_SEQ_LEN = 8192
LLAMA2_VOCAB = 32000
LLAMA2_SEQ_LEN = 4096


def _autocast_dtype(tensor: torch.Tensor) -> torch.dtype:
    device = tensor.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tensor.dtype


class LPLayerNorm(nn.LayerNorm):
    """MPT's default norm (``low_precision_layernorm``): LayerNorm in the autocast dtype.

    Plain LayerNorm under autocast runs (and saves its input) in fp32; MPT's casts the input
    and its weights down first, so it saves bf16.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``layer_norm`` of ``x`` in the autocast dtype (as is without autocast)."""
        dtype = _autocast_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            return functional.layer_norm(
                x.to(dtype),
                self.normalized_shape,
                self.weight.to(dtype),
                self.bias.to(dtype),
                self.eps,
            )


class _FusedCrossEntropy(torch.autograd.Function):
    """Cross-entropy as LLM Foundry's fused kernel runs it (flash-attn's, ``inplace_backward``).

    It keeps the logits in their own dtype and the per-token log-sum-exp, and writes the
    gradient over the logits in place: no fp32 copy, no second logits-sized tensor.
    """

    CHUNK = 4096  # rows at a time: the fp32 temporaries stay small

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = []
        for start in range(0, logits.shape[0], _FusedCrossEntropy.CHUNK):
            block = logits[start : start + _FusedCrossEntropy.CHUNK].float()
            rows.append(torch.logsumexp(block, dim=-1))
        lse = torch.cat(rows)
        picked = logits.gather(1, targets[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, targets, lse)
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, targets, lse = ctx.saved_tensors
        scale = grad / logits.shape[0]
        for start in range(0, logits.shape[0], _FusedCrossEntropy.CHUNK):
            stop = start + _FusedCrossEntropy.CHUNK
            block = logits[start:stop]
            probs = torch.exp(block.float() - lse[start:stop, None])
            probs[torch.arange(block.shape[0], device=block.device), targets[start:stop]] -= 1
            block.copy_(probs * scale)
        return logits, None


class MPTBlock(nn.Module):
    """Pre-norm attention and a 4x GELU MLP, every linear with a bias (MPT's ``no_bias=False``)."""

    def __init__(self, d_model: int, n_heads: int, expansion: int = 4) -> None:
        super().__init__()
        self.heads = n_heads
        self.norm_1 = LPLayerNorm(d_model)
        self.wqkv = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.norm_2 = LPLayerNorm(d_model)
        self.up_proj = nn.Linear(d_model, expansion * d_model)
        self.down_proj = nn.Linear(expansion * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""
        batch, seq, width = x.shape
        q, k, v = self.wqkv(self.norm_1(x)).split(width, dim=-1)
        shape = (batch, seq, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out_proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.down_proj(functional.gelu(self.up_proj(self.norm_2(x))))


class MPT(nn.Module):
    """MPT: token and learned position embeddings, blocks, a final LayerNorm, a tied head."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_layers: int,
        vocab: int = MPT_VOCAB,
        max_seq_len: int = MPT_SEQ_LEN,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(MPTBlock(d_model, n_heads) for _ in range(n_layers))
        self.norm_f = LPLayerNorm(d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next-token cross-entropy of ``tokens`` (``seq_len + 1`` per sample)."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1], device=inputs.device)
        x = self.wte(inputs) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = functional.linear(self.norm_f(x), self.wte.weight)  # tied to the embedding
        loss: torch.Tensor = _FusedCrossEntropy.apply(logits.flatten(0, 1), targets.flatten())
        return loss


def mpt_7b() -> MPT:
    """MPT-7B: d_model 4096, 32 heads, 32 layers (6,658,859,008 parameters)."""
    return MPT(4096, 32, 32)


def mpt_13b() -> MPT:
    """MPT-13B: d_model 5120, 40 heads, 40 layers (12,853,954,560 parameters)."""
    return MPT(5120, 40, 40)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x / rms(x) * weight``, computed in fp32."""
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaBlock(nn.Module):
    """RMSNorm, grouped-query attention with rotary positions, RMSNorm, SwiGLU; no biases."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.attention_norm = RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One block: ``x + attn(norm(x))``, then ``x + swiglu(norm(x))``."""
        batch, seq, dim = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attended.transpose(1, 2).reshape(batch, seq, dim))
        h = self.ffn_norm(x)
        return x + self.w2(functional.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """Llama 3: token embedding, blocks, a final RMSNorm, an untied output head."""

    def __init__(
        self,
        dim: int = 4096,
        n_layers: int = 32,
        n_heads: int = 32,
        n_kv_heads: int = 8,
        hidden: int = 14336,
        vocab: int = LLAMA_VOCAB,
        rope_theta: float = 500000.0,
    ) -> None:
        super().__init__()
        self.rope_theta = rope_theta
        self.head_dim = dim // n_heads
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            LlamaBlock(dim, n_heads, n_kv_heads, hidden) for _ in range(n_layers)
        )
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next-token cross-entropy of ``tokens`` (``seq_len + 1`` per sample)."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        seq = inputs.shape[1]
        half = self.head_dim // 2
        exponent = torch.arange(half, device=inputs.device, dtype=torch.float32) / half
        frequencies = 1.0 / (self.rope_theta**exponent)
        angles = torch.outer(torch.arange(seq, device=inputs.device).float(), frequencies)
        cos, sin = angles.cos(), angles.sin()
        x = self.tok_embeddings(inputs)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        return functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def llama31_8b() -> Llama:
    """Llama 3.1 8B (8,030,261,248 parameters)."""
    return Llama()


def llama2_70b() -> Llama:
    """Llama 2 70B (68,976,648,192 parameters): dim 8192, 80 layers, 64 heads, 8 KV heads."""
    return Llama(8192, 80, 64, 8, 28672, vocab=32000, rope_theta=10000.0)


def _tokens(
    batch_size: int, seq_len: int, vocab: int, device: torch.device, generator: torch.Generator
) -> torch.Tensor:
    return torch.randint(0, vocab, (batch_size, seq_len + 1), generator=generator).to(device)


def mpt_batch(batch_size: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """One rank's batch for MPT: 2048 positions (``--tokens-per-sample 2048``)."""
    return _tokens(batch_size, MPT_SEQ_LEN, MPT_VOCAB, device, generator)


def llama_batch(batch_size: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """One rank's batch for Llama 3.1 8B: 8192 positions (``--tokens-per-sample 8192``)."""
    return _tokens(batch_size, LLAMA_SEQ_LEN, LLAMA_VOCAB, device, generator)


def llama2_batch(batch_size: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """One rank's batch for Llama 2 70B: 4096 positions (``--tokens-per-sample 4096``)."""
    return _tokens(batch_size, LLAMA2_SEQ_LEN, LLAMA2_VOCAB, device, generator)


PUBLISHED_PARAMETERS = {
    "mpt_7b": 6_658_859_008,
    "mpt_13b": 12_853_954_560,
    "llama31_8b": 8_030_261_248,
    "llama2_70b": 68_976_648_192,
}
"""The parameter counts the runs published (LLM Foundry's ``NumParams``; Llama 3.1 8B's)."""
