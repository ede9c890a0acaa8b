"""The state a checkpoint holds, keyed by the plain model's names, and load templates."""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from checkpoint_io._collective import from_rank0
from checkpoint_io._errors import CheckpointError
from dist_core import rank, require_current_device, state_groups, unwrap_model
from replica_init import state_fingerprint
from strategy_config import did_you_mean

MODEL, OPTIM, STATEFUL = "model", "optim", "stateful"


def require_model_device(model: nn.Module, caller: str) -> None:
    """Refuse a model on an accelerator other than the current one (collectives stage there).

    Raises:
        ValueError: Naming the device and the ``set_device`` call to make.
    """
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    if first is not None:
        require_current_device(first.device, caller=caller, argument="the model's device")


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under its plain names (no ``module.``/``_orig_mod.``/FSDP prefix).

    Under FSDP2 the values are this rank's ``DTensor`` shards; DCP writes and reshards them.
    """
    state: dict[str, torch.Tensor] = get_model_state_dict(model)  # type: ignore[assignment]
    return state


def tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of the model's state-dict names that share one tensor (a tied embedding)."""
    return [list(names) for names, _ in state_groups(model) if len(names) > 1]


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> plain name`` (the same objects the optimizer holds, DTensors too)."""
    return {id(p): name for name, p in unwrap_model(model).named_parameters()}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name; parameters without state are absent.

    Written here rather than with ``get_optimizer_state_dict``: that one gives an optimizer
    with no state yet a state by running a step with zero gradients (it changes the user's
    optimizer, and AdamW's step count), and its loader refuses a state in which some
    parameters have none (a head not trained yet, conditioning features without a gradient).
    """
    names = _optimizer_names(model, optimizer)
    saved = optimizer.state_dict()
    state = {names[index]: dict(values) for index, values in saved["state"].items()}
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [names[i] for i in group["params"]],
        }
        for group in saved["param_groups"]
    ]
    buffer = io.BytesIO()
    torch.save(groups, buffer)  # hyperparameters and names: one opaque entry in DCP
    buffer.seek(0)
    return {"state": state, "param_groups": buffer}


def _optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    by_id = parameter_names(model)
    names = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = by_id.get(id(param))
            if name is None:
                raise CheckpointError(
                    f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not "
                    f"a parameter of {type(unwrap_model(model)).__name__}; build the optimizer "
                    "from model.parameters() after wrapping"
                )
            names.append(name)
    return names


def load_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, loaded: Mapping[str, Any]
) -> None:
    """Put a loaded name-keyed optimizer state into ``optimizer`` (its own index order)."""
    names = _optimizer_names(model, optimizer)
    index = {name: i for i, name in enumerate(names)}
    saved_groups = saved_param_groups(loaded["param_groups"])
    current = check_optimizer_groups(model, optimizer, saved_groups)
    groups = [
        {**{k: v for k, v in saved.items() if k != "params"}, "params": [index[n] for n in now]}
        for saved, now in zip(saved_groups, current, strict=True)
    ]
    state = {index[name]: values for name, values in loaded["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def saved_param_groups(value: Any) -> list[dict[str, Any]]:
    """The saved ``param_groups`` from their value (a buffer of ``torch.save`` bytes).

    Raises:
        CheckpointError: If the value is not a list of groups with ``params`` lists.
    """
    if isinstance(value, io.BytesIO):
        value.seek(0)
        value = torch.load(value, weights_only=True, map_location="cpu")
    if not isinstance(value, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in value
    ):
        raise CheckpointError("the checkpoint's optimizer param_groups are malformed")
    return value


def check_optimizer_groups(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved_groups: list[dict[str, Any]]
) -> list[list[str]]:
    """The optimizer's groups by parameter name, checked against the saved ones.

    Raises:
        CheckpointError: If the groups hold other parameters than the saved ones.
    """
    names = _optimizer_names(model, optimizer)
    current = [
        [names[i] for i in range(start, start + len(g["params"]))]
        for start, g in _starts(optimizer)
    ]
    if [sorted(g["params"]) for g in saved_groups] != [sorted(g) for g in current]:
        raise CheckpointError(
            "the optimizer's parameter groups differ from the saved ones (saved "
            f"{[len(g['params']) for g in saved_groups]} parameters per group, now "
            f"{[len(g) for g in current]}); build the optimizer with the same groups"
        )
    return current


def _starts(optimizer: torch.optim.Optimizer) -> Iterator[tuple[int, dict[str, Any]]]:
    start = 0
    for group in optimizer.param_groups:
        yield start, group
        start += len(group["params"])


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


def saved_entries(metadata: Metadata, top: str) -> dict[tuple[Any, ...], Any]:
    """``path -> storage metadata`` of the entries under ``top`` (paths without ``top``)."""
    paths = metadata.planner_data or {}
    found: dict[tuple[Any, ...], Any] = {}
    for key, storage in metadata.state_dict_metadata.items():
        path = paths.get(key, tuple(key.split(".", 1)))
        if path and path[0] == top:
            found[tuple(path[1:])] = storage
    return found


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


def check_files(root: Any, metadata: Metadata) -> None:
    """Every data file the metadata points at is there and long enough (no read needed).

    Raises:
        CheckpointError: A data file is missing or shorter than its entries (truncated).
    """
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            end = int(info.offset) + int(info.length)
            needed[path] = max(needed.get(path, 0), end)
    for name, end in sorted(needed.items()):
        file = root / name
        size = file.stat().st_size if file.is_file() else -1
        if size < end:
            found = "missing" if size < 0 else f"{size} bytes, its entries need {end}"
            raise CheckpointError(
                f"the checkpoint is truncated or corrupt: data file {name} is {found}; "
                "save it again (or restore it from a copy)"
            )


def optimizer_template(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    metadata: Metadata,
    *,
    strict: bool,
) -> dict[str, Any]:
    """What to load the saved optimizer state into: shaped like each parameter where it is.

    Fresh tensors (the staging of a load): the optimizer's own state is replaced only once
    everything was read and checked.
    """
    params = dict(unwrap_model(model).named_parameters())
    state: dict[str, dict[str, Any]] = {}
    for path, storage in saved_entries(metadata, OPTIM).items():
        if path[0] != "state":
            continue
        name, key = path[1], path[2]
        param = params.get(name)
        if param is None:
            if strict:
                raise CheckpointError(
                    f"the checkpoint has optimizer state for '{name}'"
                    f"{did_you_mean(name, params)}, which the model does not have; pass "
                    "strict=False to skip it"
                )
            continue
        if not isinstance(storage, TensorStorageMetadata):
            state.setdefault(name, {})[key] = None
        elif tuple(storage.size) == tuple(param.shape):
            state.setdefault(name, {})[key] = torch.empty_like(
                param, dtype=storage.properties.dtype
            )
        else:  # a scalar step, or a factored statistic: a whole tensor on every rank
            device = "cpu" if len(storage.size) == 0 else _local(param).device
            state.setdefault(name, {})[key] = torch.empty(
                tuple(storage.size), dtype=storage.properties.dtype, device=device
            )
    return {"state": state, "param_groups": io.BytesIO()}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """``state_fingerprint`` of a state without ``DTensor``s, in this process (no collective)."""
    return state_fingerprint((name, state[name]) for name in sorted(state))


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """``state_fingerprint`` of the full tensors of ``state``, the same on every rank (collective).

    Sharded tensors are gathered one at a time (every rank takes part); rank 0 hashes. Used
    only to verify checkpoints of format 1, which recorded this value.
    """

    def full() -> Iterator[tuple[str, torch.Tensor]]:
        for name in sorted(state):
            tensor = state[name]
            yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    if rank() == 0:
        value = state_fingerprint(full())
    else:
        if any(isinstance(t, DTensor) for t in state.values()):
            for _ in full():
                pass
        value = ""
    return from_rank0(value)


def model_class(model: nn.Module) -> str:
    """The user's model class name (FSDP2 swaps the class for an ``FSDP<Name>`` subclass)."""
    inner = unwrap_model(model)
    cls = next(c for c in type(inner).__mro__ if not issubclass(c, FSDPModule))
    return f"{cls.__module__}.{cls.__qualname__}"


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (this rank's device)."""
    for param in model.parameters():
        return _local(param).device
    return torch.device("cpu")
