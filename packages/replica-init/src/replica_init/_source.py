"""``build_replicated_model``: every rank constructs, or rank 0 constructs and broadcasts."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_core import (
    DeviceLike,
    require_current_device,
    require_process_group,
    resolve_device,
)
from replica_init._broadcast import broadcast_coalesced
from replica_init._build import (
    ModelFactory,
    build_on_meta,
    build_replicated_model_from_scratch,
    check_build_arguments,
)
from replica_init._fingerprint import named_state_tensors
from replica_init._verify import ReplicaMismatchError
from strategy_config import BUILD_SOURCES

logger = logging.getLogger(__name__)


def build_replicated_model(
    model_cls: ModelFactory,
    init_params: Mapping[str, Any] | None,
    *,
    device: DeviceLike,
    default_dtype: torch.dtype,
    seed: int,
    source: str = "local",
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Build the replica on every rank, locally or from rank 0.

    Args:
        model_cls: A model class, or a factory returning an ``nn.Module``.
        init_params: Keyword arguments for ``model_cls``, or ``None``.
        device: Where the replica lives (``torch.device``, string, or CUDA index).
        default_dtype: The floating default dtype during construction.
        seed: The construction seed.
        source: ``"local"``: every rank runs :func:`build_replicated_model_from_scratch`.
            ``"rank0"``: rank 0 of ``group`` constructs; the other ranks build the structure on
            the meta device and receive every parameter and buffer (non-persistent ones too)
            by broadcast. Same bits as ``"local"``, one CPU construction in all, and no host
            copy of the model on the other ranks of a GPU host. The model must be
            constructible on the meta device.
        group: The process group for ``"rank0"``; ``None`` is the default group.

    Returns:
        The model on ``device``; no tensor is left on the meta device.

    Raises:
        ValueError: If ``source`` is not ``"local"`` or ``"rank0"``, or see
            :func:`build_replicated_model_from_scratch`.
        RuntimeError: If ``source="rank0"`` and the process group is not initialized.
        ReplicaMismatchError: If the ranks' model structures differ (``"rank0"``).
    """
    check_source(source)
    if source == "local":
        return build_replicated_model_from_scratch(
            model_cls, init_params, device=device, default_dtype=default_dtype, seed=seed
        )
    require_process_group("build_replicated_model(source='rank0')", instead="or use source='local'")
    model: nn.Module | None = None
    failure: Exception | None = None
    try:
        require_current_device(resolve_device(device), caller="build_replicated_model")
        if dist.get_rank(group) == 0:
            model = build_replicated_model_from_scratch(
                model_cls, init_params, device=device, default_dtype=default_dtype, seed=seed
            )
        else:
            params = check_build_arguments(model_cls, init_params, default_dtype)
            target = resolve_device(device)
            model = materialize(build_on_meta(model_cls, params, default_dtype), target)
    except Exception as error:
        failure = error
    # Every rank reports, failed or not, so that no rank waits forever on one that raised.
    check_same_structure(model, failure, group)
    assert model is not None
    src = 0 if group is None else dist.get_global_rank(group, 0)
    tensors = [tensor.data for _, tensor in named_state_tensors(model)]  # ties listed once
    broadcast_coalesced(tensors, src=src, group=group)
    logger.debug("replica received from rank %d: %d tensors, coalesced", src, len(tensors))
    return model


def check_source(source: object) -> None:
    """Raise ``ValueError`` unless ``source`` is a build source (``"local"``, ``"rank0"``)."""
    if source not in BUILD_SOURCES:
        raise ValueError(
            f"source must be one of {{{', '.join(sorted(BUILD_SOURCES))}}}, got {source!r}; "
            "use 'local' (every rank constructs) or 'rank0' (rank 0 constructs and sends)"
        )


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """Allocate storage on ``device`` for a meta model, keeping tied parameters tied."""
    ties = _shared_tensors(model)
    model.to_empty(device=device)
    for owners in ties:
        (first_module, first_name), *rest = owners
        shared = getattr(first_module, first_name)
        for module, name in rest:
            setattr(module, name, shared)
    return model


def _shared_tensors(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of ``(module, attribute)`` that refer to one and the same tensor."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None:
                owners.setdefault(id(tensor), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def check_same_structure(
    model: nn.Module | None, failure: Exception | None, group: dist.ProcessGroup | None
) -> None:
    """Collective: raise on every rank if any rank failed, or the ranks' structures differ.

    Each rank reports its failure or its tensors' names, dtypes and shapes (meta tensors
    included), so that a rank that raised leaves no other rank waiting in a later collective.
    """
    if model is None or failure is not None:
        report: Any = f"{type(failure).__name__}: {failure}"
    else:
        report = [(n, str(t.dtype), tuple(t.shape)) for n, t in named_state_tensors(model)]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, report, group=group)
    if failure is not None:
        raise failure
    failed = [rank for rank, r in enumerate(gathered) if isinstance(r, str)]
    if failed:
        raise RuntimeError(
            f"ranks {failed} failed to build the model ({gathered[failed[0]]}); see the "
            "traceback on those ranks"
        )
    differing = [rank for rank, r in enumerate(gathered) if r != gathered[0]]
    if differing:
        first = next(
            (a[0] for a, b in zip(gathered[0], gathered[differing[0]], strict=False) if a != b),
            "(different number of tensors)",
        )
        raise ReplicaMismatchError(
            f"model structures differ before the broadcast: ranks {differing} differ from "
            f"rank 0, first at {first}; every rank must pass the same model_cls, init_params "
            "and default_dtype",
            ranks=differing,
            tensor=first,
            fingerprints=[],
        )
