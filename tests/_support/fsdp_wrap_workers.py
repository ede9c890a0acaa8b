"""Rank functions for fsdp-wrap's two-rank test (real gloo process group)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dist_harness import rank_device
from fsdp_wrap import hsdp_mesh, wrap_module_fsdp
from toy_models import RunnerNet, SequentialViT


def _data(rank: int) -> torch.Tensor:
    return torch.full((2, 4), float(rank + 1), device=rank_device())


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def sharded_step(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = RunnerNet().to(rank_device())
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    records = _Records()
    logging.getLogger("fsdp_wrap").addHandler(records)
    try:
        wrap_module_fsdp(model, device=rank_device(), forward_methods=["loss"])
        vit = wrap_module_fsdp(SequentialViT().to(rank_device()), device=rank_device())
    finally:
        logging.getLogger("fsdp_wrap").removeHandler(records)
    out: dict[str, Any] = {
        "warnings": records.messages,
        "vit_units": sum(isinstance(b, FSDPModule) for b in vit.blocks),
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "local_rows": model.frozen.weight.to_local().shape[0],
    }
    model.loss(_data(rank)).backward()  # a registered forward method, not forward
    out["grads"] = {
        n: p.grad.full_tensor().tolist() for n, p in model.named_parameters() if p.grad is not None
    }
    # What each rank computes alone, to compare with the synchronised mean.
    torch.manual_seed(0)
    local = RunnerNet().to(rank_device())
    local.load_state_dict({**local.state_dict(), **initial})
    local.loss(_data(rank)).backward()
    out["local_grads"] = {
        n: p.grad.tolist() for n, p in local.named_parameters() if p.grad is not None
    }
    out["stale"] = {kind: _stale_optimizer(world_size, kind) for kind in ("fsdp", "hsdp")}
    return out


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}


def _stale_optimizer(world_size: int, kind: str) -> dict[str, Any]:
    """An optimizer made before the wrap is refused at its first step; one made after trains;
    one over unrelated tensors steps normally."""
    torch.manual_seed(0)
    model = SequentialViT().to(rank_device())
    early = torch.optim.AdamW(model.parameters(), lr=0.1)
    mesh = hsdp_mesh(rank_device(), replicate=world_size, shard=1) if kind == "hsdp" else None
    records = _Records()
    logging.getLogger("fsdp_wrap").addHandler(records)
    try:
        wrap_module_fsdp(model, device=rank_device(), mesh=mesh)
    finally:
        logging.getLogger("fsdp_wrap").removeHandler(records)
    before = _full(model)
    x = torch.randn(3, 4, device=rank_device())
    model(x).sum().backward()
    errors = []
    for _ in range(2):  # refused at every step, not only the first
        try:
            early.step()
        except RuntimeError as error:
            errors.append(str(error))
    unchanged = all(torch.equal(before[n], t) for n, t in _full(model).items())
    late = torch.optim.AdamW(model.parameters(), lr=0.1)
    late.step()
    trained = sum(not torch.equal(before[n], t) for n, t in _full(model).items())
    other = torch.nn.Parameter(torch.ones(2))
    other.grad = torch.ones(2)
    torch.optim.SGD([other], lr=0.5).step()
    return {
        "warnings": records.messages,
        "errors": errors,
        "unchanged": unchanged,
        "early_state": len(early.state),
        "trained": trained,
        "parameters": len(before),
        "other": other.detach().tolist(),
    }
