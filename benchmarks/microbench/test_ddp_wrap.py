"""ddp-wrap's hot paths beside raw torch DDP."""

from __future__ import annotations

import copy
import gc
import warnings
from typing import Any

import pytest
import torch
from microbench_models import RunnerModel
from torch.nn.parallel import DistributedDataParallel

from ddp_wrap import wrap_module_ddp

pytestmark = pytest.mark.usefixtures("process_group")

GROUPS = {
    "test_attribute_read": "ddp-wrap: attribute read",
    "test_method_call": "ddp-wrap: delegated method call",
    "test_empty_method_call": "ddp-wrap: empty delegated method call",
    "test_training_step": "ddp-wrap: training step",
    "test_wrap": "ddp-wrap: wrap vs DDP construction",
}
READS = 1000


def _raw_ddp(model: torch.nn.Module) -> DistributedDataParallel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return DistributedDataParallel(model, broadcast_buffers=False)


def _wrapped(side: str) -> Any:
    torch.manual_seed(0)
    model = RunnerModel()
    return _raw_ddp(model) if side == "raw" else wrap_module_ddp(model, device="cpu")


def test_attribute_read(paired: Any) -> None:
    wrapped = _wrapped(paired.side)
    if paired.side == "raw":

        def read() -> None:
            for _ in range(READS):
                wrapped.module.latent_seq_len
    else:

        def read() -> None:
            for _ in range(READS):
                wrapped.latent_seq_len

    paired(read, rounds=200)


def test_method_call(paired: Any) -> None:
    wrapped = _wrapped(paired.side)
    x = torch.ones(4, 128)
    if paired.side == "raw":

        def call() -> None:
            for _ in range(100):
                wrapped.module.normalize(x)
    else:

        def call() -> None:
            for _ in range(100):
                wrapped.normalize(x)

    paired(call, rounds=200)


def test_empty_method_call(paired: Any) -> None:
    """The fixed cost of reaching a method through the wrapper (the method does nothing)."""
    wrapped = _wrapped(paired.side)
    x = torch.ones(4, 128)
    if paired.side == "raw":

        def call() -> None:
            for _ in range(100):
                wrapped.module.identity(x)
    else:

        def call() -> None:
            for _ in range(100):
                wrapped.identity(x)

    paired(call, rounds=200)


def test_training_step(paired: Any) -> None:
    wrapped = _wrapped(paired.side)  # ours: trainable guard and bypass hooks on
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    x = torch.randn(64, 128)

    def step() -> None:
        wrapped(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    paired(step, rounds=300)


def test_wrap(paired: Any) -> None:
    torch.manual_seed(0)
    model = RunnerModel(width=256, depth=8)
    wrap = _raw_ddp if paired.side == "raw" else (lambda m: wrap_module_ddp(m, device="cpu"))

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        gc.collect()  # earlier rounds' wrapped copies must not be collected inside a timing
        return (copy.deepcopy(model),), {}

    paired(wrap, rounds=120, setup=setup)
