"""``build_sharded_model``: a sharded model on every rank, never whole on the device.

For FSDP-style wrappers (torch's ``fully_shard``): the model is built where the whole of it
fits (the host, or only rank 0's host), sharded unit by unit onto the device by the caller's
``shard`` function, and, from rank 0, filled with rank 0's bits a bounded bucket at a time
(:mod:`replica_init._stream`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_core import (
    DeviceLike,
    agree,
    require_current_device,
    require_process_group,
    resolve_device,
)
from replica_init._build import (
    ModelFactory,
    build_on_meta,
    check_build_arguments,
    check_is_module,
    construct_on_cpu,
)
from replica_init._shards import assert_shards_identical, reference_digests
from replica_init._source import check_same_structure, check_source, materialize
from replica_init._stream import stream_bucket_bytes, stream_from_rank0, stream_targets

logger = logging.getLogger(__name__)

StageContext = Callable[[str], contextlib.AbstractContextManager[object]]
"""Called with a stage's name (``build``, ``trainable``, ``wrap``, ``load``, ``verify``)
around that stage's work: a hook for timing it or measuring its memory."""


@dataclasses.dataclass(frozen=True)
class ShardedModel:
    """What :func:`build_sharded_model` built.

    Attributes:
        module: The sharded model (what ``shard`` returned).
        fingerprint: The digest of every rank's verified shards, in rank order (the same on
            every rank), or ``None`` when not verified. It identifies the sharded layout
            too, so it differs from :func:`model_fingerprint` of the whole model.
    """

    module: nn.Module
    fingerprint: str | None


def build_sharded_model(
    model_cls: ModelFactory,
    init_params: Mapping[str, Any] | None,
    *,
    device: DeviceLike,
    default_dtype: torch.dtype,
    seed: int,
    shard: Callable[[nn.Module], nn.Module],
    source: str = "local",
    trainable: Callable[[nn.Module], nn.Module] | None = None,
    verify: bool = True,
    stage: StageContext | None = None,
    shard_degree: int | None = None,
) -> ShardedModel:
    """Build the model sharded across the default group's ranks, bit-identical to a seeded build.

    The whole model is never placed on ``device``:

    - ``source="local"``: every rank constructs the whole model on the CPU under the seed
      (host memory: one model per rank), then ``shard`` moves it to ``device`` unit by unit
      (``fully_shard`` keeps only this rank's shards of each unit there).
    - ``source="rank0"``: rank 0 constructs on the CPU, the other ranks build the structure on
      the meta device (host memory: one model, on rank 0 only). Every rank shards its model;
      the other ranks allocate only their shards (``to_empty``), and rank 0's tensors
      (parameters and buffers, non-persistent ones too) are broadcast in packed buckets of
      at most ``STREAM_BUCKET_BYTES`` or half a rank's share of the model, whichever is
      less (a larger tensor alone), from which each rank keeps
      only its part (torch's ``distribute_tensor`` on the parameter's mesh, no further
      communication). Tied parameters stay tied and are sent once.

    Either way the full state equals ``torch.manual_seed(seed);
    torch.set_default_dtype(default_dtype); model_cls(**init_params)`` bit for bit, and the
    process's RNG streams and default dtype are left as they were.

    Verification (``verify``) costs O(model / world) per rank and gathers no tensor: every
    rank hashes (sha256) its local part of every tensor after sharding (its dim-0 shard of
    each parameter, each buffer whole), and a second rank hashes the same part of its own
    whole copy before sharding: under ``"local"`` rank ``r - 1`` referees rank ``r``'s shards
    from its independent build; under ``"rank0"`` rank 0 referees every other rank's shards
    from the model it built (rank 0 hashes the others' parts of the model once). Only the
    digests are gathered.
    A mismatch (different builds, a corrupted transfer, different structures) raises
    :class:`ReplicaMismatchError` on every rank, naming the ranks and the first tensor.

    Args:
        model_cls: A model class, or a factory returning an ``nn.Module``; under
            ``"rank0"`` it must be constructible on the meta device.
        init_params: Keyword arguments for ``model_cls``, or ``None``.
        device: This rank's device (``torch.device``, string, or CUDA index); for CUDA the
            current device.
        default_dtype: The floating default dtype during construction.
        seed: The construction seed, the same on every rank.
        shard: Shards the model in place and returns it, e.g.
            ``functools.partial(wrap_module_fsdp, device=device)``: it receives a model whose
            parameters are on the CPU (``"local"``, and rank 0 under ``"rank0"``) or on the
            meta device (the other ranks under ``"rank0"``) and must leave each parameter a
            ``DTensor`` sharded on dim 0 over the default group, as ``fully_shard`` does.
        source: ``"local"`` or ``"rank0"``.
        trainable: Applied to the built model before sharding (the trainer's trainable
            policy); returns the model to shard.
        verify: Check every rank's shards against a second rank's copy (see above).
        stage: A context factory wrapped around each stage (``build``, ``trainable``,
            ``verify``, ``wrap``, ``load``; ``verify`` may be entered twice).
        shard_degree: The ranks each parameter is sharded over: ``None`` for all of them
            (FSDP); HSDP's ``shard`` for a 2-D mesh, where ``shard`` leaves each parameter a
            ``DTensor`` replicated over the first mesh dimension and dim-0 sharded over the
            second, the ranks of one replica consecutive.

    Returns:
        A :class:`ShardedModel`: the sharded module and the verified fingerprint.

    Raises:
        RuntimeError: If the default process group is not initialized, or a rank failed to
            build the model (every rank raises, naming the failing ranks).
        TypeError, ValueError: Bad arguments, as for :func:`build_replicated_model`; a
            ``shard`` that is not callable or does not return a module.
        ReplicaMismatchError: If the ranks' structures or shards differ.
    """
    check_source(source)
    require_process_group("build_sharded_model", instead="or build a full replica")
    params = check_build_arguments(model_cls, init_params, default_dtype)
    target = resolve_device(device)
    if not callable(shard):
        raise TypeError(
            f"shard must be a callable that shards the model and returns it (e.g. "
            f"functools.partial(wrap_module_fsdp, device=...)), got {type(shard).__name__}"
        )
    around = stage or _no_stage
    rank, world = dist.get_rank(), dist.get_world_size()
    model: nn.Module | None = None
    failure: Exception | None = None
    try:
        # Checked on every rank and reported in the agreement below: a rank that raised
        # alone would leave the others waiting in it.
        require_current_device(target, caller="build_sharded_model")
        with around("build"):
            if source == "local" or rank == 0:
                model = construct_on_cpu(
                    model_cls, params, default_dtype=default_dtype, seed=seed, rng_device=target
                )
            else:
                model = build_on_meta(model_cls, params, default_dtype)
        if trainable is not None:
            with around("trainable"):
                model = trainable(model)
                check_is_module(trainable, model)
    except Exception as error:
        failure = error
    # Every rank reports, failed or not, so that no rank waits forever on one that raised.
    check_same_structure(model, failure, None)
    assert model is not None
    full: dict[str, torch.Tensor] | None = None
    targets = stream_targets(model)
    whole = sum(t.numel() * t.element_size() for _, t in targets)  # meta too
    if source == "rank0" and rank == 0:
        # Detached aliases of the host storage, no copy. Not the Parameters themselves:
        # fully_shard moves each one's .data to the device, and holding them would keep the
        # whole model there until the load.
        full = {name: tensor.detach() for name, tensor in targets}
    del targets
    references: dict[int, list[tuple[str, str]]] = {}
    sharded: nn.Module | None = None
    if verify:
        try:
            with around("verify"):
                # rank0: rank 0 referees the others (its shards are cut from its own model).
                referees = range(1, world) if source == "rank0" else [(rank + 1) % world]
                if source == "local" or rank == 0:
                    degree = world if shard_degree is None else shard_degree
                    references = reference_digests(model, referees, degree)
        except Exception as error:
            failure = error
        # Agreed before the wrap, which may run collectives of its own (a new mesh's groups).
        agree(failure, "hashing the reference shards")
    try:
        with around("wrap"):
            sharded = shard(model)
            check_is_module(shard, sharded)
        if source == "rank0" and rank != 0:
            with around("load"):
                materialize(sharded, target)
    except Exception as error:
        failure = error
    # Agreed before the stream: a rank that failed to shard must not leave the others
    # waiting in its first broadcast until the timeout.
    agree(failure, "sharding the model")
    assert sharded is not None
    del model
    if source == "rank0":
        with around("load"):
            stream_from_rank0(
                stream_targets(sharded),
                full,
                target,
                bucket_bytes=stream_bucket_bytes(whole, world),
            )
        del full
    fingerprint = None
    if verify:
        with around("verify"):
            fingerprint = assert_shards_identical(sharded, references)
    logger.debug("sharded model built (source=%s, %d ranks, verified=%s)", source, world, verify)
    return ShardedModel(sharded, fingerprint)


@contextlib.contextmanager
def _no_stage(name: str) -> Any:
    yield
