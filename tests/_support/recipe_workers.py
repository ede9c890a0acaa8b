"""Rank bodies for the recipe tests: prepare_model with each knob, gradients compared."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from checkpoint_io import load_checkpoint, save_checkpoint
from distributed_strategy import prepare_model
from grad_sync import clip_grad_norm, no_sync
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


def _prepared(strategy: str, recipe: dict[str, Any]) -> nn.Module:
    return prepare_model(
        Regressor,
        None,
        config={"strategy": strategy, **recipe},
        device="cpu",
        default_dtype=torch.float32,
        seed=5,
    )


def _accumulated(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """The gradients of two micro-batches accumulated with grad-sync's ``no_sync``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(200 + rank)
    with no_sync(model):
        model(torch.randn(4, 8)).pow(2).mean().backward()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    return {name: _whole(param.grad) for name, param in model.named_parameters()}


def _whole(tensor: Any) -> torch.Tensor:
    assert tensor is not None
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def _same(found: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> bool:
    return sorted(found) == sorted(reference) and all(
        torch.equal(found[k], reference[k]) for k in reference
    )


def recipes(rank: int, world_size: int, folder: str) -> None:
    """Each recipe under DDP and FSDP: gradients (one step, two accumulated micro-steps) and
    the global clip norm against the plain model's, bit for bit; the checkpoint it saves
    loads into a fresh model with the same recipe and into a plain one, equal to the saved
    weights."""
    out: dict[str, Any] = {}
    for strategy in ("ddp", "fsdp"):
        reference: dict[str, torch.Tensor] = {}
        accumulated: dict[str, torch.Tensor] = {}
        reference_norm = 0.0
        for name, recipe in RECIPES.items():
            if strategy == "ddp" and name == "offload":
                continue
            model = _prepared(strategy, recipe)
            grads, runs = _gradients(model, rank)
            out[f"{strategy}-{name}-norm-runs"] = runs
            norm = float(clip_grad_norm(model, max_norm=1e9))  # grad-sync's global norm
            micro = _accumulated(model, rank)
            if name == "plain":
                reference, reference_norm, accumulated = grads, norm, micro
            out[f"{strategy}-{name}-clip-norm"] = norm == reference_norm
            out[f"{strategy}-{name}"] = _same(grads, reference)
            out[f"{strategy}-{name}-accumulated"] = _same(micro, accumulated)
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
            optimizer.step()
            saved = {k: _whole(v) for k, v in model.state_dict().items()}
            path = save_checkpoint(Path(folder, f"{strategy}-{name}"), model, optimizer, step=1)
            for into in ("same", "plain"):
                fresh = _prepared(strategy, recipe if into == "same" else {})
                fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
                load_checkpoint(path, fresh, fresh_optimizer)
                loaded = {k: _whole(v) for k, v in fresh.state_dict().items()}
                out[f"{strategy}-{name}-loads-into-{into}"] = _same(loaded, saved)
        out[f"{strategy}-offload-on-host"] = strategy == "ddp" or all(
            p.device.type == "cpu" for p in model.parameters()
        )
    Path(folder, f"rank{rank}.json").write_text(json.dumps(out))


def hsdp_recipes(rank: int, world_size: int, folder: str) -> None:
    """HSDP over 2 replicas x 2 shards: full and selective checkpointing against the plain
    recipe, gradients and grad-sync's global clip norm bit for bit."""
    out: dict[str, Any] = {}
    reference: dict[str, torch.Tensor] = {}
    reference_norm = 0.0
    for name in ("plain", "full", "selective"):
        model = _prepared("hsdp", {"replicate": 2, "shard": 2, **RECIPES[name]})
        mesh = next(iter(model.parameters())).device_mesh  # type: ignore[attr-defined]
        out["mesh"] = list(mesh.shape)
        grads, runs = _gradients(model, rank)
        out[f"hsdp-{name}-norm-runs"] = runs
        norm = float(clip_grad_norm(model, max_norm=1e9))
        if name == "plain":
            reference, reference_norm = grads, norm
        out[f"hsdp-{name}"] = _same(grads, reference)
        out[f"hsdp-{name}-clip-norm"] = norm == reference_norm
    Path(folder, f"rank{rank}.json").write_text(json.dumps(out))
