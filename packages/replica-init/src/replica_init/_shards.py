"""Verify a sharded model in O(model / world) per rank: every shard against a second copy."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from dist_core import agree
from replica_init._fingerprint import combine, digest_entry, named_state_tensors
from replica_init._verify import ReplicaMismatchError

Digests = list[tuple[str, str]]


def reference_digests(
    model: nn.Module, slices: Iterable[int], shard_degree: int
) -> dict[int, Digests]:
    """Digests of the parts that ranks ``slices`` will hold, from this rank's whole model.

    A parameter's part for rank ``r`` is its ``(r % shard_degree)``-th dim-0 chunk
    (``torch.chunk`` into ``shard_degree`` pieces, empty past the last chunk: FSDP2's layout;
    under HSDP the ranks of one replica are consecutive and each replica holds the same
    chunks); a buffer is held whole.
    """
    return {
        index: [
            digest_entry(name, _slice(name, tensor, index % shard_degree, shard_degree))
            for name, tensor in named_state_tensors(model)
        ]
        for index in slices
    }


def local_digests(model: nn.Module) -> Digests:
    """Digests of what this rank holds of every tensor: its shard of a ``DTensor``, else all."""
    return [
        digest_entry(name, _local_part(name, tensor)) for name, tensor in named_state_tensors(model)
    ]


def assert_shards_identical(sharded: nn.Module, references: dict[int, Digests]) -> str:
    """Compare every rank's shards with the digests its referees computed; collective.

    Args:
        sharded: This rank's sharded model.
        references: The digests this rank computed, before sharding, of other ranks' parts
            (:func:`reference_digests`); empty where this rank referees nobody.

    Returns:
        The digest of every rank's local digests, in rank order (the same on every rank).

    Raises:
        ReplicaMismatchError: On every rank, if a rank's shards differ from a referee's
            copy, naming the rank, the referee and the first differing tensor.
    """
    mine: Digests = []
    failure: Exception | None = None
    try:
        mine = local_digests(sharded)
    except Exception as error:  # reported to every rank, not raised alone
        failure = error
    gathered: list[tuple[Digests, dict[int, Digests]]] = agree(
        failure, "verifying the shards", share=(mine, references)
    )
    for referee, (_, theirs) in enumerate(gathered):
        for owner, expected in sorted(theirs.items()):
            held = gathered[owner][0]
            if held != expected:
                tensor, detail = _first_difference(held, expected)
                raise ReplicaMismatchError(
                    f"sharded model differs: the shards rank {owner} holds differ from rank "
                    f"{referee}'s copy of them, first at {detail}. Build every rank from the "
                    "same seed, init_params and default dtype (or use source='rank0')",
                    ranks=[owner],
                    tensor=tensor,
                    fingerprints=[combine(local) for local, _ in gathered],
                )
    return combine([entry for local, _ in gathered for entry in local])


def _slice(name: str, tensor: torch.Tensor, index: int, world: int) -> torch.Tensor:
    if not name.startswith("param:"):
        return tensor
    chunks = torch.chunk(tensor.detach(), world, dim=0)
    if index < len(chunks):
        return chunks[index]
    return tensor.detach().new_empty((0, *tensor.shape[1:]))


def _local_part(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, DTensor):
        return tensor
    world = dist.get_world_size()
    mesh = tensor.device_mesh
    fsdp = mesh.ndim == 1 and tensor.placements == (Shard(0),)
    hsdp = mesh.ndim == 2 and tensor.placements == (Replicate(), Shard(0))
    if not (fsdp or hsdp) or mesh.size() != world:
        raise ValueError(
            f"cannot verify {name}: it is sharded as {tensor.placements} over a mesh of shape "
            f"{tuple(mesh.shape)}, and verification knows dim-0 shards over all {world} ranks "
            "(fully_shard's default) or over the shard dimension of an HSDP mesh; pass "
            "verify=False"
        )
    return tensor.to_local()


def _first_difference(held: Digests, expected: Digests) -> tuple[str | None, str]:
    for (key, digest), (want_key, want) in zip(held, expected, strict=False):
        if (key, digest) != (want_key, want):
            name = key.split("|", 1)[0]
            if key != want_key:
                return name, f"'{key}' where '{want_key}' was expected"
            return name, f"'{name}' (sha256 {digest[:12]} vs {want[:12]})"
    return None, f"a different number of tensors ({len(held)} vs {len(expected)})"
