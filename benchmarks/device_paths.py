"""The paths that act differently on CUDA, run once on one rank: device_check.sh's step.

``init_distributed`` from torchrun's variables (NCCL on a GPU); ``prepare_model`` with FSDP,
CPU offload, selective activation checkpointing and ``compile``; one step and grad-sync's
``clip_grad_norm`` (its norm reduced on the mesh's device while the shards live on the host);
``save_checkpoint`` / ``load_checkpoint`` with the device's RNG state (the compute device comes
from the mesh, not from an offloaded shard); a background save (staging pinned at exact sizes);
``replica_drift`` and ``global_count`` on the device's group; ``save_pretrained`` /
``load_pretrained`` on the sharded model. Each check raises on a wrong result; the last line
says what ran.

Usage: ``DEVICE=cuda python benchmarks/device_paths.py`` (``DEVICE=cpu``: gloo, no compile by
default; ``COMPILE=1`` compiles there too).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from distributed_strategy import (
    async_save_checkpoint,
    clip_grad_norm,
    global_count,
    init_distributed,
    load_checkpoint,
    load_pretrained,
    prepare_model,
    replica_drift,
    save_checkpoint,
    save_pretrained,
)
from toy_models import Regressor


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
        for name, t in model.state_dict().items()
    }


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def main() -> None:
    """Run every check; raise on the first wrong result."""
    kind = os.environ.get("DEVICE", "cuda")
    compile_blocks = os.environ.get("COMPILE", "1" if kind == "cuda" else "0") == "1"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    start = time.perf_counter()
    device = init_distributed(timeout=60)
    assert device.type == kind, (device, kind)
    backend = dist.get_backend()
    config = {
        "strategy": "fsdp",
        "offload": "cpu",
        "activation_checkpointing": "selective",
        "compile": compile_blocks,
    }
    model = prepare_model(
        Regressor,
        {"width": 64},
        config=config,
        device=device,
        default_dtype=torch.float32,
        seed=0,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    model(torch.randn(16, 64, device=device)).pow(2).mean().backward()
    norm = clip_grad_norm(model, 0.5)
    assert torch.isfinite(norm) and float(norm) > 0, norm
    optimizer.step()
    shard = next(iter(model.parameters()))
    assert isinstance(shard, DTensor), type(shard)
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(7)
        if device.type == "cuda":
            torch.cuda.manual_seed(7)
        saved_rng = _rng_state(device)
        weights = _whole(model)
        save_checkpoint(Path(folder, "ckpt"), model, optimizer, step=1)
        torch.manual_seed(99)
        if device.type == "cuda":
            torch.cuda.manual_seed(99)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
        info = load_checkpoint(Path(folder, "ckpt"), model, optimizer)
        assert info.step == 1
        assert torch.equal(_rng_state(device), saved_rng), "the device's RNG state came back"
        restored = _whole(model)
        assert all(torch.equal(weights[k], restored[k]) for k in weights)
        staged = _whole(model)
        pending = async_save_checkpoint(Path(folder, "async"), model, optimizer, step=2)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)  # training goes on while the background save writes
        pending.wait()
        load_checkpoint(Path(folder, "async"), model, optimizer)
        assert all(torch.equal(staged[k], v) for k, v in _whole(model).items())
        drift = replica_drift(model)
        assert not drift.drifted, drift
        mask = torch.ones(1001, dtype=torch.bfloat16, device=device)
        assert int(global_count([mask, 3], model=model)) == 1004
        out = save_pretrained(model, Path(folder, "hf"))
        fresh = prepare_model(
            Regressor,
            {"width": 64},
            config={**config, "compile": False},
            device=device,
            default_dtype=torch.float32,
            seed=3,
        )
        load_pretrained(fresh, out)
        loaded = _whole(fresh)
        assert all(torch.equal(weights[k], loaded[k]) for k in weights)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.write(
        f"device paths on {device} ({backend}): init_distributed, prepare_model(fsdp, "
        f"offload=cpu, selective checkpointing, compile={compile_blocks}) with host shards "
        f"({shard.to_local().device}), a step, clip norm {float(norm):.4f}, checkpoint with the "
        f"{device.type} RNG state, a background save, replica_drift, global_count, "
        f"save/load_pretrained on shards: ok in "
        f"{time.perf_counter() - start:.1f} s\n"
    )


if __name__ == "__main__":
    main()
