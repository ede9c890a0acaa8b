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


def sharded_memory(rank: int, world_size: int, params: dict[str, int]) -> dict[str, Any]:
    """FSDP ``prepare_model`` from rank 0 of a large model: this rank's RSS growth, then the
    gathered full state's fingerprint against the official order's."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from distributed_strategy import MemoryPeak, model_fingerprint, state_fingerprint
    from toy_models import WideNet

    with MemoryPeak(interval=0.001) as host:
        model = prepare_model(
            WideNet,
            params,
            config={"strategy": "fsdp", "source": "rank0"},
            device=rank_device(),
            default_dtype=torch.float32,
            seed=11,
        )
    growth = host.host_growth
    tied = model.head.weight is model.embed.weight
    full = state_fingerprint(
        (name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)
        for name, tensor in sorted(
            [(f"param:{n}", p) for n, p in model.named_parameters()]
            + [(f"buffer:{n}", b) for n, b in model.named_buffers()]
        )
    )
    del model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        reference = WideNet(**params)
    largest = max(p.numel() * p.element_size() for p in reference.parameters())
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    dist.barrier()
    return {
        "growth": growth,
        "tied": tied,
        "full": full,
        "reference": model_fingerprint(reference),
        "largest": largest,
        "total": total,
    }


def every_worker(rank: int, world_size: int, workers: list[tuple[str, str]], tmp: str) -> Any:
    """Run several packages' workers one after the other in this rank (one process start for
    all of them); ``checkpoint_workers`` gets ``tmp``. Returns their results in order."""
    import importlib

    results = []
    for module, name in workers:
        worker = getattr(importlib.import_module(module), name)
        args = (tmp,) if module == "checkpoint_workers" else ()
        results.append(worker(rank, world_size, *args))
    return results
