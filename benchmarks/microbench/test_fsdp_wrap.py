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

GROUPS = {"test_wrap": "fsdp-wrap: wrap vs fully_shard"}


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
