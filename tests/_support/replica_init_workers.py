"""Rank functions for replica-init's multi-process tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dist_harness import rank_device
from replica_init import (
    ReplicaMismatchError,
    assert_replicas_identical,
    build_replicated_model,
    build_replicated_model_from_scratch,
    build_sharded_model,
    model_fingerprint,
    state_fingerprint,
)
from replica_init._broadcast import broadcast_coalesced
from replica_init._fingerprint import named_state_tensors
from toy_models import ToyNet

PARAMS = {"vocab": 32, "width": 8, "depth": 2}


def _fails_on_rank0(**kwargs: Any) -> ToyNet:
    if dist.get_rank() == 0:
        raise ValueError("constructor failed on rank 0")
    return ToyNet(**kwargs)


def replica_checks(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rng_before = torch.get_rng_state()
    local = build_replicated_model(
        ToyNet, PARAMS, device=rank_device(), default_dtype=torch.float32, seed=3
    )
    out["fp_local"] = assert_replicas_identical(local)
    out["rng_unchanged"] = torch.equal(torch.get_rng_state(), rng_before)

    skewed = build_replicated_model_from_scratch(
        ToyNet, PARAMS, device=rank_device(), default_dtype=torch.float32, seed=100 + rank
    )
    try:
        assert_replicas_identical(skewed)
    except ReplicaMismatchError as error:
        out["seed_mismatch"] = (str(error), error.ranks, error.tensor)

    flipped = build_replicated_model_from_scratch(
        ToyNet, PARAMS, device=rank_device(), default_dtype=torch.float32, seed=3
    )
    if rank == 1:
        with torch.no_grad():
            bits = flipped.blocks[1].mlp[0].bias.view(torch.int32)
            bits[0] ^= 1
    try:
        assert_replicas_identical(flipped)
    except ReplicaMismatchError as error:
        out["bit_mismatch"] = (str(error), error.ranks, error.tensor)

    from_rank0 = build_replicated_model(
        ToyNet, PARAMS, device=rank_device(), default_dtype=torch.float32, seed=3, source="rank0"
    )
    out["fp_rank0"] = model_fingerprint(from_rank0)
    out["rank0_tied"] = from_rank0.head.weight is from_rank0.embed.weight
    out["rank0_meta_left"] = any(
        t.is_meta for t in [*from_rank0.parameters(), *from_rank0.buffers()]
    )
    out["rank0_noise"] = from_rank0.noise.tolist()
    out["rank0_rng_unchanged"] = torch.equal(torch.get_rng_state(), rng_before)

    try:
        build_replicated_model(
            _fails_on_rank0,
            PARAMS,
            device=rank_device(),
            default_dtype=torch.float32,
            seed=3,
            source="rank0",
        )
    except Exception as error:
        out["rank0_failure"] = f"{type(error).__name__}: {error}"

    # Coalesced broadcast over small buckets: mixed dtypes, a tensor larger than a bucket,
    # a non-contiguous view and an empty tensor; everyone ends with rank 0's bits.
    base = torch.arange(12.0).reshape(3, 4) + 100 * rank
    tensors = [
        torch.full((3,), rank + 0.5),
        torch.arange(40, dtype=torch.int64) * (rank + 1),
        torch.tensor([rank == 0, rank == 1]),
        torch.full((2,), rank, dtype=torch.float16),
        torch.full((4,), rank + 0.25),
        base.t(),
        torch.empty(0),
    ]
    tensors = [t.to(rank_device()) for t in tensors[:5]] + [
        base.to(rank_device()).t(),  # still a non-contiguous view where it lives
        tensors[6].to(rank_device()),
    ]
    broadcast_coalesced(tensors, src=0, bucket_bytes=64)
    out["coalesced"] = [t.tolist() for t in tensors]
    out.update(_sharded_checks(rank, rng_before))
    out.update(_drift_checks(rank))
    return out


def _drift_checks(rank: int) -> dict[str, Any]:
    """replica_drift on DDP (untouched, then one parameter nudged on rank 1) and FSDP."""
    import time
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    from replica_init import replica_drift

    out: dict[str, Any] = {}
    model = build_replicated_model(
        ToyNet, PARAMS, device=rank_device(), default_dtype=torch.float32, seed=3
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(model, broadcast_buffers=False)
    with ddp.no_sync():  # local gradients, before any reduction: different on each rank
        tokens = torch.full((2, 3), rank + 1, dtype=torch.long, device=rank_device())
        ddp(tokens).float().pow(2).mean().backward()
    begin = time.perf_counter()
    clean = replica_drift(ddp)
    out["drift_ms"] = (time.perf_counter() - begin) * 1e3
    out["drift_clean"] = (clean.compared, clean.drifted, clean.tensor, str(clean))
    out["drift_norms"] = clean.grad_norms
    if rank == 1:
        with torch.no_grad():
            model.blocks[1].mlp[0].weight[2, 3] += 1e-3
    nudged = replica_drift(ddp)
    out["drift_nudged"] = (nudged.drifted, nudged.tensor, nudged.ranks, nudged.max_abs_diff)
    out["drift_line"] = str(nudged)
    out["drift_chunked"] = _chunked_drift(ddp)
    sharded = _shard(
        build_replicated_model(
            ToyNet, PARAMS, device=rank_device(), default_dtype=torch.float32, seed=3
        )
    )
    out["drift_fsdp"] = (replica_drift(sharded).compared, str(replica_drift(sharded)))
    out.update(_group_drift_checks(rank))
    return out


class _EachRankAGroup:
    """dist-core's ReplicaReduce with each rank its own replica group (id 10 + rank): the
    sum is a real all-reduce over the default group, as torchft's is over its groups."""

    def __init__(self, rank: int, *, fail: bool = False) -> None:
        self.rank, self.fail = rank, fail

    def sum_(self, tensor: torch.Tensor) -> None:
        local = tensor.clone()
        dist.all_reduce(tensor)
        if self.fail and self.rank == 1:  # a reduce that failed here: the group's own values
            tensor.copy_(local)

    def live(self) -> int:
        return dist.get_world_size()

    def position(self) -> int:
        return self.rank

    def replica_id(self) -> int:
        return 10 + self.rank


def _group_drift_checks(rank: int) -> dict[str, Any]:
    """replica_drift across replica groups (each rank a group of its own, a plain model)."""
    from dist_core import set_replica_reduce
    from replica_init import replica_drift

    out: dict[str, Any] = {}
    model = build_replicated_model(
        ToyNet, PARAMS, device=rank_device(), default_dtype=torch.float32, seed=3
    )
    set_replica_reduce(model, _EachRankAGroup(rank))
    clean = replica_drift(model)
    out["groups_clean"] = (clean.drifted, clean.groups, clean.groups_drifted, str(clean))
    if rank == 1:
        with torch.no_grad():
            model.blocks[0].mlp[0].bias[1] += 1e-6
    nudged = replica_drift(model)
    out["groups_nudged"] = (nudged.drifted, nudged.tensor, nudged.groups_drifted, str(nudged))
    set_replica_reduce(model, _EachRankAGroup(rank, fail=True))
    try:
        replica_drift(model)
        out["groups_failed"] = None
    except RuntimeError as error:
        out["groups_failed"] = str(error)
    return out


def _chunked_drift(ddp: nn.Module) -> dict[str, Any]:
    """The nudged tensor measured through a 16-byte chunk: no gather of the whole tensor (it
    gathered one copy per rank onto every rank), at most one chunk in flight."""
    from replica_init import _drift, replica_drift

    sizes: list[int] = []
    broadcast, gather = dist.broadcast, dist.all_gather

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(tensor.numel() * tensor.element_size())
        return broadcast(tensor, *args, **kwargs)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("replica_drift gathered a whole tensor")

    chunk, _drift.CHUNK_BYTES = _drift.CHUNK_BYTES, 64  # 4 elements of float64 temporaries
    dist.broadcast, dist.all_gather = spy, refused  # type: ignore[assignment]
    try:
        report = replica_drift(ddp)
    finally:
        _drift.CHUNK_BYTES = chunk
        dist.broadcast, dist.all_gather = broadcast, gather  # type: ignore[assignment]
    return {
        "found": (report.tensor, report.ranks, report.max_abs_diff),
        "largest": max(sizes, default=0),
        "chunks": len(sizes),
    }


def _shard(model: nn.Module) -> nn.Module:
    """FSDP2 as fsdp-wrap applies it: each block, then the root."""
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _full_fingerprint(model: nn.Module) -> str:
    """The whole model's fingerprint, gathering each sharded tensor (a test-only cost)."""
    return state_fingerprint(
        (name, t.full_tensor() if isinstance(t, DTensor) else t)
        for name, t in named_state_tensors(model)
    )


def _sharded_checks(rank: int, rng_before: torch.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {}
    build = {"device": rank_device(), "default_dtype": torch.float32, "shard": _shard}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        reference = ToyNet(**PARAMS)
    out["sharded_reference"] = model_fingerprint(reference)
    for source in ("local", "rank0"):
        built = build_sharded_model(ToyNet, PARAMS, seed=3, source=source, **build)
        model = built.module
        out[f"sharded_{source}"] = {
            "full": _full_fingerprint(model),
            "verified": built.fingerprint,
            "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
            "tied": model.head.weight is model.embed.weight,
            "noise": model.noise.tolist(),
            "rng_unchanged": torch.equal(torch.get_rng_state(), rng_before),
            "dtype": torch.get_default_dtype() == torch.float32,
        }
    try:
        build_sharded_model(ToyNet, PARAMS, seed=100 + rank, source="local", **build)
    except ReplicaMismatchError as error:
        out["sharded_seed_mismatch"] = (str(error), error.ranks, error.tensor)

    def flip_on_rank1(model: nn.Module) -> nn.Module:
        _shard(model)
        if rank == 1:
            with torch.no_grad():
                local = model.blocks[1].mlp[0].bias.to_local()
                local.view(torch.int32)[0] ^= 1
        return model

    try:
        build_sharded_model(
            ToyNet, PARAMS, seed=3, source="local", **{**build, "shard": flip_on_rank1}
        )
    except ReplicaMismatchError as error:
        out["sharded_bit_mismatch"] = (str(error), error.ranks, error.tensor)
    try:
        build_sharded_model(_fails_on_rank0, PARAMS, seed=3, source="rank0", **build)
    except Exception as error:
        out["sharded_rank0_failure"] = f"{type(error).__name__}: {error}"

    def fails_on_rank1(model: nn.Module) -> nn.Module:
        if rank == 1:
            raise ValueError("shard failed on rank 1")
        return _shard(model)

    try:  # rank 0 would wait in the stream's first broadcast until the group's timeout
        build_sharded_model(
            ToyNet, PARAMS, seed=3, source="rank0", **{**build, "shard": fails_on_rank1}
        )
    except Exception as error:
        out["sharded_wrap_failure"] = f"{type(error).__name__}: {error}"
    return out


def hsdp_drift(rank: int, world_size: int) -> dict[str, Any]:
    """replica_drift under HSDP 2 x 2: each shard compared across the replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    from replica_init import replica_drift

    mesh = init_device_mesh(
        rank_device().type, (2, world_size // 2), mesh_dim_names=("replicate", "shard")
    )
    model = build_replicated_model(
        ToyNet, PARAMS, device=rank_device(), default_dtype=torch.float32, seed=3
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    clean = replica_drift(model)
    if rank == 3:  # replica 1's copy of shard 1
        with torch.no_grad():
            local = model.blocks[0].mlp[2].bias.to_local()
            local.add_(0.5)
    nudged = replica_drift(model)
    return {
        "clean": (clean.compared, clean.drifted, clean.group_ranks),
        "nudged": (nudged.drifted, nudged.tensor, nudged.ranks, nudged.max_abs_diff),
    }
