"""Rank functions for fsdp-wrap's two-rank test (real gloo process group)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdp_wrap import wrap_module_fsdp
from toy_models import RunnerNet


def _data(rank: int) -> torch.Tensor:
    return torch.full((2, 4), float(rank + 1))


def sharded_step(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = RunnerNet()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrap_module_fsdp(model, device="cpu", forward_methods=["loss"])
    out: dict[str, Any] = {
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "local_rows": model.frozen.weight.to_local().shape[0],
    }
    model.loss(_data(rank)).backward()  # a registered forward method, not forward
    out["grads"] = {
        n: p.grad.full_tensor().tolist() for n, p in model.named_parameters() if p.grad is not None
    }
    # What each rank computes alone, to compare with the synchronised mean.
    torch.manual_seed(0)
    local = RunnerNet()
    local.load_state_dict({**local.state_dict(), **initial})
    local.loss(_data(rank)).backward()
    out["local_grads"] = {
        n: p.grad.tolist() for n, p in local.named_parameters() if p.grad is not None
    }
    return out
