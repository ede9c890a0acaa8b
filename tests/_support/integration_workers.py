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

    from dist_core import MemoryPeak
    from distributed_strategy import state_fingerprint
    from replica_init import model_fingerprint
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


def hsdp_against_ddp_and_fsdp(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """DDP, FSDP and HSDP (2 x 2) from one seed: 3 optimizer steps of 2 accumulated
    micro-batches (the first under no_sync) with the gradient clipped to norm 0.5; the HSDP
    model's checkpoint, and a DDP model loaded from it."""
    import torch.distributed as dist

    from distributed_strategy import (
        clip_grad_norm,
        load_checkpoint,
        no_sync,
        save_checkpoint,
        strategy_of,
    )

    out: dict[str, Any] = {}
    configs = {
        "ddp": {"strategy": "ddp"},
        "fsdp": {"strategy": "fsdp"},
        "hsdp": {"strategy": "hsdp", "replicate": 2, "shard": 2},
    }
    models: dict[str, nn.Module] = {}
    for name, config in configs.items():
        model = prepare_model(
            Regressor,
            {"width": 8},
            config=config,
            device=rank_device(),
            default_dtype=torch.float32,
            seed=SEED,
            trainable=freeze_encoder,
        )
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        data = torch.Generator().manual_seed(derive_seed(SEED, "data", rank))
        norms = []
        for _ in range(STEPS):
            for micro in range(2):
                x = torch.randn(4, 8, generator=data).to(rank_device())
                with no_sync(model) if micro == 0 else _nothing():
                    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean() / 2
                    loss.backward()
            norms.append(float(clip_grad_norm(model, 0.5)))
            if name == "hsdp":  # the gradients agree across the replicas (ranks r and r + 2)
                local = torch.cat(
                    [p.grad.to_local().flatten() for p in model.parameters() if p.grad is not None]
                )
                gathered: list[Any] = [None] * world_size  # shard sizes differ by rank
                dist.all_gather_object(gathered, local.tolist())
                out.setdefault("replicas_in_sync", []).append(
                    all(gathered[r] == gathered[r + 2] for r in range(2))
                )
            optimizer.step()
            optimizer.zero_grad()
        out[name] = {"final": _full_weights(model), "norms": norms, "kind": strategy_of(model)}
        models[name] = model
        if name in ("fsdp", "hsdp"):
            save_checkpoint(f"{folder}/{name}", model, optimizer, step=STEPS)
    # An HSDP checkpoint resumes under DDP.
    ddp = models["ddp"]
    with torch.no_grad():
        for param in ddp.parameters():
            param.add_(1.0)
    info = load_checkpoint(f"{folder}/hsdp", ddp)
    out["ddp_from_hsdp"] = {"final": _full_weights(ddp), "step": info.step}
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None
