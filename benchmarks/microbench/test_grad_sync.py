"""grad-sync beside the raw torch calls it replaces, on a one-rank gloo group."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from microbench_models import RunnerModel
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from grad_sync import clip_grad_norm, no_sync

pytestmark = pytest.mark.usefixtures("process_group")

GROUPS = {
    "test_ddp_micro_step": "grad-sync: DDP micro-step in no_sync",
    "test_fsdp_micro_step": "grad-sync: FSDP micro-step in no_sync",
    "test_clip": "grad-sync: clip_grad_norm",
}


def _model() -> RunnerModel:
    torch.manual_seed(0)
    return RunnerModel(width=128, depth=4)


def _batch() -> torch.Tensor:
    return torch.randn(16, 128, generator=torch.Generator().manual_seed(0))


def test_ddp_micro_step(paired: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = DistributedDataParallel(_model(), broadcast_buffers=False)
    x = _batch()
    model(x).sum().backward()  # DDP's first iteration outside the timing
    context = model.no_sync if paired.side == "raw" else (lambda: no_sync(model))

    def micro_step() -> None:
        with context():
            model(x).sum().backward()

    paired(micro_step, rounds=60, iterations=5)


def test_fsdp_micro_step(paired: Any) -> None:
    model = _model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    x = _batch()
    model(x).sum().backward()

    def raw() -> None:
        model.set_requires_gradient_sync(False)
        model(x).sum().backward()
        model.set_requires_gradient_sync(True)

    def ours() -> None:
        with no_sync(model):
            model(x).sum().backward()

    paired(raw if paired.side == "raw" else ours, rounds=60, iterations=5)


def test_clip(paired: Any) -> None:
    model = _model()
    model(_batch()).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    params = list(model.parameters())

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        for p, g in zip(params, grads, strict=True):
            p.grad = copy.copy(g).clone()
        return (), {}

    if paired.side == "raw":  # as trainers write it: the model's parameters, walked per call
        paired(
            lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5),
            rounds=200,
            setup=setup,
        )
    else:
        paired(lambda: clip_grad_norm(model, 0.5), rounds=200, setup=setup)
