"""The state a checkpoint holds, keyed by the plain model's names, and load templates."""

from __future__ import annotations

import io
import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from checkpoint_io._compat import CheckpointWrapper
from checkpoint_io._errors import CheckpointError
from checkpoint_io._storage.manifest import MODEL
from checkpoint_io._storage.tiling import saved_entries
from dist_core import (
    compute_device,
    is_distributed,
    local_tensor,
    require_current_device,
    state_groups,
    unwrap_compiled,
    unwrap_model,
)
from replica_init import state_fingerprint
from strategy_config import did_you_mean


def require_model_device(model: nn.Module, caller: str) -> None:
    """Refuse a model on an accelerator other than the current one (collectives stage there).

    Raises:
        ValueError: Naming the device and the ``set_device`` call to make.
    """
    if next(itertools.chain(model.parameters(), model.buffers()), None) is not None:
        device = compute_device(model)
        require_current_device(device, caller=caller, argument="the model's device")


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under its plain names (no ``module.``/``_orig_mod.``/FSDP prefix).

    Under FSDP2 the values are this rank's ``DTensor`` shards; DCP writes and reshards them.
    """
    if _unsharded(model):
        return unwrap_model(model).state_dict()
    state: dict[str, torch.Tensor] = get_model_state_dict(model)  # type: ignore[assignment]
    return state


def load_model(model: nn.Module, state: dict[str, torch.Tensor], *, strict: bool) -> None:
    """Copy ``state`` (plain names, as :func:`model_state` gives them) into ``model``."""
    if _unsharded(model):
        unwrap_model(model).load_state_dict(state, strict=strict)
    else:
        set_model_state_dict(model, dict(state), options=StateDictOptions(strict=strict))


def _unsharded(model: nn.Module) -> bool:
    """Whether torch's state-dict helpers would give the unwrapped module's own state_dict."""
    # NOTE: without FSDP, DSD's state dict is the module's own (same names, same tensors) once
    # DDP and torch.compile around the whole are peeled; what else DSD renames, and keys a
    # state_dict hook adds, go through it (tests/checkpoint_io/test_model_names.py).
    layer = model
    while isinstance(layer, DistributedDataParallel) or unwrap_compiled(layer) is not layer:
        layer = (
            layer.module if isinstance(layer, DistributedDataParallel) else unwrap_compiled(layer)
        )
    return not any(
        unwrap_model(m) is not m
        or isinstance(m, FSDPModule)
        or hasattr(m, "_fqn_modifiers")
        or (m._state_dict_hooks and not isinstance(m, CheckpointWrapper))
        for m in layer.modules()
    )


def tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of the model's state-dict names that share one tensor (a tied embedding)."""
    return [list(names) for names, _ in state_groups(model) if len(names) > 1]


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> plain name`` (the same objects the optimizer holds, DTensors too)."""
    return {id(p): name for name, p in unwrap_model(model).named_parameters()}


def template(value: Any) -> Any:
    """A structure like ``value`` to load into: fresh tensors (never the live ones)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, io.BytesIO):
        return io.BytesIO()
    if isinstance(value, Mapping):
        return {key: template(item) for key, item in value.items()}
    if isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(template(item) for item in value)
    return value


def check_model_keys(
    current: Mapping[str, torch.Tensor], metadata: Metadata, *, strict: bool
) -> list[str]:
    """Compare the model's keys, shapes and dtypes with the saved ones; the keys to load.

    Raises:
        CheckpointError: Missing or unexpected keys (with ``strict``), each with the closest
            name on the other side; a shape or dtype mismatch, naming the key and both sides.
    """
    saved = {path[0]: storage for path, storage in saved_entries(metadata, MODEL).items()}
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if strict and (missing or unexpected):
        parts = []
        if missing:
            listed = ", ".join(f"'{k}'{did_you_mean(k, unexpected)}" for k in missing[:20])
            parts.append(f"missing from the checkpoint: {listed}")
        if unexpected:
            listed = ", ".join(f"'{k}'{did_you_mean(k, missing)}" for k in unexpected[:20])
            parts.append(f"in the checkpoint but not in the model: {listed}")
        raise CheckpointError(
            "the checkpoint's model keys do not match the model's: "
            + "; ".join(parts)
            + ". Load into the same model class, or pass strict=False to load the keys they share"
        )
    keys = sorted(set(current) & set(saved))
    for key in keys:
        storage, tensor = saved[key], current[key]
        if not isinstance(storage, TensorStorageMetadata):
            raise CheckpointError(f"'{key}' is saved as an object, but the model holds a tensor")
        if tuple(storage.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"shape mismatch for '{key}': the checkpoint has {tuple(storage.size)}, the model "
                f"{tuple(tensor.shape)}; build the model with the configuration it was saved with"
            )
        if storage.properties.dtype != tensor.dtype:
            raise CheckpointError(
                f"dtype mismatch for '{key}': the checkpoint has {storage.properties.dtype}, the "
                f"model {tensor.dtype}; build the model with the same default dtype"
            )
    return keys


def local_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """``state_fingerprint`` of a state without ``DTensor``s, in this process (no collective)."""
    return state_fingerprint((name, state[name]) for name in sorted(state))


def model_class(model: nn.Module) -> str:
    """The user's model class name (FSDP2 swaps the class for an ``FSDP<Name>`` subclass)."""
    inner = unwrap_model(model)
    cls = next(c for c in type(inner).__mro__ if not issubclass(c, FSDPModule))
    return f"{cls.__module__}.{cls.__qualname__}"


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The canonical full state dict as plain CPU tensors, under any strategy (collective).

    Keys are the plain model's ``state_dict()`` keys; FSDP2 shards are gathered. Use it for
    ``save_pretrained``, evaluation and export.

    Args:
        model: Plain, DDP, FSDP2 or compiled.
        rank0_only: Only rank 0 receives the tensors (the others get ``{}``), so the other
            ranks need no host memory for them.

    Returns:
        ``name -> CPU tensor``, never sharing storage with the model (a later step does not
        change it, whatever the device).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not is_distributed():
        state = model_state(model)
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
        state = get_model_state_dict(model, options=options)  # type: ignore[assignment]
    # Never an alias of the model's own storage (a DDP or plain model on the CPU): the
    # result is a snapshot, on the CPU as on CUDA, which training does not change.
    live = {_storage(t) for t in unwrap_model(model).state_dict().values()}
    return {k: _snapshot(v, live) for k, v in state.items()}


def _snapshot(tensor: torch.Tensor, live: set[int]) -> torch.Tensor:
    copy = tensor.detach().cpu()
    return copy.clone() if _storage(copy) in live else copy


def _storage(tensor: torch.Tensor) -> int:
    return int(local_tensor(tensor).untyped_storage().data_ptr())
