"""wrap_module_fsdp beside calling fully_shard by hand on the same blocks."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from microbench_models import RunnerModel
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_wrap import wrap_module_fsdp

pytestmark = pytest.mark.usefixtures("process_group")

GROUPS = {
    "test_wrap": "fsdp-wrap: wrap vs fully_shard",
    "test_first_step": "fsdp-wrap: an optimizer's first step (stale-optimizer check) vs raw",
    "test_later_step": "fsdp-wrap: an optimizer's later steps vs raw",
}


def _raw(model: RunnerModel) -> None:
    mesh = init_device_mesh("cpu", (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def test_wrap(paired: Any) -> None:
    torch.manual_seed(0)
    model = RunnerModel(width=256, depth=8)
    wrap = _raw if paired.side == "raw" else (lambda m: wrap_module_fsdp(m, device="cpu"))

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        gc.collect()  # earlier rounds' wrapped copies must not be collected inside a timing
        return (copy.deepcopy(model),), {}

    paired(wrap, rounds=30, setup=setup)


def _wrapped_with_grads() -> RunnerModel:
    torch.manual_seed(0)
    model = wrap_module_fsdp(RunnerModel(width=256, depth=8), device="cpu")
    model(torch.randn(4, 256)).sum().backward()
    return model


def _side_hook(side: str) -> None:
    """Raw torch runs without fsdp-wrap's global step pre-hook; ours with it."""
    from fsdp_wrap._sentinel import _enable_hook

    _enable_hook(side == "ours")


def test_first_step(paired: Any) -> None:
    """A new optimizer's first step: ours checks its parameters once (the stale check)."""
    model = _wrapped_with_grads()

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        _side_hook(paired.side)
        return (torch.optim.SGD(model.parameters(), lr=0.0),), {}

    paired(lambda optimizer: optimizer.step(), rounds=50, setup=setup)
    _side_hook("ours")


def test_later_step(paired: Any) -> None:
    """Every step after the first: ours pays one hook call and a set lookup."""
    model = _wrapped_with_grads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    _side_hook("ours")
    optimizer.step()  # checked once

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        _side_hook(paired.side)
        return (), {}

    paired(optimizer.step, rounds=200, setup=setup)
    _side_hook("ours")
