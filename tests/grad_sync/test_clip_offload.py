"""Issue 47 (4): the global clip norm with FSDP2's CPU-offloaded shards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grad_sync._clip import reduce_device


def test_offloaded_shards_reduce_their_norm_on_the_mesh_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rule a CUDA run relies on, executed here: shards in host memory under a CUDA mesh
    (whose group is NCCL, which refuses host tensors) reduce their partial norm on this rank's
    CUDA device; on a CPU mesh, or shards already on the mesh's device, nothing moves."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cuda_mesh = SimpleNamespace(device_type="cuda")
    assert reduce_device(cuda_mesh, torch.device("cpu")) == torch.device("cuda", 1)
    assert reduce_device(cuda_mesh, torch.device("cuda", 0)) == torch.device("cuda", 0)
    cpu_mesh = SimpleNamespace(device_type="cpu")
    assert reduce_device(cpu_mesh, torch.device("cpu")) == torch.device("cpu")
