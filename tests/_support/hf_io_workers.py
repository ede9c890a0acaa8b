"""Rank bodies for hf-io's tests: tiny transformers models (built from a config, no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def gpt2(**config: Any) -> nn.Module:
    """A GPT-2 language model (its head tied to the token embedding)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(**config))


def llama(**config: Any) -> nn.Module:
    """A Llama language model (rotary tables as non-persistent buffers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**config))


GPT2 = {
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": 101,
    "n_positions": 32,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
LLAMA = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 103,
    "max_position_embeddings": 32,
}
FACTORIES = {"gpt2": (gpt2, GPT2), "llama": (llama, LLAMA)}


def tokens(vocab: int) -> torch.Tensor:
    """A fixed batch of token ids."""
    return torch.arange(2 * 12).reshape(2, 12) % vocab


def round_trip(rank: int, world: int, tmp: str, strategy: str) -> None:
    """Load each pretrained model into ``strategy``, train a step, save it out and checkpoint it.

    Rank 0 writes ``result-{strategy}.pt``: per model, the loaded full state (to compare with
    the original), whether the tie survived, and the trained model's logits on ``tokens``.
    """
    from checkpoint_io import full_state_dict, save_checkpoint
    from distributed_strategy import prepare_model, unwrap_model
    from hf_io import save_pretrained

    out: dict[str, Any] = {}
    for name, (factory, config) in FACTORIES.items():
        root = Path(tmp) / name
        model = prepare_model(
            factory,
            config,
            config=strategy,
            device="cpu",
            default_dtype=torch.float32,
            seed=0,
            pretrained=root / "original",
        )
        loaded = full_state_dict(model)
        plain = unwrap_model(model)
        tied = plain.lm_head.weight is plain.get_input_embeddings().weight
        batch = tokens(config["vocab_size"])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        model.eval()  # no dropout: from_pretrained returns a model in eval mode
        with torch.no_grad():
            logits = model(batch).logits
        save_pretrained(model, root / f"trained-{strategy}", max_shard_size="20KB")
        save_checkpoint(root / f"ckpt-{strategy}", model)
        buffers = {key: b.detach().cpu().clone() for key, b in plain.named_buffers()}
        out[name] = {"loaded": loaded, "tied": tied, "logits": logits, "buffers": buffers}
    if rank == 0:
        torch.save(out, Path(tmp) / f"result-{strategy}.pt")


class TiedNet(nn.Module):
    """Tied embedding and head, an integer buffer, a non-persistent buffer, odd row counts."""

    def __init__(self, vocab: int = 13, width: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("counts", torch.arange(vocab, dtype=torch.int64) * 3)
        self.register_buffer("table", torch.linspace(0, 1, width), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(ids)) + self.table))


def torch_wrapped(rank: int, world: int, tmp: str, kind: str) -> None:
    """torch's own ``fully_shard`` or ``DistributedDataParallel``: load, step, save, compare."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from hf_io import load_pretrained, save_pretrained

    def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
        # torch's own gather (hf-io does not depend on checkpoint-io)
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().clone() for k, v in state.items()}

    torch.manual_seed(100 + rank)  # every rank starts from other values: the file decides
    model = TiedNet()
    if kind in ("fsdp", "hsdp"):
        mesh = None
        if kind == "hsdp":  # 2 replicas x 2 shards: replica 0 alone writes
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model.body, mesh=mesh)
        wrapped: nn.Module = fully_shard(model, mesh=mesh)
    else:
        wrapped = DistributedDataParallel(model)
    info = load_pretrained(wrapped, Path(tmp) / "original")
    assert info.tied == (("embed.weight", "head.weight"),), info.tied
    assert model.head.weight is model.embed.weight
    loaded = full_state_dict(wrapped)
    ids = torch.arange(8).reshape(2, 4)
    wrapped(ids).sum().backward()
    torch.optim.SGD(wrapped.parameters(), lr=0.1).step()
    save_pretrained(wrapped, Path(tmp) / f"trained-{kind}")
    trained = full_state_dict(wrapped)
    if rank == 0:
        torch.save(
            {"loaded": loaded, "trained": trained, "read": info.bytes_read},
            Path(tmp) / f"{kind}.pt",
        )
