"""Rank functions for fsdp-wrap's two-rank test (real gloo process group)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dist_harness import rank_device
from fsdp_wrap import wrap_module_fsdp
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
    return out
