"""Rank bodies for the recipe tests: prepare_model with each knob, gradients compared."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distributed_strategy import prepare_model
from grad_sync import clip_grad_norm
from toy_models import Regressor

RECIPES: dict[str, dict[str, Any]] = {
    "plain": {},
    "full": {"activation_checkpointing": "full"},
    "selective": {"activation_checkpointing": "selective"},
    "offload": {"offload": "cpu"},
}


def _gradients(model: nn.Module, rank: int) -> tuple[dict[str, torch.Tensor], int]:
    """One step's gradients of ``model`` (whole tensors, gathered from FSDP's shards), and how
    many times the blocks' norms ran (twice per block when checkpointing recomputes them)."""
    calls = [0]
    inner = model.module if hasattr(model, "module") else model
    for block in inner.blocks:
        block.norm.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    torch.manual_seed(100 + rank)
    x = torch.randn(6, 8)
    model(x).pow(2).mean().backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        assert grad is not None, name
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()
    return grads, calls[0]


def recipes(rank: int, world_size: int, folder: str) -> None:
    """Each recipe under DDP and FSDP: gradients against the plain model's, bit for bit."""
    out: dict[str, Any] = {}
    for strategy in ("ddp", "fsdp"):
        reference: dict[str, torch.Tensor] = {}
        reference_norm = 0.0
        for name, recipe in RECIPES.items():
            if strategy == "ddp" and name == "offload":
                continue
            model = prepare_model(
                Regressor,
                None,
                config={"strategy": strategy, **recipe},
                device="cpu",
                default_dtype=torch.float32,
                seed=5,
            )
            grads, runs = _gradients(model, rank)
            out[f"{strategy}-{name}-norm-runs"] = runs
            norm = float(clip_grad_norm(model, max_norm=1e9))  # grad-sync's global norm
            if name == "plain":
                reference, reference_norm = grads, norm
            out[f"{strategy}-{name}-clip-norm"] = norm == reference_norm
            out[f"{strategy}-{name}"] = sorted(grads) == sorted(reference) and all(
                torch.equal(grads[k], reference[k]) for k in reference
            )
        out[f"{strategy}-offload-on-host"] = strategy == "ddp" or all(
            p.device.type == "cpu" for p in model.parameters()
        )
    Path(folder, f"rank{rank}.json").write_text(json.dumps(out))
