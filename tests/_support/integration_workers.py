"""Rank functions for the composed pipeline's two-rank tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dist_harness import rank_device
from distributed_strategy import derive_seed, prepare_model, unwrap_model
from toy_models import Regressor

SEED = 11
STEPS = 3


def freeze_encoder(model: nn.Module) -> None:
    model.encoder.requires_grad_(False)


def _full_weights(model: nn.Module) -> dict[str, list[Any]]:
    """Every full tensor as nested lists (tensors do not travel well between processes)."""
    state = unwrap_model(model).state_dict()
    return {
        name: (t.full_tensor() if hasattr(t, "full_tensor") else t).tolist()
        for name, t in state.items()
    }


def train_both(rank: int, world_size: int) -> dict[str, Any]:
    """A few SGD steps under DDP and under FSDP from one seed and the same per-rank data."""
    out: dict[str, Any] = {}
    for strategy in ("ddp", "fsdp"):
        model = prepare_model(
            Regressor,
            {"width": 8},
            config={"strategy": strategy},
            device=rank_device(),
            default_dtype=torch.float32,
            seed=SEED,
            trainable=freeze_encoder,
        )
        initial = _full_weights(model)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        data = torch.Generator().manual_seed(derive_seed(SEED, "data", rank))
        for _ in range(STEPS):
            x = torch.randn(4, 8, generator=data).to(rank_device())
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        out[strategy] = {
            "initial": initial,
            "final": _full_weights(model),
            "frozen_grad_is_none": unwrap_model(model).encoder.weight.grad is None,
        }
    return out
