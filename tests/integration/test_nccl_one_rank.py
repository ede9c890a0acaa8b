"""On a single GPU: every package's multi-rank worker once as a 1-rank NCCL run.

The two-rank NCCL variants need 2 GPUs; with one, this is what exercises NCCL: the process
group bound to the device, collectives on CUDA tensors, the ``rank0`` source's broadcast.
The same workers run at world size 1 on gloo too (checked by hand with ``backend="gloo"``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dist_harness import cuda_count, run_ranks

WORKERS = [
    ("ddp_wrap_workers", "gradient_sync"),
    ("fsdp_wrap_workers", "sharded_step"),
    ("replica_init_workers", "replica_checks"),
    ("integration_workers", "train_both"),
    ("grad_sync_workers", "everything"),
    ("checkpoint_workers", "everything"),
]


@pytest.mark.multiprocess
@pytest.mark.skipif(cuda_count() < 1, reason="1-rank NCCL run: needs a CUDA device, none visible")
@pytest.mark.parametrize(("module", "name"), WORKERS, ids=[m for m, _ in WORKERS])
def test_one_rank_nccl(module: str, name: str, tmp_path: Path) -> None:
    import importlib

    worker = getattr(importlib.import_module(module), name)
    args: tuple[Any, ...] = (str(tmp_path),) if module == "checkpoint_workers" else ()
    (result,) = run_ranks(worker, *args, world_size=1, backend="nccl")
    assert result
