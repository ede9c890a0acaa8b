"""replica-init's build and fingerprint beside the bare recipe and plain hashing."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from replica_init import build_replicated_model_from_scratch, model_fingerprint
from strategy_bench import PRESETS, BenchTransformer

GROUPS = {
    "test_build": "replica-init: build vs bare recipe",
    "test_fingerprint": "replica-init: fingerprint vs sha256 of the bytes",
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
