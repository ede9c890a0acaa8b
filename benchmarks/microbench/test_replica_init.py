"""replica-init's build and fingerprint beside the bare recipe and plain hashing."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from replica_init import build_replicated_model_from_scratch, model_fingerprint
from replica_init._broadcast import broadcast_coalesced
from strategy_bench import PRESETS, BenchTransformer

GROUPS = {
    "test_build": "replica-init: build vs bare recipe",
    "test_fingerprint": "replica-init: fingerprint vs sha256 of the bytes",
    "test_rank0_broadcast": "replica-init: rank0 coalesced vs per-tensor broadcast",
}
PARAMS = PRESETS["small"].init_params()


def test_build(paired: Any) -> None:
    torch.set_num_threads(1)
    if paired.side == "raw":

        def build() -> None:
            torch.manual_seed(3)
            torch.set_default_dtype(torch.float32)
            BenchTransformer(**PARAMS).to("cpu")
    else:

        def build() -> None:
            build_replicated_model_from_scratch(
                BenchTransformer, PARAMS, device="cpu", default_dtype=torch.float32, seed=3
            )

    paired(build, rounds=30)


def test_fingerprint(paired: Any) -> None:
    model = BenchTransformer(**PARAMS)
    tensors = [*model.parameters(), *model.buffers()]
    size = sum(t.numel() * t.element_size() for t in tensors)
    if paired.side == "raw":

        def digest() -> None:
            h = hashlib.sha256()
            for t in tensors:
                h.update(t.detach().contiguous().view(torch.uint8).numpy())
            h.hexdigest()
    else:

        def digest() -> None:
            model_fingerprint(model)

    paired(digest, rounds=20)
    paired.note(gb_per_s=size / paired.benchmark.stats.stats.median / 1e9)


@pytest.mark.usefixtures("process_group")
def test_rank0_broadcast(paired: Any) -> None:
    """What source='rank0' sends, for a model of 512 small tensors (1-rank gloo: the fixed
    cost per collective, which is what coalescing removes)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(256)))
    before = model_fingerprint(model)
    tensors = [t.data for t in [*model.parameters(), *model.buffers()]]
    assert len(tensors) >= 500
    if paired.side == "raw":

        def send() -> None:
            for tensor in tensors:
                dist.broadcast(tensor, src=0)
    else:

        def send() -> None:
            broadcast_coalesced(tensors, src=0)

    paired(send, rounds=60)
    assert model_fingerprint(model) == before
